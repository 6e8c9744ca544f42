"""The GPU evaluation's client (`python -m regen.jobs.evaluate_serving run`) for real, over HTTP, against the
CPU demo's server (`python -m regen.serving.transformers_serve`, on loopback).

That server speaks the OpenAI API and has no SGLang `/generate`, so this runs the client's OpenAI mode, the
plain baseline's path on a server without `/generate`: the same prompt selection and chat-template rendering
as `regen.jobs.evaluate`, concurrency 1 and a batch level, the resumable results file (exactly once per
server, setting and prompt), the status file and the exit codes. It measures no acceptance: that comes only
from SGLang's metadata, and the client refuses to record a speculative run any other way.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from regen.jobs._evaluation import load_prompts
from regen.status import validate

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "src" / "regen" / "data" / "demo_prompts.jsonl"
STARTUP_BUDGET_S = 180


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def demo_server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("demo-server") / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    command = [sys.executable, "-m", "regen.serving.transformers_serve", "serve", str(demo_model_dir)]
    command += ["--trust-remote-code", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + STARTUP_BUDGET_S
        while True:
            assert process.poll() is None, f"the demo server exited:\n{log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"the demo server is not up:\n{log.read_text()[-4000:]}"
            time.sleep(0.3)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


@pytest.fixture
def drafter(tmp_path: Path) -> Path:
    """A drafter directory as the dflash server would load it; the client reads only its block size."""
    path = tmp_path / "export"
    path.mkdir()
    config = {"architectures": ["DFlashDraftModel"], "block_size": 8, "num_hidden_layers": 1}
    config["dflash_config"] = {"target_layer_ids": [2], "mask_token_id": 3845}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _job(command: str, model: Path, drafter: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "regen.jobs.evaluate_serving", command, "--target-model", str(model)]
    argv += ["--checkpoint", str(drafter), "--prompts", str(PROMPTS), "--output-dir", str(out)]
    argv += ["--max-prompts", "3", "--max-new-tokens", "4", "--prompt-max-tokens", "64"]
    argv += ["--chat-template-kwargs", '{"thinking": false}', "--concurrency", "1", "--concurrency", "2"]
    return subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=600, check=False)


def _requests(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return [r for r in lines if r["kind"] == "request"]


def test_the_client_sends_each_prompt_once_per_setting_and_resumes(
    demo_server: str, demo_model_dir: Path, drafter: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    plain = [
        "--server",
        "plain",
        "--endpoint",
        demo_server,
        "--api",
        "openai",
        "--model",
        str(demo_model_dir),
    ]
    plain += ["--no-tie-probe", "--no-progress"]
    first = _job("run", demo_model_dir, drafter, out, *plain)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout.splitlines()[-1]) == {
        "changed": True,
        "server": "plain",
        "sent": 6,
        "failed": 0,
    }
    records = _requests(out)
    # The seeded selection of regen.jobs.evaluate, each prompt once at concurrency 1 and once at 2.
    chosen = [p["id"] for p in load_prompts(PROMPTS, 3, 0)]
    keys = sorted((r["setting"], r["prompt_id"]) for r in records)
    assert keys == sorted((s, p) for s in ("c1", "c2") for p in chosen)
    assert all(r["completion_tokens"] >= 1 and r["seconds"] > 0 and r["text"] is not None for r in records)
    assert all(r["api"] == "openai" and r["spec"] is None for r in records)
    segments = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    segments = [s for s in segments if s["kind"] == "segment"]
    assert sorted((s["setting"], s["requests"]) for s in segments) == [("c1", 3), ("c2", 3)]
    status = json.loads((out / "status.json").read_text())
    assert validate(status) == [] and (status["state"], status["done"], status["total"]) == ("done", 6, 6)

    again = _job("run", demo_model_dir, drafter, out, *plain)
    assert again.returncode == 0 and json.loads(again.stdout.splitlines()[-1])["sent"] == 0

    # A run that died before its last answer was written: the next run sends that one request only.
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    last = max(i for i, line in enumerate(lines) if json.loads(line)["kind"] == "request")
    (out / "results.jsonl").write_text("".join(lines[:last] + lines[last + 1 :]) + '{"kind": "req')  # torn
    resumed = _job("run", demo_model_dir, drafter, out, *plain)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.splitlines()[-1])["sent"] == 1
    after = _requests(out)
    assert sorted((r["setting"], r["prompt_id"]) for r in after) == keys  # exactly once each

    # Acceptance comes only from SGLang: this server cannot be the speculative one, and the report says what
    # is missing instead of writing figures it does not have.
    dflash = _job("run", demo_model_dir, drafter, out, "--server", "dflash", "--endpoint", demo_server)
    assert dflash.returncode == 2 and "no SGLang native /generate" in dflash.stderr
    report = _job("report", demo_model_dir, drafter, out, "--no-tie-probe")
    assert report.returncode == 2 and "dflash server's records are incomplete" in report.stderr
    assert not (out / "report.json").exists()


def test_the_client_says_when_nothing_answers(demo_model_dir: Path, drafter: Path, tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{_free_port()}"
    run = _job("run", demo_model_dir, drafter, tmp_path / "out", "--server", "plain", "--endpoint", down)
    assert run.returncode == 3 and "nothing answers at" in run.stderr
    status = json.loads((tmp_path / "out" / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 3
