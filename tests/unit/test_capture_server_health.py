"""The capture server's /health follows the Mooncake master, and its bind address follows the policy.

Issue 25: /health stayed "ok" after the Mooncake master died, so the online preflight passed. The master
and metadata server here are fault-injection stand-ins, named so: a listening loopback socket (what
`probe_mooncake` asks of the master's RPC port) and Python's http.server (any HTTP answer is a metadata
server's), so the master can be made to "die" by closing its socket. The real Mooncake master behind the
same probe is exercised by tests/integration/test_capture_server.py. The HTTP handler and server are the
capture server's own, on loopback; the capture service is a stand-in with the one attribute /health reads.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

from regen.training import capture_server as cs


class _CapturedCount:  # fault-injection stand-in for CaptureService: /health reads only `captured`
    captured = 7


def _serve(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return thread


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_health_turns_unavailable_when_the_mooncake_master_dies() -> None:
    master = socket.socket()
    master.bind(("127.0.0.1", 0))
    master.listen()
    metadata = ThreadingHTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)
    _serve(metadata)
    settings = {
        "master_server_addr": f"127.0.0.1:{master.getsockname()[1]}",
        "metadata_server": f"http://127.0.0.1:{metadata.server_address[1]}/metadata",
    }
    holder = {"service": _CapturedCount(), "mooncake_health": cs.MooncakeHealth(settings, interval=0)}
    server = ThreadingHTTPServer(("127.0.0.1", 0), cs.make_handler(holder, lambda _m: None))
    _serve(server)
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    try:
        assert _get(url) == (200, {"status": "ok", "captured": 7})
        master.close()  # the master dies
        status, body = _get(url)
        assert status == 503 and body["status"] == "mooncake unreachable"
        assert f"the Mooncake master at {settings['master_server_addr']} does not accept" in body["error"]
    finally:
        server.shutdown()
        metadata.shutdown()
        master.close()


def test_the_probe_is_rate_limited() -> None:
    calls = []
    health = cs.MooncakeHealth({}, interval=60)
    original = cs.probe_mooncake
    cs.probe_mooncake = lambda settings, wait: calls.append(wait) or None
    try:
        assert health() is None and health() is None
    finally:
        cs.probe_mooncake = original
    assert calls == [0]


def test_a_wildcard_host_in_any_spelling_is_refused_before_anything_starts() -> None:
    # Before the model loads or Mooncake is asked: exit 2 with the variable to change.
    for host in ("0.0.0.0", "0", "::", "[::]"):
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "regen.training.capture_server",
                "--model",
                "/nonexistent",
                "--layers",
                "1",
                "--host",
                host,
                "--port",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert run.returncode == 2, run.stderr
        assert "would expose the capture server" in run.stderr and "--allow-any-address" in run.stderr
        assert "Traceback" not in run.stderr
