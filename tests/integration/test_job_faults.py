"""The prompts and tokenize jobs as processes under faults (issue 15), and the exit-code contract all jobs
share: a crash is exit 4 and `failed` in the status file, bad input 2, an unwritable output 5.

Real CLIs on real files (the demo model's real tokenizer); the full disk is a small tmpfs (root only).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from regen.jobs import _common
from regen.jobs._common import EXIT_CRASHED, EXIT_OUTPUT, StatusFile, run_main
from regen.status import Status, validate

PROMPTS = [sys.executable, "-m", "regen.jobs.prompts"]
TOKENIZE = [sys.executable, "-m", "regen.jobs.tokenize"]


def run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def write_rows(path: Path, n: int, start: int = 0) -> Path:
    with open(path, "w") as fh:
        for i in range(start, start + n):
            fh.write(json.dumps({"id": f"r{i}", "prompt": f"prompt number {i} about things"}) + "\n")
    return path


def completion(i: int) -> dict:
    return {
        "id": f"c{i}",
        "conversations": [
            {"role": "user", "content": f"Question {i}?"},
            {"role": "assistant", "content": f"Answer {i}."},
        ],
        "finish_reason": "stop",
    }


# ------------------------------------------------------------------------------ the shared contract


def test_a_crash_is_exit_4_and_failed_in_the_status_file(tmp_path, capsys):
    status_path = tmp_path / "status.json"

    def main(argv):
        status = StatusFile(status_path, job="demo", item="row").arm()
        status.maybe_write(
            lambda: Status(job="demo", state="running", item="row", line="demo: running").document()
        )
        raise RuntimeError("a bug")

    assert run_main(main, []) == EXIT_CRASHED
    doc = json.loads(status_path.read_text())
    assert validate(doc) == []
    assert (doc["state"], doc["exit_code"]) == ("failed", EXIT_CRASHED)
    assert "RuntimeError: a bug" in doc["error"] and "RuntimeError: a bug" in doc["line"]
    err = capsys.readouterr().err
    assert "Traceback" in err and "the job crashed: RuntimeError: a bug" in err
    assert not list(_common._ARMED), "a finished status file is no longer armed"


def test_an_unwritable_output_is_exit_5_not_a_traceback(tmp_path, capsys):
    def main(argv):
        raise OSError(28, "No space left on device", str(tmp_path / "x"))

    assert run_main(main, []) == EXIT_OUTPUT
    err = capsys.readouterr().err
    assert "No space left on device: the disk is full" in err and "Traceback" not in err


# ------------------------------------------------------------------------------ prompts


def test_prompts_reject_a_lone_surrogate_instead_of_crashing(tmp_path):
    src = tmp_path / "src.jsonl"
    src.write_text(
        '{"id": "s", "prompt": "a \\ud800 b"}\n'
        '{"id": "\\udc80", "prompt": "x"}\n'
        '{"id": "ok", "prompt": "fine"}\n'
    )
    r = run([*PROMPTS, "--source", str(src), "--output-dir", str(tmp_path / "out")])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert json.loads(r.stdout)["rows"] == 1 and json.loads(r.stdout)["rejected"] == 2
    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert all("lone surrogate" in x["reason"] for x in rejects) and len(rejects) == 2


def test_a_second_prompts_job_on_one_directory_is_refused_with_the_first_ones_pid(tmp_path):
    src = write_rows(tmp_path / "big.jsonl", 120_000)
    out = tmp_path / "out"
    first = subprocess.Popen(
        [*PROMPTS, "--source", str(src), "--output-dir", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and first.poll() is None:
            if (out / ".lock").is_file() and (out / ".lock").read_text().strip() == str(first.pid):
                break
            time.sleep(0.05)
        assert first.poll() is None, "the first job ended before the second could meet it"
        second = run([*PROMPTS, "--source", str(src), "--output-dir", str(out)])
        assert first.poll() is None, "the first job ended before the second was refused: use a bigger source"
    finally:
        _, first_err = first.communicate(timeout=300)
    assert second.returncode == 2 and "Bad file descriptor" not in second.stderr, second.stderr
    assert f"another prompts job (pid {first.pid}) is writing {out}" in second.stderr, second.stderr
    assert first.returncode == 0, first_err
    assert json.loads((out / "manifest.json").read_text())["rows"] == 120_000


@pytest.mark.parametrize("job", ["prompts", "tokenize"])
def test_an_output_path_under_a_file_is_a_clear_error(tmp_path, job, demo_model_dir):
    blocker = tmp_path / "blocker"
    blocker.write_text("x\n")
    if job == "prompts":
        args = [
            *PROMPTS,
            "--source",
            str(write_rows(tmp_path / "s.jsonl", 3)),
            "--output-dir",
            str(blocker / "o"),
        ]
    else:
        comp = tmp_path / "c.jsonl"
        comp.write_text(json.dumps(completion(0)) + "\n")
        args = [
            *TOKENIZE,
            "--input",
            str(comp),
            "--output-dir",
            str(blocker / "o"),
            "--tokenizer",
            str(demo_model_dir),
            "--no-progress",
        ]
    r = run(args)
    assert r.returncode == 5 and "Traceback" not in r.stderr, r.stderr
    assert f"lies under {blocker}, which is a file, not a directory" in r.stderr, r.stderr


@pytest.mark.parametrize("job", ["prompts", "tokenize"])
def test_a_gz_input_cut_short_is_a_clear_error(tmp_path, job, demo_model_dir):
    if job == "prompts":
        plain = write_rows(tmp_path / "s.jsonl", 3000)
    else:
        plain = tmp_path / "c.jsonl"
        plain.write_text("".join(json.dumps(completion(i)) + "\n" for i in range(3000)))
    data = gzip.compress(plain.read_bytes())
    cut = tmp_path / (plain.name + ".gz")
    cut.write_bytes(data[: len(data) // 2])
    if job == "prompts":
        args = [*PROMPTS, "--source", str(cut), "--output-dir", str(tmp_path / "o")]
    else:
        args = [
            *TOKENIZE,
            "--input",
            str(cut),
            "--output-dir",
            str(tmp_path / "o"),
            "--tokenizer",
            str(demo_model_dir),
            "--no-progress",
        ]
    r = run(args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{cut} is cut short or damaged" in r.stderr, r.stderr
    if job == "tokenize":
        status = json.loads((tmp_path / "o" / "status.json").read_text())
        assert validate(status) == [] and (status["state"], status["exit_code"]) == ("failed", 2)


@pytest.fixture
def tmpfs(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    point = tmp_path / "disk"
    point.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "regen-test", str(point)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield point
    subprocess.run(["umount", "-l", str(point)], check=False)


def test_prompts_on_a_full_disk_keep_the_previous_set_and_say_so(tmp_path, tmpfs):
    out = tmpfs / "prompts"
    small = write_rows(tmp_path / "small.jsonl", 10)
    assert run([*PROMPTS, "--source", str(small), "--output-dir", str(out)]).returncode == 0
    before = (out / "manifest.json").read_bytes()
    big = write_rows(tmp_path / "big.jsonl", 40_000)  # ~2.5 MB of shards: more than the disk holds
    r = run([*PROMPTS, "--source", str(big), "--output-dir", str(out)])
    assert r.returncode == 5 and "Traceback" not in r.stderr, r.stderr
    assert "nothing was committed" in r.stderr and "previous prompt set there, if any, is kept" in r.stderr
    assert (out / "manifest.json").read_bytes() == before


def test_tokenize_names_a_tokenizer_directory_without_tokenizer_files(tmp_path):
    comp = tmp_path / "c.jsonl"
    comp.write_text(json.dumps(completion(0)) + "\n")
    empty = tmp_path / "model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    r = run(
        [
            *TOKENIZE,
            "--input",
            str(comp),
            "--output-dir",
            str(tmp_path / "o"),
            "--tokenizer",
            str(empty),
            "--no-progress",
        ]
    )
    assert r.returncode == 2 and "sentencepiece" not in r.stderr, r.stderr
    assert f"--tokenizer {empty} holds no tokenizer files" in r.stderr, r.stderr


def test_tokenize_on_a_full_disk_says_what_was_kept_and_the_next_run_finishes(
    tmp_path, tmpfs, demo_model_dir
):
    comp = tmp_path / "c.jsonl"
    comp.write_text("".join(json.dumps(completion(i)) + "\n" for i in range(6000)))
    out = tmpfs / "tokenized"
    args = [
        *TOKENIZE,
        "--input",
        str(comp),
        "--output-dir",
        str(out),
        "--tokenizer",
        str(demo_model_dir),
        "--shard-size",
        "500",
        "--workers",
        "1",
        "--no-progress",
    ]
    r = run(args)
    assert r.returncode == 5 and "Traceback" not in r.stderr, r.stderr
    assert "No space left on device" in r.stderr and "are tokenized and kept (each shard whole)" in r.stderr
    assert "MB more" in r.stderr, r.stderr
    status = json.loads((out / "status.json").read_text())
    assert (status["state"], status["exit_code"]) == ("failed", 5)
    subprocess.run(["mount", "-o", "remount,size=64m", str(tmpfs)], check=True)
    again = run(args)
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "stats.json").read_text())["samples"] == 6000


def test_tokenize_refuses_an_id_repeated_across_inputs_but_7_and_quoted_7_are_distinct(
    tmp_path, demo_model_dir
):
    a, b = tmp_path / "in" / "a.jsonl", tmp_path / "in" / "b.jsonl"
    a.parent.mkdir()
    a.write_text(json.dumps(completion(1)) + "\n" + json.dumps({**completion(2), "id": 7}) + "\n")
    b.write_text(json.dumps({**completion(3), "id": "7"}) + "\n")
    args = [
        *TOKENIZE,
        "--input",
        str(a),
        "--input",
        str(b),
        "--output-dir",
        str(tmp_path / "o"),
        "--tokenizer",
        str(demo_model_dir),
        "--no-progress",
        "--json",
    ]
    ok = run(args)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["samples"] == 3
    b.write_text(
        json.dumps({**completion(3), "id": "7"}) + "\n" + json.dumps({**completion(9), "id": "c1"}) + "\n"
    )
    r = run(args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f'1 id(s) occur more than once across the inputs (id "c1" at {a}:1, {b}:2)' in r.stderr, r.stderr


def test_ids_with_control_characters_are_rejected(tmp_path):
    src = tmp_path / "src.jsonl"
    src.write_text(
        '{"id": "a\\u0000b", "prompt": "x"}\n{"id": "tab\\tid", "prompt": "y"}\n{"id": "ok", "prompt": "z"}\n'
    )
    r = run([*PROMPTS, "--source", str(src), "--output-dir", str(tmp_path / "out")])
    assert r.returncode == 0 and json.loads(r.stdout)["rejected"] == 2, r.stdout + r.stderr
    reasons = [json.loads(x)["reason"] for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert all("holds the control character" in x for x in reasons), reasons


def test_sigterm_stops_tokenize_as_interrupted_and_the_next_run_finishes(tmp_path, demo_model_dir):
    comp = tmp_path / "c.jsonl"
    comp.write_text("".join(json.dumps(completion(i)) + "\n" for i in range(20_000)))
    out = tmp_path / "o"
    args = [
        *TOKENIZE,
        "--input",
        str(comp),
        "--output-dir",
        str(out),
        "--tokenizer",
        str(demo_model_dir),
        "--shard-size",
        "200",
        "--workers",
        "1",
        "--no-progress",
        "--status-interval",
        "0.1",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "status.json").exists() and json.loads((out / "status.json").read_text()).get(
            "shards_written"
        ):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "tokenize ended before the signal"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in err, err
    status = json.loads((out / "status.json").read_text())
    assert validate(status) == [] and (status["state"], status["exit_code"]) == ("interrupted", 143)
    assert not list(out.rglob(".*.tmp")), "a temporary file was left behind"
    again = run(args)
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "stats.json").read_text())["samples"] == 20_000


@pytest.mark.parametrize("workers", ["1", "2"])
def test_tokenize_status_beats_while_a_long_shard_runs(tmp_path, demo_model_dir, workers):
    from regen.status import liveness

    comp = tmp_path / "c.jsonl"
    comp.write_text("".join(json.dumps(completion(i)) + "\n" for i in range(20_000)))
    out = tmp_path / "o"
    args = [
        *TOKENIZE,
        "--input",
        str(comp),
        "--output-dir",
        str(out),
        "--tokenizer",
        str(demo_model_dir),
        "--shard-size",
        "20000",
        "--workers",
        workers,
        "--no-progress",
        "--status-interval",
        "0.2",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (out / "status.json").exists():
            time.sleep(0.05)
        first = json.loads((out / "status.json").read_text())
        time.sleep(1.0)
        later = json.loads((out / "status.json").read_text())
        assert proc.poll() is None, "the one shard finished too soon to watch"
        # nothing finished (one shard, still running), yet the document was rewritten
        assert later["done"] == 0 and later["updated_at"] > first["updated_at"]
        assert later["pid"] == proc.pid and liveness(later) == "alive"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)


def _wait_for_state(path: Path, state: str, pid: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            doc = {}
        if doc.get("pid") == pid and doc.get("state") == state:
            return doc
        time.sleep(0.01)
    raise AssertionError(f"{path} never said {state} for pid {pid}")


def test_a_sigterm_while_tokenize_starts_leaves_its_own_status_not_the_last_runs_done(
    tmp_path, demo_model_dir
):
    """Found by the fault campaign: a SIGTERM while the tokenizer loaded left the last run's `done` there."""
    comp = tmp_path / "c.jsonl"
    comp.write_text("".join(json.dumps(completion(i)) + "\n" for i in range(20)))
    out = tmp_path / "o"
    args = [*TOKENIZE, "--input", str(comp), "--output-dir", str(out), "--tokenizer", str(demo_model_dir)]
    args += ["--no-progress", "--status-interval", "0.2"]
    assert run(args).returncode == 0
    assert json.loads((out / "status.json").read_text())["state"] == "done"
    with open(comp, "a") as fh:
        fh.write(json.dumps(completion(99)) + "\n")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for_state(out / "status.json", "starting", proc.pid)  # this run's, while the tokenizer loads
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    status = json.loads((out / "status.json").read_text())
    assert validate(status) == [] and (status["state"], status["exit_code"], status["pid"]) == (
        "interrupted",
        143,
        proc.pid,
    )


def test_a_sigterm_while_generate_opens_its_ledger_is_exit_143_and_interrupted(tmp_path):
    """Before its run loop sets its own handler, a SIGTERM killed the generation job outright (exit -15),
    status.json still holding the last run's `done`."""
    from regen.jobs._ledger import LEDGER_NAME

    prompts = tmp_path / "p.jsonl"
    out = tmp_path / "out"
    out.mkdir()
    n = 400_000  # a ledger rebuilt from 400k completion lines: a second or two of opening to hit
    with open(prompts, "w") as fh, open(out / "completions-00000.jsonl", "w") as shard:
        for i in range(n):
            fh.write(json.dumps({"id": f"q{i}", "conversations": [{"role": "user", "content": "q"}]}) + "\n")
            shard.write(
                json.dumps({"id": f"q{i}", "conversations": [{"role": "user", "content": "q"}]}) + "\n"
            )
    (out / "status.json").write_text(
        json.dumps(Status(job="generate", state="done", item="record", line="old", exit_code=0).document())
    )
    assert not (out / LEDGER_NAME).exists()
    args = [sys.executable, "-m", "regen.jobs.generate", "--input", str(prompts), "--output-dir", str(out)]
    args += ["--endpoint", "http://127.0.0.1:9", "--model", "m", "--no-progress", "--status-interval", "0.2"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for_state(out / "status.json", "starting", proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    status = json.loads((out / "status.json").read_text())
    assert (status["state"], status["exit_code"], status["pid"]) == ("interrupted", 143, proc.pid)


_LATE_SIGNAL = """
import os, runpy, signal, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
# a SIGTERM (and a Ctrl-C) that comes after the job's end was decided, before its process is gone
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGINT)
print(f"survived with {code}", flush=True)
"""


@pytest.mark.parametrize("job", ["prompts", "generate", "tokenize"])
def test_a_signal_after_the_end_is_decided_does_not_turn_a_finished_run_into_a_killed_one(
    tmp_path, job, demo_model_dir
):
    """Found by the fault campaign: a SIGTERM just after generate wrote `done` ended it with -15."""
    from tests.helpers.stub_openai_server import StubConfig, StubServer

    src = write_rows(tmp_path / "src.jsonl", 5)
    prompts = tmp_path / "prompts"
    assert run([*PROMPTS, "--source", str(src), "--output-dir", str(prompts)]).returncode == 0
    comp = tmp_path / "c.jsonl"
    comp.write_text("".join(json.dumps(completion(i)) + "\n" for i in range(5)))
    with StubServer(StubConfig()) as stub:
        gen = ["--input", str(prompts), "--output-dir", str(tmp_path / "g"), "--endpoint", stub.url]
        tok = ["--input", str(comp), "--output-dir", str(tmp_path / "t"), "--tokenizer", str(demo_model_dir)]
        argv = {
            "prompts": ["regen.jobs.prompts", "--source", str(src), "--output-dir", str(tmp_path / "p2")],
            "generate": ["regen.jobs.generate", *gen, "--model", "m", "--no-progress"],
            "tokenize": ["regen.jobs.tokenize", *tok, "--no-progress"],
        }[job]
        r = run([sys.executable, "-c", _LATE_SIGNAL, *argv])
    assert r.returncode == 0 and "survived with 0" in r.stdout, r.stdout + r.stderr
    if job != "prompts":
        status = json.loads((tmp_path / job[0] / "status.json").read_text())
        assert (status["state"], status["exit_code"]) == ("done", 0)
