"""playbooks/preflight.yml for real on localhost: it passes on the CPU profile and changes nothing on a
second run; a port held by another process and an endpoint that does not answer stop it with the fix. The
endpoints are loopback servers this test starts (never another host)."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from regen.procs import spawn_detached
from tests.helpers.ansible import localhost_inventory, run_playbook
from tests.helpers.mooncake import free_ports

LISTEN = (
    "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); "
    "s.listen(); time.sleep(120)"
)


def _wait_listening(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}")


def _inventory(tmp_path: Path, **variables) -> Path:
    base = {
        "regen_work_dir": str(tmp_path / "work"),
        "regen_artifacts_dir": str(tmp_path / "artifacts"),
        "regen_model_path": str(tmp_path / "models" / "m"),
        "regen_profile": "cpu",
    }
    return localhost_inventory(tmp_path / "hosts.yml", variables={**base, **variables})


def _table(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "artifacts" / "preflight" / "localhost.json").read_text())


def test_preflight_passes_on_the_cpu_profile_and_changes_nothing(tmp_path):
    serve, evaluate = free_ports(2)
    inventory = _inventory(tmp_path, sglang_server_port=serve, drafter_evaluation_port=evaluate)
    first = run_playbook("playbooks/preflight.yml", inventory=inventory)
    assert first.returncode == 0, first.output[-3000:]
    rows = {r["check"]: r for r in _table(tmp_path)["rows"]}
    assert rows["GPU count"]["verdict"] == "n/a"
    assert rows[f"port {serve} (sglang_server_port)"]["verdict"] == "ok"
    assert rows["disk: weights"]["verdict"] == "warn"  # no weight index yet: unknown, said so
    second = run_playbook("playbooks/preflight.yml", inventory=inventory)
    assert second.returncode == 0 and second.counts()["changed"] == 0, second.output[-3000:]
    assert not (tmp_path / "work").exists()  # read, never made


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_preflight_stops_on_a_busy_port_and_an_unreachable_endpoint(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (closed,) = free_ports(1)
    (evaluate,) = free_ports(1)
    # A server regen's supervisor started: its own session, its pid recorded in the serving state dir.
    serving = tmp_path / "work" / "serving"
    serving.mkdir(parents=True)
    ours = spawn_detached(
        [sys.executable, "-c", LISTEN, str(evaluate)], output=subprocess.DEVNULL, cwd=str(tmp_path)
    )
    (serving / "main.pid").write_text(f"{ours.pid}\n")
    _wait_listening(evaluate)
    try:
        inventory = _inventory(
            tmp_path,
            sglang_server_port=busy.getsockname()[1],
            drafter_evaluation_port=evaluate,
            preflight_endpoints=[
                {"name": "package index", "url": f"http://127.0.0.1:{server.server_port}/simple/"},
                {
                    "name": "hub",
                    "url": f"http://127.0.0.1:{closed}/",
                    "offline_path": str(tmp_path / "mirror"),
                },
            ],
            preflight_endpoint_timeout=2,
        )
        run = run_playbook("playbooks/preflight.yml", inventory=inventory)
    finally:
        busy.close()
        server.shutdown()
        os.killpg(ours.pid, signal.SIGKILL)
        ours.wait()
    assert run.returncode != 0
    rows = {r["check"]: r for r in _table(tmp_path)["rows"]}
    port = next(r for c, r in rows.items() if c.endswith("(sglang_server_port)"))
    assert port["verdict"] == "fail" and "set sglang_server_port to a free port" in port["fix"]
    regen_own = rows[f"port {evaluate} (drafter_evaluation_port)"]
    assert regen_own["verdict"] == "ok" and "regen's own server" in regen_own["value"], regen_own
    assert rows["reach package index"]["verdict"] == "ok"
    assert rows["reach hub"]["verdict"] == "fail" and str(tmp_path / "mirror") in rows["reach hub"]["fix"]
    assert "preflight failed on localhost" in run.output and "reach hub" in run.output


def test_regen_preflight_prints_the_table_as_json(tmp_path):
    import subprocess
    import sys

    from tests.helpers.ansible import ROOT, ansible_env

    serve, evaluate = free_ports(2)
    inventory = _inventory(tmp_path, sglang_server_port=serve, drafter_evaluation_port=evaluate)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "regen.cli",
            "preflight",
            "-i",
            str(inventory),
            "--json",
            "--project",
            str(ROOT),
            "--private-data-dir",
            str(tmp_path / "runner"),
        ],
        cwd=ROOT,
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (table,) = json.loads(result.stdout)
    assert table["host"] == "localhost" and table["verdict"] in ("ok", "warn")
    assert any(r["check"] == f"port {serve} (sglang_server_port)" for r in table["rows"])
