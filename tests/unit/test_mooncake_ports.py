"""roles/mooncake_master/files/mooncake_ports.py, run the way the role runs it: one JSON argument.

Real sockets on loopback opened by this test process: the script must find this process as the owner of
a taken port (from /proc, as `ss -ltnp` does), tell "ours" from a stranger by pid, list the listeners of
given pids with their real addresses (IPv4 and IPv6), and say a port nobody holds is free.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "roles" / "mooncake_master" / "files" / "mooncake_ports.py"


def _ask(host: str, ports: list[int], own_pids: list[int] = ()) -> dict:
    request = {
        "host": host,
        "own_pids": list(own_pids),
        "ports": [{"port": port, "variable": f"var_{port}", "what": "test"} for port in ports],
    }
    out = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(request)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_taken_port_names_its_owner_and_a_free_one_is_free(listener: int) -> None:
    free = _free_port()
    answer = _ask("127.0.0.1", [listener, free])
    taken, other = answer["ports"]
    assert taken["free"] is False and taken["ours"] is False
    assert taken["variable"] == f"var_{listener}"
    assert [(o["pid"], o["address"]) for o in taken["owners"]] == [(os.getpid(), "127.0.0.1")]
    # The owner is this test process (its comm and command line), not the script that asked.
    with open(f"/proc/{os.getpid()}/comm", encoding="utf-8") as handle:
        assert taken["owners"][0]["name"] == handle.read().strip()
    assert str(SCRIPT) not in taken["owners"][0]["cmdline"]
    assert other == {
        "port": free,
        "variable": f"var_{free}",
        "what": "test",
        "free": True,
        "ours": False,
        "owners": [],
    }
    assert answer["listeners"] == [] and answer["changed"] is False


def test_a_port_held_by_an_own_pid_is_ours_and_listed(listener: int) -> None:
    answer = _ask("127.0.0.1", [listener], own_pids=[os.getpid()])
    assert answer["ports"][0]["ours"] is True
    assert {"pid": os.getpid(), "address": "127.0.0.1", "port": listener} in [
        {k: item[k] for k in ("pid", "address", "port")} for item in answer["listeners"]
    ]


def test_a_listener_on_another_loopback_address_does_not_block_this_one(listener: int) -> None:
    # 127.0.0.2 is loopback too (127/8), and a socket bound there does not clash with 127.0.0.1.
    answer = _ask("127.0.0.2", [listener])
    assert answer["ports"][0]["free"] is True and answer["ports"][0]["owners"] == []


def test_ipv6_loopback_listeners_are_decoded() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this kernel")
    sock = socket.socket(socket.AF_INET6)
    try:
        sock.bind(("::1", 0))
    except OSError:
        sock.close()
        pytest.skip("no ::1 on this machine")
    with sock:
        sock.listen()
        port = sock.getsockname()[1]
        answer = _ask("::1", [port], own_pids=[os.getpid()])
    assert answer["ports"][0]["free"] is False and answer["ports"][0]["ours"] is True
    assert ("::1", port) in {(item["address"], item["port"]) for item in answer["listeners"]}


def test_a_bad_request_says_so() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "{not json"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 2
    assert json.loads(out.stdout)["msg"].startswith("bad request:")
