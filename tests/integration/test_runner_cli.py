"""`regen run|facts|status|plan` on the fixture pipeline (real playbook runs on localhost), via main(argv)."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from regen.cli import main

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "tests" / "fixtures" / "playbooks" / "runner"
INVENTORY = PROJECT / "inventory"


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")


def _args(tmp: Path, *more: str, data: str = "data") -> list[str]:
    return [
        *more,
        "-i",
        str(INVENTORY),
        "-e",
        f"fixture_root={tmp / data}",
        "-e",
        "fixture_delay=0.2",
        "--project",
        str(PROJECT),
        "--private-data-dir",
        str(tmp / "runner"),
    ]


def test_run_facts_status_and_plan_after_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # plan on a fresh directory: demo would change, introspect is blocked on it, generate is not reached
    assert main(_args(tmp_path, "plan", "--json")) == 0
    fresh = json.loads(capsys.readouterr().out)
    assert [(s["name"], s["state"]) for s in fresh["stages"]] == [
        ("demo_model", "would change"),
        ("introspect", "blocked"),
        ("generate", "not reached"),
    ]
    assert "needs demo_model first" in fresh["stages"][1]["message"]
    assert fresh["stages"][0]["hosts"] == ["localhost"] and fresh["plan"] is None
    assert not (tmp_path / "data" / "work").exists(), "plan changed something"

    # a real run with the plain live view and the summary table
    assert main(_args(tmp_path, "run", "--plain")) == 0
    out = capsys.readouterr().out
    for text in (
        "== stage demo_model",
        "== stage generate done",
        "job generate@localhost",
        "stages",
        "PLAY RECAP",
        "completions:",
        "regen: exit 0 (ok): all stages ran",
    ):
        assert text in out, text

    # facts: introspect only (the readable form is rendered by the same tables `plan` prints below)
    assert main(_args(tmp_path, "facts", "--json")) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts == json.loads((tmp_path / "data" / "artifacts" / "model_facts.json").read_text())

    # status: the three runs, newest first, with their stages and outcome
    assert (
        main(["status", "--json", "--project", str(PROJECT), "--private-data-dir", str(tmp_path / "runner")])
        == 0
    )
    runs = json.loads(capsys.readouterr().out)
    assert [r["check"] for r in runs] == [False, False, True]  # facts, run, the plan's check run
    assert [[s["name"] for s in r["stages"] if s["status"] != "not run"] for r in runs[:2]] == [
        ["introspect"],
        ["demo_model", "introspect", "generate"],
    ]
    assert all(r["status"] == "successful" for r in runs[:2])
    assert main(["status", "--project", str(PROJECT), "--private-data-dir", str(tmp_path / "runner")]) == 0
    table = capsys.readouterr().out
    assert runs[0]["ident"] in table and "successful" in table
    assert (
        main(
            [
                "status",
                runs[1]["ident"],
                "--project",
                str(PROJECT),
                "--private-data-dir",
                str(tmp_path / "runner"),
            ]
        )
        == 0
    )
    detail = capsys.readouterr().out
    assert f"run {runs[1]['ident']}" in detail and "generate" in detail and "regen: exit 0" in detail

    # plan after the run: every stage done, the plan comes from the facts, last real runs are known
    assert main(_args(tmp_path, "plan")) == 0
    out = capsys.readouterr().out
    assert out.count(" done ") >= 3 and "two draft layers" in out
    assert main(_args(tmp_path, "plan", "--offline", "--json")) == 0
    offline = json.loads(capsys.readouterr().out)
    assert {s["state"] for s in offline["stages"]} == {"not checked"}
    assert offline["check_run"] is None and offline["facts_source"].endswith("model_facts.json")
    assert offline["stages"][2]["last_run"]["status"] == "changed"

    # Another inventory over the same artifacts directory and runner records: none of those runs are its.
    other = tmp_path / "other-inventory"
    shutil.copytree(INVENTORY, other)
    argv = _args(tmp_path, "plan", "--offline", "--json")
    argv[argv.index(str(INVENTORY))] = str(other)
    assert main(argv) == 0
    foreign = json.loads(capsys.readouterr().out)
    assert [s["last_run"] for s in foreign["stages"]] == [None, None, None]
    assert foreign["facts"] is None and foreign["plan"] is None
    assert any("model_facts.json describes another run" in w and str(other) in w for w in foreign["warnings"])


def test_a_failed_task_exits_2_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(_args(tmp_path, "run", "generate", "--plain", "-e", "fixture_fail=true"))
    assert code == 2
    out = capsys.readouterr().out
    assert "FAILED: stage generate · task 'Refuse to generate' · host localhost" in out
    assert "generation endpoint refused: HTTP 503 from the fixture" in out
    assert "regen: exit 2 (task_failed)" in out


def test_run_json_and_event_stream(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args(tmp_path, "run", "demo", "--json")) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["exit_code"] == 0 and [s["name"] for s in result["stages"]] == ["demo_model"]
    assert main(_args(tmp_path, "run", "demo", "--events", "--check")) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    kinds = [line["kind"] for line in lines]
    assert kinds[0] == "playbook_started" and kinds[-1] == "run_stats" and "task_result" in kinds


def test_an_unreachable_host_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        "all:\n  vars:\n    regen_work_dir: /nonexistent/w\n  hosts:\n    loopback-port-1:\n"
        "      ansible_host: 127.0.0.1\n      ansible_port: 1\n      ansible_connection: ssh\n"
        "  children:\n    regen_demo:\n      hosts:\n        loopback-port-1:\n"
    )
    code = main(
        [
            "run",
            "demo",
            "--plain",
            "-i",
            str(inventory),
            "--project",
            str(PROJECT),
            "--private-data-dir",
            str(tmp_path / "runner"),
        ]
    )
    assert code == 3
    assert "UNREACHABLE: stage demo_model" in capsys.readouterr().out


def _task_started(records: Path, task: str) -> Path | None:
    """The run record whose events show ``task`` starting (the stdout banner comes only with a result)."""
    for event_file in records.glob("*/job_events/*.json") if records.is_dir() else []:
        try:
            event = json.loads(event_file.read_text())
        except ValueError:
            continue  # being written
        if event.get("event") == "playbook_on_task_start" and event["event_data"].get("task") == task:
            return event_file.parent.parent
    return None


def test_sigterm_cancels_the_run_and_leaves_no_ansible_behind(tmp_path: Path) -> None:
    regen = Path(sys.executable).parent / "regen"
    proc = subprocess.Popen(
        [str(regen), *_args(tmp_path, "run", "generate", "--plain", "-e", "fixture_hold_seconds=120")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    records = tmp_path / "runner" / "artifacts"
    try:
        deadline = time.monotonic() + 60
        record = None
        while record is None and time.monotonic() < deadline and proc.poll() is None:
            record = _task_started(records, "Hold the stage")
            time.sleep(0.2)
        assert record is not None, "the held task never started"
    finally:
        proc.send_signal(signal.SIGTERM)  # also the clean-up: regen cancels the run on SIGTERM
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, out
    assert "canceled" in out
    assert (record / "status").read_text() == "canceled"
    # ansible-playbook ran in its own session; it must be gone, not orphaned
    ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, check=True).stdout
    assert str(tmp_path) not in ps


def _sigint_as_at_a_terminal() -> None:
    # Ctrl-C at a terminal reaches a process whose SIGINT is in its default state. A suite started in the
    # background (`cmd &` in a script) hands SIGINT down ignored, and Python then installs no
    # KeyboardInterrupt handler: the test would measure how it was launched, not regen.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_the_job_the_run_started(tmp_path: Path) -> None:
    """Item 3 of issue 26: Ctrl-C on `regen run generate` while its job runs stops the job too (it marks
    its status interrupted and keeps what it wrote), and the summary says so, instead of leaving it to run
    to the end unseen."""
    regen = Path(sys.executable).parent / "regen"
    args = _args(tmp_path, "run", "generate", "--plain", "-e", "fixture_total=600")
    proc = subprocess.Popen(
        [str(regen), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_sigint_as_at_a_terminal,
    )
    status_file = tmp_path / "data" / "work" / "generate" / "status.json"
    try:
        deadline = time.monotonic() + 90
        status: dict = {}
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                status = json.loads(status_file.read_text())
            if status.get("state") == "running" and status.get("done", 0) >= 2:
                break
            time.sleep(0.2)
        assert status.get("state") == "running", status
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    job_pid = status["pid"]
    assert not psutil.pid_exists(job_pid) or psutil.Process(job_pid).status() == psutil.STATUS_ZOMBIE, out
    final = json.loads(status_file.read_text())
    assert final["state"] == "interrupted" and final["done"] >= 2, final
    assert f"stopped the generate job this run started (pid {job_pid}" in " ".join(out.split()), out


def test_a_run_narrowed_by_tags_says_which_stages_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 6 of issue 26: `regen run --tags X` ends naming the stages that ran, not "all stages ran"."""
    assert main(_args(tmp_path, "run", "--plain", "--tags", "demo")) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "all stages ran" not in out
    expected = "regen: exit 0 (ok): stages ran: demo_model; not run: introspect, generate (--tags demo)"
    assert expected in out, out


def test_show_tasks_print_their_message_in_regen_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 6 of issue 26: what a debug ("Show ...") task prints reaches `regen run` too, not only
    ansible-playbook's output."""
    assert main(_args(tmp_path, "run", "--plain", "--check", "generate")) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    where = next(i for i, line in enumerate(lines) if "Report the job as pending (check mode)" in line)
    assert lines[where + 1].strip() == "the counting job would run", out
