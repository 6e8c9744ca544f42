"""Real ansible-playbook runs through regen.runner on localhost: the fixture pipeline
(tests/fixtures/playbooks/runner: demo -> introspect -> generate, connection local, paths in a temp dir).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from regen.runner import (
    BadInput,
    ExitCode,
    JobProgress,
    RunResult,
    StageStarted,
    TaskStarted,
    history,
    load_run,
    run,
    run_async,
)
from regen.runner.secrets import MASK

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "tests" / "fixtures" / "playbooks" / "runner"
INVENTORY = PROJECT / "inventory"
SECRET = "sk-test-5f1d2c0a9b8e7d6c"


def _run(tmp: Path, stages=None, *, data: Path | None = None, **kwargs) -> RunResult:
    extravars = {
        "fixture_root": str(data or tmp / "data"),
        "fixture_delay": 0.2,
        **kwargs.pop("extravars", {}),
    }
    return run(
        stages,
        project_dir=PROJECT,
        inventory=INVENTORY,
        extravars=extravars,
        private_data_dir=tmp / "runner",
        fact_cache_dir=tmp / "facts",
        **kwargs,
    )


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RunResult, list]:
    """One full run of the fixture pipeline on a fresh directory, with the records on_event received."""
    tmp = tmp_path_factory.mktemp("pipeline")
    seen: list = []
    result = _run(tmp, on_event=seen.append, envvars={"REGEN_TEST_API_TOKEN": "tok-should-not-be-recorded"})
    return tmp, result, seen


def test_a_full_run_succeeds_stage_by_stage(pipeline) -> None:
    _, result, seen = pipeline
    assert result.ok and result.rc == 0 and result.exit_code is ExitCode.OK, result.to_dict(
        include_facts=False
    )
    assert [(s.name, s.status) for s in result.stages] == [
        ("demo_model", "changed"),
        ("introspect", "changed"),
        ("generate", "changed"),
    ]
    assert result.hosts["localhost"].failed == 0 and result.hosts["localhost"].changed > 0
    assert result.failed_task is None
    assert [r.stage for r in seen if isinstance(r, StageStarted)] == ["demo_model", "introspect", "generate"]
    assert seen == result.events


def test_facts_plan_and_artifacts_of_the_run(pipeline) -> None:
    tmp, result, _ = pipeline
    data = tmp / "data"
    assert result.facts == json.loads((data / "artifacts" / "model_facts.json").read_text())
    assert result.facts_source == "run"
    assert result.plan["drafter_target_layers"] == {
        "value": [1, 2],
        "reason": "two draft layers spread over the target's 4 layers",
    }
    assert result.artifacts.facts == [data / "artifacts" / "model_facts.json"]
    # what the stages recorded: the job's final status, and the output directory it names
    assert result.artifacts.status_files == [data / "artifacts" / "completions" / "status-localhost.json"]
    assert result.artifacts.completions == [data / "work" / "generate"]


def test_job_progress_arrives_from_the_status_file_and_the_watch_task(pipeline) -> None:
    tmp, result, _ = pipeline
    progress = [r for r in result.events if isinstance(r, JobProgress)]
    sources = {r.source for r in progress}
    status_file = str(tmp / "data" / "work" / "generate" / "status.json")
    assert status_file in sources, sources
    assert "task:Watch the job's status file" in sources
    from_file = [r for r in progress if r.source == status_file]
    assert from_file[-1].status.finished and from_file[-1].host == "localhost"
    assert from_file[-1].status.total == 4


def test_the_run_record_is_rotated_summarised_and_free_of_secrets(pipeline) -> None:
    tmp, result, _ = pipeline
    record = result.artifact_dir
    assert record.parent == tmp / "runner" / "artifacts" and record.is_dir()
    summary = json.loads((record / "regen_summary.json").read_text())
    assert summary["status"] == "successful" and summary["stages"][0]["name"] == "demo_model"
    stdout = (record / "stdout").read_text()
    assert "PLAY RECAP" in stdout and "\x1b[" not in stdout
    command = json.loads((record / "command").read_text())
    assert command["env"]["REGEN_TEST_API_TOKEN"] == MASK
    assert command["env"]["ANSIBLE_CONFIG"] == str(ROOT / "ansible.cfg")
    assert not (tmp / "runner" / "env" / "extravars").exists()  # suppress_env_files
    assert "tok-should-not-be-recorded" not in "".join(
        p.read_text(errors="replace") for p in (tmp / "runner").rglob("*") if p.is_file()
    )


def test_a_second_run_changes_nothing(pipeline) -> None:
    tmp, _, _ = pipeline
    again = _run(tmp)
    assert again.ok
    assert [(s.name, s.status, s.counts.changed) for s in again.stages] == [
        ("demo_model", "ok", 0),
        ("introspect", "ok", 0),
        ("generate", "ok", 0),
    ]


def test_check_mode_reports_work_without_doing_it(pipeline) -> None:
    tmp, _, _ = pipeline
    completions = tmp / "data" / "work" / "generate" / "completions.jsonl"
    saved = completions.read_bytes()
    completions.unlink()
    try:
        check = _run(tmp, ["generate"], check=True)
        assert check.ok and check.check
        assert [(s.name, s.status, s.counts.changed) for s in check.stages] == [("generate", "changed", 1)]
        assert not completions.exists(), "check mode must not run the job"
        assert "--check" in json.loads((check.artifact_dir / "command").read_text())["command"]
    finally:
        completions.write_bytes(saved)


def test_history_reads_the_runs_back(pipeline) -> None:
    tmp, result, _ = pipeline
    runs = history(project_dir=PROJECT, private_data_dir=tmp / "runner", limit=20)
    assert result.ident in [r.ident for r in runs]
    first = next(r for r in runs if r.ident == result.ident)
    assert [(s.name, s.status) for s in first.stages] == [(s.name, s.status) for s in result.stages]
    # without regen's summary (a run that was killed) the same picture comes from the events alone
    (result.artifact_dir / "regen_summary.json").unlink()
    from regen.runner import discover_stages

    rebuilt = load_run(result.artifact_dir, stages=discover_stages(PROJECT))
    assert rebuilt.status == "successful"
    assert [(s.name, s.status) for s in rebuilt.stages] == [(s.name, s.status) for s in result.stages]


def test_a_failing_task_fails_its_stage(tmp_path: Path) -> None:
    result = _run(
        tmp_path,
        ["generate"],
        extravars={"fixture_fail": True, "fixture_fail_message": "HTTP 429 for 10 minutes"},
    )
    assert result.status == "failed" and result.exit_code is ExitCode.TASK_FAILED
    assert [(s.name, s.status) for s in result.stages] == [("generate", "failed")]
    failed = result.failed_task
    assert (failed.stage, failed.task, failed.host) == ("generate", "Refuse to generate", "localhost")
    assert failed.message == "generation endpoint refused: HTTP 429 for 10 minutes"
    assert result.tags == ["generate"]


def test_cancel_stops_a_running_task(tmp_path: Path) -> None:
    holding = threading.Event()

    def on_event(record) -> None:
        if isinstance(record, TaskStarted) and record.task == "Hold the stage":
            holding.set()

    handle = run_async(
        ["generate"],
        project_dir=PROJECT,
        inventory=INVENTORY,
        on_event=on_event,
        extravars={"fixture_root": str(tmp_path / "data"), "fixture_hold_seconds": 120},
        private_data_dir=tmp_path / "runner",
        fact_cache_dir=tmp_path / "facts",
    )
    assert holding.wait(60), "the long task never started"
    assert not handle.done()
    started = time.monotonic()
    handle.cancel()
    result = handle.wait(timeout=30)
    assert time.monotonic() - started < 10, "cancel took too long"
    assert result.status == "canceled" and result.exit_code is ExitCode.CANCELED
    assert [(s.name, s.status) for s in result.stages] == [("generate", "canceled")]
    assert not (tmp_path / "data" / "work" / "generate").exists(), "nothing after the held task ran"
    # runner kills ansible-playbook's group; its workers (own sessions) must not run on as orphans
    ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, check=True).stdout
    assert str(tmp_path) not in ps


def test_secrets_reach_the_play_but_no_file_or_log(tmp_path: Path) -> None:
    result = _run(
        tmp_path,
        ["generate"],
        secrets={"fixture_api_key": SECRET},
        extravars={"fixture_print_secret": True},
        skip_tags="fixture_job",
    )
    assert result.ok, result.to_dict(include_facts=False)
    digest = (tmp_path / "data" / "work" / "api_key.sha256").read_text()
    assert digest == hashlib.sha256(SECRET.encode()).hexdigest(), "the play did not get the real value"
    printed = next(
        r
        for r in result.events
        if getattr(r, "task", "").startswith("Print the API key") and r.kind == "task_result"
    )
    assert printed.status.value == "ok"
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == [], leaked
    assert not list((tmp_path / "runner" / "secrets").glob("*")), "the encrypted vars file outlived the run"
    stdout = (result.artifact_dir / "stdout").read_text()
    assert f"key is {MASK}" in stdout


# A key with every character that YAML, JSON, Python and shell quoting rewrite, and one outside ASCII:
# none of its pieces may show in any record, whatever encoding Ansible or runner chose for it.
QUOTED_SECRET = "sk-Zq9'Wv3\"Xp2\\Jm5 \u00e9-Rb4"
QUOTED_SECRET_PIECES = ("Zq9", "Wv3", "Xp2", "Jm5", "Rb4")


def test_a_key_with_quotes_is_masked_in_every_encoding_at_vvv(tmp_path: Path) -> None:
    result = _run(
        tmp_path,
        ["generate"],
        secrets={"fixture_api_key": QUOTED_SECRET},
        extravars={"fixture_print_secret": True},
        skip_tags="fixture_job",
        verbosity=3,  # the EXEC line with the command's environment, shell-quoted twice
    )
    assert result.ok, result.to_dict(include_facts=False)
    digest = (tmp_path / "data" / "work" / "api_key.sha256").read_text()
    assert digest == hashlib.sha256(QUOTED_SECRET.encode()).hexdigest(), "the play did not get the real value"
    stdout = (result.artifact_dir / "stdout").read_text()
    assert "EXEC" in stdout and "FIXTURE_KEY=" in stdout, "the -vvv command line was not recorded"
    leaked = {
        str(p.relative_to(tmp_path)): [
            piece for piece in QUOTED_SECRET_PIECES if piece.encode() in p.read_bytes()
        ]
        for p in tmp_path.rglob("*")
        if p.is_file()
    }
    assert {path: pieces for path, pieces in leaked.items() if pieces} == {}
    events = json.dumps([e.to_dict() for e in result.events], default=str)
    assert not [piece for piece in QUOTED_SECRET_PIECES if piece in events]
    # masked, not dropped: the debug message, the JSON, the argv, the command's output, the EXEC line
    masks = re.findall(rf"(?<!\*){re.escape(MASK)}(?!\*)", stdout)  # not the banners' runs of stars
    assert len(masks) >= 5, stdout


def test_event_data_runner_never_read_is_scrubbed_too(tmp_path: Path) -> None:
    # Fault injection: the partial file runner's callback leaves when the run stops before runner read it
    # (a cancel, a crash), planted where that callback writes it.
    ident = "planted-partial"
    partial = tmp_path / "runner" / "artifacts" / ident / "job_events" / "0a1b-partial.json"
    partial.parent.mkdir(parents=True)
    partial.write_text(json.dumps({"stdout": f"msg: 'key is {QUOTED_SECRET.replace(chr(39), chr(39) * 2)}'"}))
    result = _run(tmp_path, ["teardown"], ident=ident, secrets={"fixture_api_key": QUOTED_SECRET})
    assert result.ok
    text = partial.read_text()
    assert MASK in text and not [piece for piece in QUOTED_SECRET_PIECES if piece in text], text
    assert partial.stat().st_mode & 0o777 == 0o600


def test_a_standalone_stage_runs_its_own_playbook_and_records_rotate(tmp_path: Path) -> None:
    for _ in range(2):
        result = _run(tmp_path, ["teardown"], rotate_artifacts=1)
        assert result.ok and [s.name for s in result.stages] == ["teardown"]
    command = json.loads((result.artifact_dir / "command").read_text())["command"]
    assert command[-1] == str(PROJECT / "playbooks" / "teardown.yml")
    assert [p.name for p in (tmp_path / "runner" / "artifacts").iterdir()] == [result.ident]


def test_bad_input_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="unknown stage 'tokenise'"):
        _run(tmp_path, ["tokenise"])
    with pytest.raises(BadInput, match=r"inventory 'nowhere/hosts\.yml' does not exist"):
        run(["demo"], project_dir=PROJECT, inventory="nowhere/hosts.yml", private_data_dir=tmp_path / "r")
    with pytest.raises(BadInput, match="'model path' is not a valid Ansible variable name"):
        _run(tmp_path, ["demo"], extravars={"model path": "/x"})
    with pytest.raises(BadInput, match="given both as extra var and as secret"):
        _run(tmp_path, ["demo"], secrets={"fixture_root": "x"})
    assert not (tmp_path / "runner" / "artifacts").exists()


def test_an_unparsable_playbook_is_exit_code_4(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "playbooks").mkdir(parents=True)
    (project / "regen.yml").write_text(
        "---\n- name: Broken stage\n  ansible.builtin.import_playbook: playbooks/b.yml\n"
    )
    (project / "playbooks" / "b.yml").write_text(
        "---\n- name: Broken\n  hosts: localhost\n  tasks:\n    - name: Nope\n      no.such.module: {}\n"
    )
    result = run(
        project_dir=project,
        inventory=INVENTORY,
        private_data_dir=tmp_path / "runner",
        extravars={"fixture_root": str(tmp_path)},
    )
    assert result.status == "failed" and result.exit_code is ExitCode.BAD_INPUT, result.to_dict()
    assert "no.such.module" in result.error
