"""A real `transformers serve` process on loopback loads the demo model and answers a chat completion.

transformers 5.x serve resolves a model class with ``getattr(transformers, architectures[0])``, which no
remote-code architecture passes; the demo's configuration module publishes a loader under its name (see
configuration_kimi_k25_demo.py), and this test is what proves that works with the real CLI.

The second test starts the server the way the serve stage does, through regen's launcher with the API key
in its environment, and proves the key is asked for on every path but the probes' own.
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

from transformers import AutoTokenizer

SERVE = Path(sys.executable).parent / "transformers"
STARTUP_BUDGET_S = 120


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_BUDGET_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(
                f"transformers serve exited with {process.returncode}:\n{log.read_text()[-4000:]}"
            )
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise AssertionError(
        f"transformers serve not healthy after {STARTUP_BUDGET_S}s:\n{log.read_text()[-4000:]}"
    )


def _start(command: list[str], log: Path, **env: str) -> subprocess.Popen:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    with log.open("w") as sink:
        return subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=environment, start_new_session=True
        )


def _stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _status(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def _chat(model_dir: Path) -> dict:
    return {
        "model": str(model_dir),
        "messages": [{"role": "user", "content": "Hello, who are you?"}],
        "max_tokens": 4,
        "chat_template_kwargs": {"thinking": False},
    }


def test_transformers_serve_answers_a_chat_completion(demo_model_dir: Path, tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = [str(SERVE), "serve", str(demo_model_dir), "--trust-remote-code", "--device", "cpu"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    process = _start(command, log)
    try:
        _wait_healthy(url, process, log)
        body = _chat(demo_model_dir)
        status, answer = _status(f"{url}/v1/chat/completions", body)
        assert status == 200, answer
    finally:
        _stop(process)

    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("length", "stop")
    assert 1 <= answer["usage"]["completion_tokens"] <= 4
    # The server rendered our template with the thinking switch off (a closed <think></think>).
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir, trust_remote_code=True)
    expected = tokenizer.apply_chat_template(
        body["messages"], add_generation_prompt=True, thinking=False, return_dict=True
    )["input_ids"]
    assert answer["usage"]["prompt_tokens"] == len(expected)


def test_regens_launcher_asks_for_the_api_key(demo_model_dir: Path, tmp_path: Path) -> None:
    """regen.serving.transformers_serve with REGEN_SERVING_API_KEY set (as the serve stage's environment
    file sets it): /health answers without a key (probes), /v1/models and a chat completion answer 401
    without it or with another key, and 200 with it."""
    key = "demo-serve-key-51f0"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "regen.serving.transformers_serve", "serve", str(demo_model_dir),
               "--trust-remote-code", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    process = _start(command, log, REGEN_SERVING_API_KEY=key)
    try:
        _wait_healthy(url, process, log)  # /health, without a key
        assert _status(f"{url}/v1/models")[0] == 401
        assert _status(f"{url}/v1/models", key="another-key")[0] == 401
        status, refusal = _status(f"{url}/v1/chat/completions", _chat(demo_model_dir))
        assert status == 401 and "Authorization: Bearer" in refusal["error"]
        status, models = _status(f"{url}/v1/models", key=key)
        assert status == 200 and models["data"], models
        status, answer = _status(f"{url}/v1/chat/completions", _chat(demo_model_dir), key=key)
        assert status == 200 and 1 <= answer["usage"]["completion_tokens"] <= 4, answer
    finally:
        _stop(process)
    assert key not in log.read_text()
