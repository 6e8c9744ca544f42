"""A real `transformers serve` process on loopback loads the demo model and answers a chat completion.

transformers 5.x serve resolves a model class with ``getattr(transformers, architectures[0])``, which no
remote-code architecture passes; the demo's configuration module publishes a loader under its name (see
configuration_kimi_k25_demo.py), and this test is what proves that works with the real CLI.
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


def test_transformers_serve_answers_a_chat_completion(demo_model_dir: Path, tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    command = [str(SERVE), "serve", str(demo_model_dir), "--trust-remote-code", "--device", "cpu"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        _wait_healthy(url, process, log)
        body = {
            "model": str(demo_model_dir),
            "messages": [{"role": "user", "content": "Hello, who are you?"}],
            "max_tokens": 4,
            "chat_template_kwargs": {"thinking": False},
        }
        request = urllib.request.Request(
            f"{url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            answer = json.loads(response.read())
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

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
