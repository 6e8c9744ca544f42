"""The README's first command (`make regen`), end to end: the whole pipeline on the embedded default, twice.

The first run builds the demo model (a copy from the builder's cache when the tests built it already) and
runs every stage on localhost; its evaluation must discriminate: on the held-out prompts the trained drafter's
acceptance length lies clearly above the untrained one's (95% intervals apart) and the oracle reaches the
block size the report names. The second run must find all of it done and report changed=0 on every host. A
third run after the server was stopped (what the train stage does on a GPU host to free the GPUs) must leave
it stopped, since nothing is left to generate; it goes through `regen run` (ansible-runner, the repository's
own regen.yml on the embedded default), whose status and plan must then list every stage as done.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path

import pytest

from regen.cli import main
from regen.runner import discover_stages
from tests.helpers.ansible import ROOT, ansible_env, run_playbook

pytestmark = pytest.mark.e2e


def _run_pipeline(**env: str) -> tuple[str, dict[str, dict[str, int]]]:
    run = run_playbook("regen.yml", env=ansible_env(**env))
    assert run.returncode == 0, run.output[-6000:]
    assert run.recap, run.output[-3000:]
    return run.output, run.recap


# Where the embedded default keeps its state (data set, venvs, models; records), and what in it says that
# an earlier run got past its first stages: a first run would find those done, and show nothing to test.
_PIPELINE_STATE = (ROOT / ".work", ROOT / "artifacts")
_EARLIER_RUN = (
    ROOT / ".work" / "prompts",
    ROOT / ".work" / "completions",
    ROOT / "artifacts" / "model_facts.json",
)


@pytest.fixture
def first_run_of_the_checkout():
    """The pipeline's first run starts from nothing, and whatever `make regen` left is given back after.

    `make regen` then `make test` in one checkout (the README's two commands) would otherwise find every
    stage done and fail what the first run must show. When an earlier run's results are there, its server
    is stopped (the teardown playbook) and `.work/` and `artifacts/` are moved aside under .cache/ (a
    rename; a killed test loses nothing, the next one refuses to start until they are moved back), then
    moved back once the test's own run is stopped and removed; its venvs are built again meanwhile. The
    model server the test leaves is stopped either way, as `stop_local_server_afterwards` does for the
    other tests.
    """
    earlier = any(path.exists() for path in _EARLIER_RUN)
    kept = [path for path in _PIPELINE_STATE if path.exists()] if earlier else []
    aside = ROOT / ".cache" / "kept-by-the-e2e-test"
    if kept:
        assert not aside.exists(), f"{aside} holds what an earlier test run moved aside: move it back first"
        stop = run_playbook("playbooks/teardown.yml")
        assert stop.returncode == 0, stop.output[-3000:]
        aside.mkdir(parents=True)
        for path in kept:
            path.rename(aside / path.name)
    try:
        yield
    finally:
        stop = run_playbook("playbooks/teardown.yml")
        if kept:
            for path in _PIPELINE_STATE:
                shutil.rmtree(path, ignore_errors=True)
            for path in kept:
                (aside / path.name).rename(path)
            aside.rmdir()
    assert stop.returncode == 0, stop.output[-3000:]


@pytest.mark.timeout(1800)  # three whole runs on 2 cores, beside the molecule scenarios in `make test`
def test_pipeline_runs_and_second_run_changes_nothing(
    first_run_of_the_checkout, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a progress line at every poll (2 s on this inventory) instead of every 15 s: the demo's generation
    # takes seconds on an idle machine, and the line with the job's status must show within them
    output, first = _run_pipeline(REGEN_PROGRESS_INTERVAL_S="0")
    assert all(stats["failed"] == 0 and stats["unreachable"] == 0 for stats in first.values()), first
    # The wait loops print the jobs' progress, not a "FAILED - RETRYING" line per poll (issue 26 item 6).
    assert "FAILED - RETRYING" not in output
    assert re.search(r"Wait for the generation job .*: waiting \d+s: ", output), output[-6000:]
    # The run ends with the summary table, one row per stage that produced something.
    summary = output[output.index("regen summary") :]
    for row in ("model", "plan", "budget", "serve", "generate", "tokenize", "train", "evaluate"):
        assert re.search(rf"^\s+{row}\s", summary, re.MULTILINE), (row, summary[:2000])
    # The evaluation's headline: the oracle reaches the block size and every output was lossless.
    report = json.loads((ROOT / "artifacts" / "evaluate" / "report.json").read_text())
    block = report["block_size"]
    headline = rf"^\s+evaluate\s+acceptance length trained .*oracle {block}\.00 .*; lossless$"
    assert re.search(headline, summary, re.MULTILINE), summary[:3000]
    _the_length_budget_was_measured_and_followed()
    _assert_the_evaluation_discriminates(report)
    for plot in ("acceptance_by_position", "speedup_by_category", "acceptance_by_step"):
        assert (ROOT / "artifacts" / "evaluate" / f"{plot}.png").read_bytes()[:4] == b"\x89PNG", plot
        assert f"({plot}.png)" in (ROOT / "artifacts" / "evaluate" / "report.md").read_text()
    output, second = _run_pipeline()
    assert all(stats["changed"] == 0 for stats in second.values()), (second, output[-6000:])

    stop = run_playbook("playbooks/teardown.yml")
    assert stop.returncode == 0 and not _listening(30000), stop.output[-3000:]
    _third_run_through_regen_run(tmp_path / "runner", capsys)
    assert not _listening(30000)


def _third_run_through_regen_run(pdd: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The embedded default through `regen run`: every stage done, nothing changed, the server left stopped;
    then `regen status` and `regen plan` of the same private data dir say so."""
    capsys.readouterr()
    code = main(["run", "--plain", "--project", str(ROOT), "--private-data-dir", str(pdd)])
    out = capsys.readouterr().out
    assert code == 0, out[-6000:]
    assert "regen: exit 0 (ok): all stages ran" in out
    flat = " ".join(out.split())
    assert "regen-serve-main is not running and nothing downstream needs it" in flat, out[-6000:]
    assert re.search(r"^\s+serve\s+localhost-main: .*, stopped$", out, re.MULTILINE), out[-3000:]
    pipeline = [s.name for s in discover_stages(ROOT) if not s.standalone]
    assert main(["status", "--json", "--project", str(ROOT), "--private-data-dir", str(pdd)]) == 0
    # The run history also lists ansible-playbook runs on this checkout's artifacts (the two above among
    # them): this run is the one the runner recorded in its private data dir.
    (ident,) = [p.name for p in (pdd / "artifacts").iterdir() if p.is_dir()]
    (last,) = [r for r in json.loads(capsys.readouterr().out) if r["ident"] == ident]
    assert last["status"] == "successful"
    assert [s["name"] for s in last["stages"]] == pipeline
    assert all(s["status"] in ("ok", "no hosts") for s in last["stages"]), last["stages"]  # changed=0
    # and the plan of the same inventory finds every stage done
    assert main(["plan", "--json", "--project", str(ROOT), "--private-data-dir", str(pdd)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {s["state"] for s in report["stages"]} <= {"done", "no hosts"}, report["stages"]
    assert report["plan"] is not None


def _the_length_budget_was_measured_and_followed() -> None:
    """The prompts stage counted the demo prompts with the demo tokenizer, introspect made the one budget
    of them (48 generated tokens per turn, the local inventory's plan override), and tokenize used it."""
    facts = json.loads((ROOT / "artifacts" / "model_facts.json").read_text())
    length = facts["plan"]["length"]
    prompt_set = length["prompt_set"]["value"]
    # Only the training split counts: the held-out evaluation prompts are never generated for.
    manifest = json.loads((ROOT / ".work" / "prompts" / "manifest.json").read_text())
    assert prompt_set["method"] == "tokens" and prompt_set["rows"] == manifest["rows"], (prompt_set, manifest)
    need = max(g["prompt_tokens"] + g["turns"] * (48 + 8) for g in prompt_set["groups"])
    assert length["budget"]["value"] == need and length["max_tokens"]["value"] == 48, length
    assert facts["plan"]["generation"]["concurrency"]["value"] == 4  # no GPU
    stats = json.loads((ROOT / "artifacts" / "tokenized" / "stats.json").read_text())
    assert stats["config"]["max_length"] == need


def _assert_the_evaluation_discriminates(report: dict) -> None:
    """Trained above untrained, 95% intervals apart, on prompts held out from training, for each turn kind."""
    drafters = report["drafters"]
    assert report["lossless"] is True
    assert report["settings"]["prompts_source"].endswith("/eval"), report["settings"]
    assert drafters["oracle"]["acceptance_length"] == report["block_size"]
    trained, untrained = drafters["trained"], drafters["untrained"]
    assert trained["acceptance_length_ci95"][0] > untrained["acceptance_length_ci95"][1], (trained, untrained)
    for kind in report["turn_kinds"]:
        low = trained["turn_kinds"][kind]["acceptance_length_ci95"][0]
        assert low > untrained["turn_kinds"][kind]["acceptance_length_ci95"][1], (kind, trained["turn_kinds"])
    # More training helps: the exported checkpoint beats the earliest one the run kept.
    points = report["training_steps"]["points"]
    assert len(points) >= 2 and points[-1]["exported"], report["training_steps"]
    assert points[-1]["acceptance_length"] > points[0]["acceptance_length"], points


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_check_mode_on_a_fresh_host_previews_without_failing_or_writing(tmp_path) -> None:
    work, artifacts = tmp_path / "work", tmp_path / "artifacts"
    fresh = {"regen_work_dir": str(work), "regen_artifacts_dir": str(artifacts)}
    run = run_playbook("regen.yml", "--check", extra_vars=fresh)
    assert run.returncode == 0, run.output[-6000:]
    flowing = " ".join(run.output.split())
    assert "cannot be previewed on localhost" in flowing
    assert "TASK [completions" not in run.output and "TASK [drafter_training" not in run.output
    assert not work.exists()
    # Nothing in the artifacts but the controller's record of this run (the run history, check: true) and
    # the preflight's table (its output, written in check mode too, as `regen preflight` reads it).
    written = {p.relative_to(artifacts).parts[0]: p for p in artifacts.rglob("*") if p.is_file()}
    assert sorted(written) == ["preflight", "runs"], written
    assert written["runs"].parent.name == "history"
    assert json.loads(written["runs"].read_text())["check"] is True
