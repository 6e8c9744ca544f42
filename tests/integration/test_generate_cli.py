"""The generation job as a process: exit codes, clear errors, and exactly-once under SIGKILL and SIGTERM.

The server is the STUB on loopback (fault injection and timing control); the job is the real CLI.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from regen.jobs._ledger import ShardStore
from tests.helpers.stub_openai_server import StubConfig, StubServer

JOB = [sys.executable, "-m", "regen.jobs.generate"]


def write_prompts(path: Path, n: int, multi_every: int = 0) -> list[str]:
    ids = []
    with open(path, "w") as fh:
        for i in range(n):
            conv = [{"role": "user", "content": f"question number {i}"}]
            if multi_every and i % multi_every == 0:
                conv += [
                    {"role": "assistant", "content": "old"},
                    {"role": "user", "content": f"follow-up {i}"},
                ]
            fh.write(json.dumps({"id": f"id-{i:05d}", "conversations": conv}) + "\n")
            ids.append(f"id-{i:05d}")
    return ids


def job_args(prompts: Path, out: Path, url: str, *extra: str) -> list[str]:
    return [
        *JOB,
        "--input",
        str(prompts),
        "--output-dir",
        str(out),
        "--endpoint",
        url,
        "--model",
        "m",
        "--concurrency",
        "8",
        "--max-tokens",
        "256",
        "--backoff-base",
        "0.02",
        "--backoff-max",
        "0.1",
        "--circuit-cooldown",
        "0.05",
        "--circuit-cooldown-max",
        "0.2",
        "--no-progress",
        *extra,
    ]


def output_ids(out: Path) -> list[str]:
    ids = []
    for shard in sorted(out.glob("completions-*.jsonl")):
        data = shard.read_bytes()
        assert not data or data.endswith(b"\n"), f"{shard.name} ends with a torn line"
        ids += [json.loads(line)["id"] for line in data.splitlines()]
    return ids


def test_sigkill_at_random_points_loses_and_duplicates_nothing(tmp_path):
    rng = random.Random(20260)
    prompts = tmp_path / "prompts.jsonl"
    ids = write_prompts(prompts, 1500, multi_every=5)
    out = tmp_path / "out"
    # ~7 s of work at 8 in flight (1800 requests, 30 ms each): ten kills within 1.5 s of each start always
    # land mid-run; transient faults on top, so kills also hit retries and circuit pauses
    config = StubConfig(
        delay=0.02,
        jitter=0.02,
        tokens=120,
        reset_rate=0.01,
        error_rate=0.02,
        error_status=(429, 503),
        retry_after=0.05,
        seed=3,
    )
    kills = partial_states = 0
    with StubServer(config) as stub:
        args = job_args(prompts, out, stub.url, "--shard-records", "150")
        progress = []
        for _ in range(10):
            proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            # past startup (imports, recovery), so a loaded machine still kills work in progress
            _wait_for_records(out, (progress[-1] if progress else 0) + 1, proc)
            time.sleep(rng.uniform(0.0, 0.8))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            proc.wait(30)
            seen = output_ids(out) if out.exists() else []
            assert len(seen) == len(set(seen)), "a kill left a duplicate record"
            progress.append(len(seen))
            partial_states += 0 < len(seen) < len(ids)
        final = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert final.returncode == 0, final.stdout + final.stderr
    got = output_ids(out)
    assert len(got) == len(set(got)) == len(ids) and set(got) == set(ids)
    # every multi-turn record has both of its turns regenerated
    for shard in out.glob("completions-*.jsonl"):
        for line in shard.read_text().splitlines():
            rec = json.loads(line)
            if int(rec["id"][3:]) % 5 == 0:
                assert [t["index"] for t in rec["turns"]] == [1, 3]
    # the test really interrupted work in progress, more than once
    assert kills >= 5 and partial_states >= 3, (kills, progress)
    store = ShardStore(out, read_only=True)
    store.open()
    assert store.report.done_by_kind["completions"] == len(ids) and store.report.truncated_bytes == 0
    assert "state=done" in final.stdout


def test_sigterm_drains_in_flight_requests_then_resumes(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    ids = write_prompts(prompts, 120)
    out = tmp_path / "out"
    with StubServer(StubConfig(delay=0.3)) as stub:
        args = job_args(prompts, out, stub.url)
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_for_records(out, 1, proc)  # past startup: the handler is installed, requests are in flight
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 143, stderr
        status = json.loads((out / "status.json").read_text())
        assert status["state"] == "interrupted" and status["in_flight"] == 0
        first = output_ids(out)
        assert 0 < len(first) < len(ids)
        # the drained requests were written, nothing was cut mid-way
        assert status["done"] == len(first)
        final = subprocess.run([*args, "--concurrency", "64"], capture_output=True, text=True, timeout=60)
    assert final.returncode == 0
    got = output_ids(out)
    assert sorted(got) == ids


def _wait_for_records(out, count: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until the job has written `count` records (or ended): a fixed sleep races the job's startup."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        # whole lines only: the job may be mid-write (output_ids asserts on torn lines: for after a kill)
        if sum(shard.read_bytes().count(b"\n") for shard in out.glob("completions-*.jsonl")) >= count:
            return
        time.sleep(0.05)


def run_job(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*JOB, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--chat-template-kwargs", "{thinking: true}"], "--chat-template-kwargs is not valid JSON"),
        (["--chat-template-kwargs", "[1]"], "must be a JSON object"),
        (["--extra-body", '{"model": "x"}'], "--extra-body may not set ['model']"),
        (
            ["--api-key-env", "REGEN_TEST_UNSET_KEY"],
            "REGEN_TEST_UNSET_KEY (named by --api-key-env) is not set",
        ),
        (["--concurrency", "0"], "--concurrency must be at least 1"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(tmp_path, extra, message):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 1)
    r = run_job(
        "--input",
        str(prompts),
        "--output-dir",
        str(tmp_path / "out"),
        "--endpoint",
        "http://127.0.0.1:9",
        "--model",
        "m",
        *extra,
    )
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_missing_input_and_missing_endpoint(tmp_path):
    r = run_job(
        "--input",
        str(tmp_path / "none.jsonl"),
        "--output-dir",
        str(tmp_path / "o"),
        "--endpoint",
        "http://127.0.0.1:9",
        "--model",
        "m",
    )
    assert r.returncode == 2 and "does not exist; build the prompt set first" in r.stderr
    r = run_job("--input", "x", "--output-dir", "y", "--model", "m")
    assert r.returncode == 2 and "--endpoint" in r.stderr


def test_exit_codes_for_done_failed_and_endpoints_down(tmp_path):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 5)
    with StubServer(StubConfig()) as stub:
        ok = run_job(*job_args(prompts, tmp_path / "ok", stub.url)[3:])
        assert ok.returncode == 0 and ok.stdout.startswith("generate: state=done done=5 failed=0")
        assert "p50=" in ok.stdout and "tokens_out=80" in ok.stdout
        stub.configure(error_rate=1.0, error_status=[422])
        bad = run_job(*job_args(prompts, tmp_path / "bad", stub.url)[3:])
        assert bad.returncode == 1 and "failed=5" in bad.stdout
        assert "5 prompt(s) failed and are retried by the next run; reasons in" in bad.stderr
        stub.configure(error_rate=0.0, down=True)
        down = run_job(*job_args(prompts, tmp_path / "down", stub.url, "--max-outage", "0.5")[3:])
        assert down.returncode == 3 and "state=endpoints_down" in down.stdout
        assert "every endpoint stayed down" in down.stderr
        # an API key travels from the named environment variable
        stub.configure(down=False, record=True)
        keyed = run_job(
            *job_args(prompts, tmp_path / "key", stub.url, "--api-key-env", "REGEN_TEST_KEY")[3:],
            env={"REGEN_TEST_KEY": "k-123"},
        )
        assert keyed.returncode == 0 and stub.requests[-1]["authorization"] == "Bearer k-123"


def test_dry_run_prints_json_and_writes_nothing(tmp_path):
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 3)
    r = run_job(
        "--input",
        str(prompts),
        "--output-dir",
        str(tmp_path / "o"),
        "--endpoint",
        "http://127.0.0.1:9",
        "--model",
        "m",
        "--dry-run",
    )
    assert r.returncode == 0
    assert json.loads(r.stdout)["pending"] == 3 and not (tmp_path / "o").exists()
