"""playbooks/mooncake.yml on localhost: the mooncake_master role runs the real Mooncake master.

Real parts: ansible-playbook runs the role against a temporary inventory (localhost, connection local),
which installs the Debian libraries with apt, builds the pinned venv (envs/mooncake.lock, the plain
build of mooncake-transfer-engine 0.3.13.post1) through python_env, and starts `mooncake_master` and
Mooncake's HTTP metadata server on free loopback ports. This machine has no systemd, so they run under
regen.serving.supervisor; the molecule scenario `default` runs the same role under systemd in an LXC
container. The test talks to the real servers: the RPC port accepts, the metadata server stores and
returns a key, and every listening socket of both processes is on 127.0.0.1, never a wildcard.

The venv is shared by the tests of this file (one build, then python_env only verifies it); each test
has its own ports, state directory and fact cache.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.ansible import ansible_env, localhost_inventory, run_playbook
from tests.helpers.mooncake import free_ports

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".cache" / "test-mooncake" / "venvs" / "mooncake"
PORTS_SCRIPT = ROOT / "roles" / "mooncake_master" / "files" / "mooncake_ports.py"


def _inventory(tmp_path: Path, ports: list[int], **extra: object) -> Path:
    rpc, http, metrics = ports
    variables = {
        "regen_root": str(ROOT),
        "regen_work_dir": str(tmp_path / "work"),
        "regen_artifacts_dir": str(tmp_path / "artifacts"),
        "regen_profile": "cpu",
        "regen_model_path": str(tmp_path / "models" / "none"),  # a required global; the master needs no model
        "regen_job_python": sys.executable,
        "mooncake_master_venv": str(VENV),
        "mooncake_master_rpc_port": rpc,
        "mooncake_master_http_metadata_port": http,
        "mooncake_master_metrics_port": metrics,
        **extra,
    }
    return localhost_inventory(tmp_path / "inventory.yml", groups=("regen_train",), variables=variables)


def _play(inventory: Path, *args: str) -> tuple[str, dict[str, int]]:
    # Each test its own fact cache: the service-manager fact must come from this run.
    env = ansible_env(ANSIBLE_CACHE_PLUGIN_CONNECTION=str(inventory.parent / "facts"))
    run = run_playbook("playbooks/mooncake.yml", *args, inventory=inventory, env=env, timeout=900)
    return run.output, run.counts("localhost")


def _state_dir(tmp_path: Path) -> Path:
    return tmp_path / "work" / "mooncake"


def _pid(tmp_path: Path, name: str) -> int:
    return int((_state_dir(tmp_path) / f"{name}.pid").read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[-1].split()[0] != "Z"


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _listeners(pids: list[int]) -> list[dict]:
    request = json.dumps({"host": "127.0.0.1", "own_pids": pids, "ports": []})
    out = subprocess.run(
        [sys.executable, str(PORTS_SCRIPT), request], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)["listeners"]


def _metadata(port: int, key: str, method: str = "GET", body: bytes | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metadata?key={key}", data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def stop_afterwards(tmp_path: Path):
    """Whatever a test left running under tmp_path/work is stopped afterwards, by pid file."""
    yield
    for pid_file in _state_dir(tmp_path).glob("*.pid"):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "regen.serving.supervisor",
                "stop",
                "--state-dir",
                str(pid_file.parent),
                "--name",
                pid_file.stem,
                "--timeout",
                "10",
            ],
            capture_output=True,
            check=False,
        )


def _start(tmp_path: Path, ports: list[int]) -> tuple[Path, int, int]:
    """Run the playbook once; return the inventory and the pids of the master and the metadata server."""
    inventory = _inventory(tmp_path, ports)
    output, counts = _play(inventory)
    assert counts["failed"] == 0, output[-4000:]
    assert "processes supervised by regen.serving.supervisor" in output
    master, metadata = _pid(tmp_path, "mooncake-master"), _pid(tmp_path, "mooncake-metadata")
    assert _alive(master) and _alive(metadata)
    return inventory, master, metadata


def _stop(inventory: Path, master: int, metadata: int, ports: list[int]) -> None:
    output, counts = _play(inventory, "-e", "mooncake_master_state=stopped")
    assert counts["failed"] == 0 and counts["changed"] == 1, output[-4000:]
    assert "changed: [localhost] => (item=mooncake-master)" in output
    assert "changed: [localhost] => (item=mooncake-metadata)" in output
    deadline = time.monotonic() + 10
    while (_alive(master) or _alive(metadata)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(master) and not _alive(metadata)
    assert not any(_accepts(port) for port in ports)


def test_master_starts_answers_on_loopback_and_stops(tmp_path: Path, stop_afterwards) -> None:
    ports = free_ports(3)
    rpc, http, metrics = ports
    inventory, master, metadata = _start(tmp_path, ports)
    assert Path(f"/proc/{master}/exe").resolve().name == "mooncake_master"
    assert _accepts(rpc) and _accepts(metrics)

    # The metadata server is Mooncake's: it stores, returns and deletes what a transfer engine puts there.
    assert _metadata(http, "regen-test") == (404, "metadata not found")
    assert _metadata(http, "regen-test", "PUT", b'{"segment": 1}') == (200, "metadata updated")
    assert _metadata(http, "regen-test") == (200, '{"segment": 1}')
    assert _metadata(http, "regen-test", "DELETE") == (200, "metadata deleted")

    # Every socket the two processes listen on is on the bind address; the three ports are theirs.
    listening = _listeners([master, metadata])
    assert {(item["address"], item["port"]) for item in listening} == {
        ("127.0.0.1", rpc),
        ("127.0.0.1", http),
        ("127.0.0.1", metrics),
    }, listening

    _stop(inventory, master, metadata, ports)


@pytest.mark.e2e
def test_second_run_check_mode_and_second_stop_change_nothing(tmp_path: Path, stop_afterwards) -> None:
    ports = free_ports(3)
    inventory, master, metadata = _start(tmp_path, ports)

    output, counts = _play(inventory)
    assert counts["failed"] == 0 and counts["changed"] == 0, output[-4000:]
    assert (_pid(tmp_path, "mooncake-master"), _pid(tmp_path, "mooncake-metadata")) == (master, metadata)
    output, counts = _play(inventory, "--check")
    assert counts["failed"] == 0 and counts["changed"] == 0, output[-4000:]

    # Check mode says the stop would change something, and stops nothing.
    output, counts = _play(inventory, "--check", "-e", "mooncake_master_state=stopped")
    assert counts["failed"] == 0 and counts["changed"] == 1, output[-4000:]
    assert _alive(master) and _alive(metadata)

    _stop(inventory, master, metadata, ports)
    output, counts = _play(inventory, "-e", "mooncake_master_state=stopped")
    assert counts["failed"] == 0 and counts["changed"] == 0, output[-4000:]


def test_a_port_held_by_another_process_is_named_with_its_pid(tmp_path: Path, stop_afterwards) -> None:
    ports = free_ports(3)
    inventory = _inventory(tmp_path, ports)
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", ports[1]))
        stranger.listen()
        output, counts = _play(inventory)
    assert counts["failed"] == 1, output[-4000:]
    expected = (
        f"port {ports[1]} on 127.0.0.1 (HTTP metadata port of the Mooncake master) is already in use by "
        f"pid {os.getpid()} "
    )
    assert expected in output, output[-4000:]
    assert "stop that process or set mooncake_master_http_metadata_port to a free port" in output
    # Nothing was started.
    assert not list(_state_dir(tmp_path).glob("*.pid"))
    assert not _accepts(ports[0])


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            {"mooncake_master_bind_address": "0.0.0.0"},
            "mooncake_master_bind_address is 0.0.0.0, which would expose the Mooncake master",
        ),
        ({"mooncake_master_bind_address": "::"}, "or set mooncake_master_allow_any_address: true"),
        # Issue 25: the refusal compared strings; these spellings also bind every interface.
        ({"mooncake_master_bind_address": "0"}, "which would expose the Mooncake master"),
        ({"mooncake_master_bind_address": "[::]"}, "on every interface"),
        ({"mooncake_master_bind_address": "0.0.0.0/0"}, "on every interface"),
        (
            {"mooncake_master_bind_address": "localhost"},
            'mooncake_master_bind_address is "localhost", which is not an IPv4 or IPv6 address',
        ),
        ({"mooncake_master_bind_address": "127.0.0.300"}, "which is not an IPv4 or IPv6 address"),
        ({"mooncake_master_rpc_port": 70000}, "mooncake_master_rpc_port is 70000; a TCP port is a number"),
        ({"mooncake_master_metrics_port": "RPC_PORT"}, "mooncake_master_metrics_port"),
        ({"mooncake_master_service_mode": "docker"}, "mooncake_master_service_mode"),
        (
            {"mooncake_master_metadata_server": "embedded"},
            "mooncake_master_metadata_server is embedded, but the master's built-in HTTP metadata server",
        ),
    ],
    ids=[
        "ipv4-wildcard",
        "ipv6-wildcard",
        "zero-wildcard",
        "bracketed-wildcard",
        "network-wildcard",
        "hostname",
        "bad-octet",
        "port-range",
        "port-type",
        "mode",
        "embedded",
    ],
)
def test_bad_settings_fail_before_anything_is_installed(
    tmp_path: Path, settings: dict, expected: str
) -> None:
    ports = free_ports(3)
    inventory = _inventory(tmp_path, ports, **settings)
    output, counts = _play(inventory)
    assert counts["failed"] == 1, output[-4000:]
    assert expected in output, output[-4000:]
    assert counts["changed"] == 0
    assert not (tmp_path / "work").exists()


def test_same_port_twice_is_refused(tmp_path: Path) -> None:
    rpc, _http, metrics = free_ports(3)
    inventory = _inventory(tmp_path, [rpc, rpc, metrics])
    output, counts = _play(inventory)
    assert counts["failed"] == 1, output[-4000:]
    assert f"mooncake_master_rpc_port ({rpc}), mooncake_master_http_metadata_port ({rpc})" in output
    assert "must be three different ports" in output


def test_a_master_that_exits_at_start_fails_with_its_log(tmp_path: Path, stop_afterwards) -> None:
    ports = free_ports(3)
    # A flag mooncake_master rejects: it prints why and exits before it binds anything.
    settings = {"mooncake_master_extra_args": ["--regen_no_such_flag=1"]}
    inventory = _inventory(tmp_path, ports, **settings, mooncake_master_ready_timeout_s=5)
    output, counts = _play(inventory)
    assert counts["failed"] == 1, output[-4000:]
    assert "the Mooncake master on 127.0.0.1 is not ready: Timeout when waiting for 127.0.0.1:" in output
    assert f"log: {_state_dir(tmp_path)}/<name>.log" in output
    assert "unknown command line flag 'regen_no_such_flag'" in output, output[-4000:]
