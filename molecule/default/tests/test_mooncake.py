"""Verify the Mooncake master in the CT200 stand-in after `converge` (testinfra over SSH).

converge ran playbooks/mooncake.yml: the Debian libraries came from apt inside the container, the venv
from the plain build's wheelhouse (offline), and mooncake_master with Mooncake's HTTP metadata server run
as the systemd units regen-mooncake-master and regen-mooncake-metadata on the container's address on the
bridge (another container, ct200-capture, uses the master: tests/test_firewall.py). These tests look at
the units, the sockets (as the kernel reports them) and the servers' answers inside the container, then
re-run the playbook with a port another process holds and with a wildcard address (both refused, the
running master untouched), and last stop it (twice: the second run changes nothing).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

HOST = "ct200-standin"
VENV = "/root/regen/venvs/mooncake"
PROJECT = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", Path(__file__).resolve().parents[3]))
UNITS = ("regen-mooncake-master", "regen-mooncake-metadata")
PORTS = {"rpc": 50051, "http": 8080, "metrics": 9003}


def _playbook(*extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0"}
    inventory = Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent
    return subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            "-i",
            str(inventory),
            str(PROJECT / "playbooks" / "mooncake.yml"),
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def _main_pid(host, unit: str) -> int:
    return int(host.check_output(f"systemctl show -p MainPID --value {unit}"))


@pytest.fixture(scope="module")
def address(host) -> str:
    """The stand-in's address on the containers' bridge: mooncake_master_bind_address in molecule.yml."""
    return host.ansible.get_variables()["ansible_host"]


def _listening(host) -> set[tuple[str, int, int]]:
    """(address, port, pid) of every TCP listener in the container, from `ss -ltnpH`."""
    found = set()
    for line in host.check_output("ss -ltnpH").splitlines():
        fields = line.split()
        address, _, port = fields[3].rpartition(":")
        for part in line.split("pid=")[1:]:
            found.add((address.strip("[]"), int(port), int(part.split(",")[0])))
    return found


def _get(host, url: str, method: str = "GET", body: str | None = None) -> tuple[int, str]:
    data = "None" if body is None else repr(body.encode())
    script = (
        "import urllib.request, urllib.error, json\n"
        f"r = urllib.request.Request({url!r}, data={data}, method={method!r})\n"
        "try:\n"
        "    x = urllib.request.urlopen(r, timeout=10); print(json.dumps([x.status, x.read().decode()]))\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(json.dumps([e.code, e.read().decode()]))\n"
    )
    result = host.run(f"python3 -c {shlex.quote(script)}")
    assert result.rc == 0, result.stderr
    status, text = json.loads(result.stdout)
    return status, text


def test_system_libraries_came_from_apt(host) -> None:
    for package in ("libibverbs1", "libnuma1", "libcurl4"):
        assert host.package(package).is_installed, package
    binary = host.check_output(
        f'{VENV}/bin/python -c "import os, mooncake.cli as c; print(os.path.dirname(c.__file__))"'
    )
    ldd = host.check_output(f"ldd {binary}/mooncake_master")
    assert "not found" not in ldd, ldd
    assert "libibverbs.so.1 => /" in ldd


def test_units_run_and_are_enabled(host, address) -> None:
    for unit in UNITS:
        service = host.service(unit)
        assert service.is_running and service.is_enabled, unit
    unit_file = host.file("/etc/systemd/system/regen-mooncake-master.service").content_string
    assert "Restart=on-failure" in unit_file and "LimitNOFILE=65536" in unit_file
    assert f"--rpc_address={address} --rpc_port=50051 --metrics_host={address}" in unit_file
    master = _main_pid(host, "regen-mooncake-master")
    assert host.check_output(f"readlink /proc/{master}/exe").endswith("/mooncake/mooncake_master")


def test_every_listener_is_on_the_bind_address(host, address) -> None:
    pids = {_main_pid(host, unit) for unit in UNITS}
    ours = {(bound, port) for bound, port, pid in _listening(host) if pid in pids}
    assert ours == {(address, port) for port in PORTS.values()}, ours


def test_metadata_server_stores_what_a_transfer_engine_puts(host, address) -> None:
    url = f"http://{address}:{PORTS['http']}/metadata?key=regen-verify"
    assert _get(host, url) == (404, "metadata not found")
    assert _get(host, url, "PUT", '{"segment": "verify"}') == (200, "metadata updated")
    assert _get(host, url) == (200, '{"segment": "verify"}')
    assert _get(host, url, "DELETE") == (200, "metadata deleted")
    assert _get(host, f"http://{address}:{PORTS['metrics']}/health")[0] == 200


@pytest.fixture
def stranger_on_a_port(host, address):
    """A real listener on the bind address, port 18080, inside the container, gone afterwards."""
    host.run(
        "systemd-run --unit regen-verify-stranger --collect "
        f"python3 -m http.server 18080 --bind {address} --directory /tmp"
    )
    host.run("for i in $(seq 50); do ss -ltnH 'sport = :18080' | grep -q LISTEN && break; sleep 0.1; done")
    yield _main_pid(host, "regen-verify-stranger")
    host.run("systemctl stop regen-verify-stranger")


def test_a_taken_port_is_refused_with_its_owner(host, address, stranger_on_a_port) -> None:
    before = _main_pid(host, "regen-mooncake-master")
    result = _playbook("-e", "mooncake_master_http_metadata_port=18080")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    expected = (
        f"port 18080 on {address} (HTTP metadata port of the Mooncake master) is already in use by "
        f"pid {stranger_on_a_port} python3"
    )
    assert expected in output, output[-3000:]
    assert "set mooncake_master_http_metadata_port to a free port" in output
    # Refused before any unit was touched: the running master is the same process.
    assert _main_pid(host, "regen-mooncake-master") == before


def test_a_wildcard_address_is_refused(host) -> None:
    result = _playbook("-e", "mooncake_master_bind_address=0.0.0.0")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "mooncake_master_bind_address is 0.0.0.0, which would expose the Mooncake master" in output
    assert "mooncake_master_allow_any_address: true" in output
    assert "0.0.0.0" not in host.file("/etc/systemd/system/regen-mooncake-master.service").content_string


def test_teardown_stops_both_units_and_a_second_stop_changes_nothing(host) -> None:
    result = _playbook("-e", "mooncake_master_state=stopped")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    for unit in UNITS:
        service = host.service(unit)
        assert not service.is_running and not service.is_enabled, unit
    assert not {port for _address, port, _pid in _listening(host)} & set(PORTS.values())
    again = _playbook("-e", "mooncake_master_state=stopped")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert f"{HOST}" in again.stdout and " changed=0 " in again.stdout, again.stdout[-3000:]
