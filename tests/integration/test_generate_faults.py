"""The generation job as a process under faults (issue 15): every ending says what it is, in its exit code
and in status.json; no record vanishes; clear errors instead of tracebacks; a bounded stop.

The server is the fault-injection STUB on loopback; the job is the real CLI. The full-disk and read-only
cases mount a small tmpfs (the tests run as root; skipped otherwise), unmounted by the fixture.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from regen.status import liveness, validate
from tests.helpers.stub_openai_server import StubConfig, StubServer
from tests.integration.test_generate_cli import job_args, output_ids, write_prompts

PROMPTS_JOB = [sys.executable, "-m", "regen.jobs.prompts"]


def run(args: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)


def status_of(out: Path) -> dict:
    doc = json.loads((out / "status.json").read_text())
    assert validate(doc) == [], doc
    return doc


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs of its own (size in bytes via the returned mount(size) call); unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    point = tmp_path / f"mnt-{uuid.uuid4().hex[:6]}"
    point.mkdir()
    mounted = []

    def mount(size: int, *options: str) -> Path:
        opts = ",".join([f"size={size}", *options])
        cmd = ["mount", "-t", "tmpfs", "-o", opts, "regen-test", str(point)]
        if mounted:
            cmd = ["mount", "-o", f"remount,{opts}", str(point)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(True)
        return point

    yield mount
    if mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_full_disk_fails_with_what_was_kept_and_the_next_run_completes(tmp_path, tmpfs):
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 300)
    disk = tmpfs(160 * 1024)
    out = disk / "completions"
    with StubServer(StubConfig(tokens=300)) as stub:
        r = run(job_args(prompts, out, stub.url, "--status-interval", "0.2"))
        assert r.returncode == 5, r.stdout + r.stderr
        assert "Traceback" not in r.stderr and "the disk is full" in r.stderr, r.stderr
        assert "record(s) are kept in total" in r.stderr and "MB more" in r.stderr, r.stderr
        # the role reads this: not `running`, not `failed: 0` and silent
        status = json.loads((out / "status.json").read_text())
        assert status["state"] == "failed" and status["exit_code"] == 5 and "disk is full" in status["error"]
        kept = sum(p.read_bytes().count(b"\n") for p in out.glob("completions-*.jsonl"))
        assert 0 < kept < len(ids)
        # more space: the next run repairs the torn tail and finishes, each prompt exactly once
        tmpfs(32 * 1024 * 1024)
        again = run(job_args(prompts, out, stub.url))
    assert again.returncode == 0, again.stdout + again.stderr
    got = output_ids(out)
    assert sorted(got) == ids


def test_a_disk_full_before_the_first_request_says_nothing_was_generated_and_what_is_kept(tmp_path, tmpfs):
    """Found by the fault campaign: a disk that filled up before the run started (run.json, the move of
    superseded completions) ended with the bare OS error, not saying what was kept."""
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 6)
    disk = tmpfs(1024 * 1024)
    out = disk / "completions"
    with StubServer(StubConfig()) as stub:
        assert run(job_args(prompts, out, stub.url)).returncode == 0
        write_prompts(prompts, 8)  # two more: the prompt set changed, the run reconciles first
        filler = disk / "filler"
        with open(filler, "wb", buffering=0) as fh, contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * 4096)
        r = run(job_args(prompts, out, stub.url))
        assert r.returncode == 5 and "Traceback" not in r.stderr, r.stderr
        assert "the disk is full" in r.stderr and "while the run was being prepared" in r.stderr, r.stderr
        assert "this run generated nothing, the 6 completion(s) found there are kept" in r.stderr, r.stderr
        filler.unlink()
        assert run(job_args(prompts, out, stub.url)).returncode == 0
    assert sorted(output_ids(out)) == sorted(f"id-{i:05d}" for i in range(8))


def test_a_read_only_output_fails_at_once(tmp_path, tmpfs):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 5)
    disk = tmpfs(1024 * 1024)
    (disk / "completions").mkdir()
    tmpfs(1024 * 1024, "ro")
    r = run(job_args(prompts, disk / "completions", "http://127.0.0.1:9"))
    assert r.returncode == 5 and "Traceback" not in r.stderr, r.stderr
    assert "read-only" in r.stderr and "choose a writable output directory" in r.stderr, r.stderr


@pytest.mark.parametrize("where", ["is", "under"])
def test_an_output_path_that_is_a_file_is_a_clear_error(tmp_path, where):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 2)
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory\n")
    out = blocker if where == "is" else blocker / "completions"
    r = run(job_args(prompts, out, "http://127.0.0.1:9"))
    assert r.returncode == 5 and "Traceback" not in r.stderr, r.stderr
    expected = "is a file, not a directory" if where == "is" else f"lies under {blocker}, which is a file"
    assert expected in r.stderr, r.stderr


def test_a_prompts_shard_cut_short_is_refused_before_generating(tmp_path):
    prompts = tmp_path / "prompts"
    built = run([*PROMPTS_JOB, "--source", "builtin:demo", "--output-dir", str(prompts)])
    assert built.returncode == 0, built.stderr
    manifest = json.loads((prompts / "manifest.json").read_text())
    shard = prompts / manifest["shards"][0]["path"]
    lines = shard.read_bytes().splitlines(keepends=True)
    shard.write_bytes(b"".join(lines[: len(lines) // 2]))
    out = tmp_path / "out"
    with StubServer(StubConfig(record=True)) as stub:
        r = run(job_args(prompts, out, stub.url))
        assert stub.requests == []
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert (
        f"holds {len(lines) // 2} rows but" in r.stderr
        and f"says {manifest['shards'][0]['rows']}" in r.stderr
    )
    assert output_ids(out) == []
    status = status_of(out)
    assert status["state"] == "failed" and status["exit_code"] == 2 and "cut short" in status["error"]

    # same length, other bytes: the sha256 says so
    shard.write_bytes(b"".join(lines).replace(b"a", b"b", 1))
    r = run(job_args(prompts, out, "http://127.0.0.1:9"))
    assert r.returncode == 2 and "does not match the sha256" in r.stderr, r.stderr


def test_a_gz_input_cut_short_is_refused_before_generating(tmp_path):
    plain = tmp_path / "p.jsonl"
    write_prompts(plain, 400)
    data = gzip.compress(plain.read_bytes())
    cut = tmp_path / "p.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    with StubServer(StubConfig(record=True)) as stub:
        r = run(job_args(cut, out, stub.url))
        assert stub.requests == []
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{cut} is cut short or damaged" in r.stderr and "gzip -t" in r.stderr, r.stderr
    assert output_ids(out) == []


def test_a_lone_surrogate_ends_as_an_error_record_not_a_vanished_task(tmp_path):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 3)
    with open(prompts, "a") as fh:
        fh.write('{"id": "bad", "conversations": [{"role": "user", "content": "x \\ud800 y"}]}\n')
        fh.write('{"id": "bad-\\udfff-id", "conversations": [{"role": "user", "content": "fine"}]}\n')
    out = tmp_path / "out"
    with StubServer(StubConfig()) as stub:
        r = run(job_args(prompts, out, stub.url))
        dry = run([*job_args(prompts, out, stub.url), "--dry-run"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "never retrieved" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "2 row(s) are invalid and are not retryable" in r.stderr, r.stderr
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert sorted(e["id"] for e in errors) == ["bad", "bad-\udfff-id"]
    assert all("lone surrogate" in e["error"] and e["retryable"] is False for e in errors), errors
    assert len(output_ids(out)) == 3
    status = status_of(out)
    assert (status["state"], status["exit_code"], status["failed"], status["invalid"]) == ("failed", 1, 2, 2)
    todo = json.loads(dry.stdout)
    assert (todo["pending"], todo["invalid"], todo["complete"]) == (0, 2, False)


def test_http_401_stops_at_once_and_names_the_key_variable(tmp_path):
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 200)
    out = tmp_path / "out"
    with StubServer(StubConfig(error_rate=1.0, error_status=(401,), record=True)) as stub:
        r = run(
            job_args(prompts, out, stub.url, "--api-key-env", "REGEN_TEST_KEY"),
            env={**os.environ, "REGEN_TEST_KEY": "wrong-key-123"},
        )
        sent = stub.stats["requests"]
    assert r.returncode == 2, r.stdout + r.stderr
    assert "REGEN_TEST_KEY" in r.stderr and "HTTP 401" in r.stderr, r.stderr
    assert "wrong-key-123" not in r.stdout + r.stderr
    # at most what was in flight when the first refusal came back, never the whole set
    assert sent <= 2 * 8 * 2, sent
    assert not (out / "errors.jsonl").read_text(), "refused prompts stay pending, not failed"
    status = status_of(out)
    assert status["state"] == "failed" and status["exit_code"] == 2 and "REGEN_TEST_KEY" in status["error"]
    todo = json.loads(run([*job_args(prompts, out, "http://127.0.0.1:9"), "--dry-run"]).stdout)
    assert todo["pending"] == len(ids)


def test_sigterm_while_requests_hang_stops_within_the_grace_and_the_heartbeat_tells_live_from_dead(tmp_path):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 20)
    out = tmp_path / "out"
    with StubServer(StubConfig(stall_rate=1.0, stall_seconds=600)) as stub:
        args = job_args(prompts, out, stub.url, "--status-interval", "0.2", "--stop-grace", "1")
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        first = None
        while time.monotonic() < deadline:
            if (out / "status.json").exists():
                first = json.loads((out / "status.json").read_text())
                if first.get("in_flight"):
                    break
            time.sleep(0.1)
        assert first and first["in_flight"] > 0 and first["done"] == 0
        time.sleep(1.0)
        # nothing finished, yet the document is rewritten: a reader sees a live, slow job
        beat = json.loads((out / "status.json").read_text())
        assert beat["updated_at"] > first["updated_at"] and beat["pid"] == proc.pid
        assert liveness(beat) == "alive"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        stopped_in = time.monotonic() - t0
    assert proc.returncode == 143, stderr
    assert stopped_in < 10, stopped_in
    status = status_of(out)
    assert status["state"] == "interrupted" and status["exit_code"] == 143 and status["in_flight"] == 0
    assert output_ids(out) == [] and not (out / "errors.jsonl").read_text()

    # a SIGKILLed job leaves `running` behind: its pid is gone, and liveness says so
    with StubServer(StubConfig(stall_rate=1.0, stall_seconds=600)) as stub:
        args = job_args(prompts, out, stub.url, "--status-interval", "0.2")
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            doc = json.loads((out / "status.json").read_text())
            if doc["pid"] == proc.pid and doc["state"] == "running":
                break
            time.sleep(0.1)
        proc.kill()
        proc.wait(10)
    doc = json.loads((out / "status.json").read_text())
    assert doc["state"] == "running" and liveness(doc) == "dead"


def test_url_credentials_never_reach_status_errors_or_output(tmp_path):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 4)
    out = tmp_path / "out"
    with StubServer(StubConfig(error_rate=1.0, error_status=(422,))) as stub:
        url = stub.url.replace("http://", "http://alice:pa%24s-s3cret@")
        r = run(job_args(prompts, out, url))
    assert r.returncode == 1, r.stdout + r.stderr
    for name in ("status.json", "errors.jsonl", "run.json"):
        text = (out / name).read_text()
        assert "s3cret" not in text, name
    assert "alice:***@" in (out / "status.json").read_text()
    assert "s3cret" not in r.stdout + r.stderr


def test_edited_and_removed_prompts_move_their_completions_aside_and_only_the_edited_are_redone(tmp_path):
    prompts = tmp_path / "p.jsonl"
    ids = write_prompts(prompts, 8)
    out = tmp_path / "out"
    with StubServer(StubConfig(record=True)) as stub:
        assert run(job_args(prompts, out, stub.url)).returncode == 0
        # an output dir of an older regen: records without their key, run.json without the inputs' hash
        for shard in out.glob("completions-*.jsonl"):
            lines = [json.loads(x) for x in shard.read_text().splitlines()]
            shard.write_text(
                "".join(json.dumps({k: v for k, v in r.items() if k != "prompt_key"}) + "\n" for r in lines)
            )
        (out / "ledger.bin").unlink()
        run_json = json.loads((out / "run.json").read_text())
        (out / "run.json").write_text(json.dumps({k: v for k, v in run_json.items() if k != "inputs_sha256"}))
        sent = len(stub.requests)
        same = run(job_args(prompts, out, stub.url))
        assert same.returncode == 0 and len(stub.requests) == sent, "unchanged prompts are not redone"
        assert not (out / "superseded.jsonl").exists()

        rows = [json.loads(x) for x in prompts.read_text().splitlines()]
        rows[3]["conversations"][0]["content"] = "an edited question"
        del rows[7]
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        dry = json.loads(run([*job_args(prompts, out, stub.url), "--dry-run"]).stdout)
        assert dry["complete"] is False and dry["inputs_changed"] is True
        edited = run(job_args(prompts, out, stub.url))
        assert edited.returncode == 0, edited.stderr
        assert len(stub.requests) == sent + 1, "only the edited prompt is generated again"
        dry = json.loads(run([*job_args(prompts, out, stub.url), "--dry-run"]).stdout)
    got = output_ids(out)
    assert sorted(got) == sorted(ids[:7])
    records = {
        json.loads(x)["id"]: json.loads(x)
        for p in out.glob("completions-*.jsonl")
        for x in p.read_text().splitlines()
    }
    assert records[ids[3]]["conversations"][0]["content"] == "an edited question"
    aside = [json.loads(x) for x in (out / "superseded.jsonl").read_text().splitlines()]
    assert sorted((a["reason"], a["record"]["id"]) for a in aside) == [
        ("orphaned", ids[7]),
        ("superseded", ids[3]),
    ]
    assert aside[0]["record"]["conversations"][0]["content"] != "an edited question"
    status = status_of(out)
    assert (status["superseded"], status["orphaned"], status["state"]) == (1, 1, "done")
    assert dry["complete"] is True and dry["inputs_changed"] is False
