"""A real sglang-router 0.3.2, launched as the sglang_server role plans it: no API key on its command
line, its listeners (API and Prometheus metrics) on loopback, and the key still reaching the workers.

The router is the real one (Rust core, from the throwaway venv of tests/unit/test_serving_argv.py), run by
the real process supervisor with the key in a 0600 environment file, as the role runs it. Its worker is a
recording worker: a real HTTP server on loopback (standard library) that answers the router's probes and
writes down the Authorization header of every request, so the test can see the key arrive without it
ever being on an argv. Before the fix the plan put `--api-key ${REGEN_SERVING_API_KEY}` on the argv
(expanded by the supervisor, so `ps` showed the key) and left the metrics on sglang-router's default
0.0.0.0:29000.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVING = ROOT / "tests" / "fixtures" / "serving"

from ansible.module_utils import regen_serving

from regen.serving import supervisor

KEY = "router-test-key-5f1c"
RECORDING_WORKER = r"""
import http.server, json, sys
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        with open(sys.argv[2], "a", encoding="utf-8") as log:
            log.write(json.dumps([self.path, self.headers.get("Authorization")]) + "\n")
        body = json.dumps({"object": "list", "data": [{"id": "recorded", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def router_python() -> Path:
    sys.path.insert(0, str(SERVING))
    from sglang_venv import VenvError, sglang_venv_python

    try:
        return sglang_venv_python()
    except VenvError as exc:
        pytest.fail(str(exc))


@pytest.fixture
def worker(tmp_path: Path):
    port, log = _free_port(), tmp_path / "worker-requests.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", RECORDING_WORKER, str(port), str(log)])
    try:
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def state_dir(tmp_path: Path):
    path = tmp_path / "state"
    yield path
    for pid_file in path.glob("*.pid"):
        supervisor.stop(str(path), pid_file.stem, remove=True, timeout=10)


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except OSError as exc:
        return 0, str(exc)


def _router_processes(pid: int) -> list[psutil.Process]:
    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


def test_the_router_gets_its_key_from_the_environment_and_listens_on_loopback(
    router_python, worker, state_dir, tmp_path
):
    worker_url, requests_log = worker
    port, metrics_port = _free_port(), _free_port()
    plan = regen_serving.plan_router({
        "python": str(router_python), "worker_urls": [worker_url], "policy": "round_robin",
        "host": "127.0.0.1", "port": port, "api_key_set": True, "metrics_port": metrics_port,
    })
    assert not any(KEY in a or a == "--api-key" for a in plan["argv"])
    env_file = tmp_path / "router.env"
    env_file.write_text(f"REGEN_SERVING_API_KEY={KEY}\n")
    env_file.chmod(0o600)
    spec = {"name": "router", "argv": plan["argv"], "env": plan["env"], "state_dir": str(state_dir),
            "host": "127.0.0.1", "port": port, "stop_timeout": 10}
    started = supervisor.start(spec, str(env_file))
    deadline = time.monotonic() + 90
    status = 0
    while time.monotonic() < deadline:
        status, _ = _get(f"http://127.0.0.1:{port}/health")
        if status == 200:
            break
        assert psutil.pid_exists(started["pid"]), (state_dir / "router.log").read_text()[-3000:]
        time.sleep(0.5)
    assert status == 200, (state_dir / "router.log").read_text()[-3000:]

    # The key reached the router: it authenticates to its worker with it.
    deadline = time.monotonic() + 30
    seen = []
    while time.monotonic() < deadline:
        text = requests_log.read_text() if requests_log.exists() else ""
        seen = [json.loads(line) for line in text.splitlines()]
        if any(auth == f"Bearer {KEY}" for _path, auth in seen):
            break
        time.sleep(0.5)
    assert any(auth == f"Bearer {KEY}" for _path, auth in seen), seen

    processes = _router_processes(started["pid"])
    for proc in processes:
        # Not on any command line `ps` shows (the kernel's NUL-split argv)...
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode("utf-8", "replace")
        assert KEY not in cmdline, cmdline
    # ...only in the router's own environment, which /proc keeps readable by its owner alone.
    assert KEY in Path(f"/proc/{started['pid']}/environ").read_bytes().decode("utf-8", "replace")
    assert os.stat(f"/proc/{started['pid']}/environ").st_mode & 0o077 == 0

    # Every listening socket of the router binds loopback, the metrics listener included.
    listening = {
        (conn.laddr.ip, conn.laddr.port)
        for proc in processes
        for conn in proc.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    }
    assert ("127.0.0.1", port) in listening and ("127.0.0.1", metrics_port) in listening, listening
    assert all(ip in ("127.0.0.1", "::1") for ip, _ in listening), listening
    metrics_status, metrics = _get(f"http://127.0.0.1:{metrics_port}/metrics")
    assert metrics_status == 200 and "# TYPE" in metrics
    assert KEY not in (state_dir / "router.state.json").read_text()


def test_the_launcher_refuses_to_start_without_its_key(router_python):
    plan = regen_serving.plan_router({
        "python": str(router_python), "worker_urls": ["http://127.0.0.1:9"], "api_key_set": True,
        "port": _free_port(), "metrics_port": _free_port(),
    })
    env = {k: v for k, v in os.environ.items() if k != regen_serving.API_KEY_ENV}
    proc = subprocess.run(plan["argv"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 1
    assert "REGEN_SERVING_API_KEY is empty" in proc.stderr and "re-run the serve stage" in proc.stderr


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"extra_args": ["--api-key", "x"]}, "set sglang_server_router_api_key instead"),
        ({"extra_args": ["--prometheus-host=0.0.0.0"]}, "set sglang_server_router_metrics_host instead"),
        ({"metrics_port": 30100}, "sglang_server_router_metrics_port to another port"),
        ({"metrics_port": 0}, "1..65535"),
    ],
)
def test_bad_router_settings_name_the_variable(spec, needle):
    with pytest.raises(regen_serving.ServingPlanError, match=needle):
        regen_serving.plan_router({"python": "/p", "worker_urls": ["http://127.0.0.1:1"], **spec})


def test_metrics_off_loopback_only_when_the_inventory_says_so_and_then_with_a_warning():
    base = {"python": "/p", "worker_urls": ["http://127.0.0.1:1"]}
    default = regen_serving.plan_router(base)
    assert default["metrics_host"] == "127.0.0.1" and not default["warnings"]
    opened = regen_serving.plan_router({**base, "metrics_host": "0.0.0.0"})
    argv = opened["argv"]
    assert argv[argv.index("--prometheus-host") + 1] == "0.0.0.0"
    assert "without authentication" in opened["warnings"][0]
