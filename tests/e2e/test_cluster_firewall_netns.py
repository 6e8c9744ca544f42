"""The cluster_firewall role for real: three hosts as network namespaces the test creates.

A, B and C are network namespaces joined by a private bridge (in a namespace of its own) on TEST-NET-1
(192.0.2.0/24, never routed). A listens on a guarded port and an unguarded one; the role, run by
ansible-playbook inside A's namespace with an inventory that puts A in regen_capture and B in
regen_train, loads regen's nftables table there. Then B connects and C (in no group) cannot, on the
guarded port and in the guarded port range only; A's other nftables table survives; a second run and a
check-mode run change nothing.
Needs root, `ip` and `nft` (apt install nftables); seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.helpers.ansible import BIN, ROOT, ansible_env, parse_recap

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
    pytest.mark.skipif(
        not shutil.which("ip") or not shutil.which("nft"), reason="needs ip and nft (apt install nftables)"
    ),
]

ADDRESS = {"a": "192.0.2.1", "b": "192.0.2.2", "c": "192.0.2.3"}
GUARDED, OPEN = 30200, 30201
# A guarded port range (Mooncake's transfer engine picks its listeners from one) and a port inside it.
GUARDED_RANGE, IN_RANGE = "30210-30219", 30215
PORTS = (GUARDED, OPEN, IN_RANGE)

LISTENER = textwrap.dedent(
    """
    import socket, sys, threading
    def serve(port):
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((sys.argv[1], port)); s.listen(16)
        while True:
            c, _ = s.accept(); c.sendall(b"hello"); c.close()
    for p in sys.argv[2:]:
        threading.Thread(target=serve, args=(int(p),), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()
    """
)

PROBE = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5).recv(5)"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def namespaces():
    tag = f"{os.getpid() % 100000}"
    names = {host: f"rgfw{host}{tag}" for host in ("hub", *ADDRESS)}
    try:
        for name in names.values():
            _ip("netns", "add", name)
        hub = names["hub"]
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for host, address in ADDRESS.items():
            ns = names[host]
            port = f"rgfw{host}{tag}p"
            _ip("link", "add", port, "netns", hub, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", hub, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        for name in names.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def _reaches(ns: str, port: int) -> bool:
    probe = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", PROBE, ADDRESS["a"], str(port)],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    return probe.returncode == 0


def _play(ns: str, tmp: Path, *args: str):
    result = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            ns,
            str(BIN / "ansible-playbook"),
            "-i",
            str(tmp / "hosts.yml"),
            str(tmp / "play.yml"),
            *args,
        ],
        cwd=ROOT,
        env=ansible_env(),
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return parse_recap(output)["a"]


def test_only_the_client_groups_reach_the_guarded_port(namespaces, tmp_path) -> None:
    inventory = {
        "all": {
            "hosts": {
                "a": {
                    "ansible_host": ADDRESS["a"],
                    "ansible_connection": "local",
                    "ansible_python_interpreter": sys.executable,
                },
                "b": {"ansible_host": ADDRESS["b"]},
                "c": {"ansible_host": ADDRESS["c"]},
            },
            "children": {
                "regen_capture": {"hosts": {"a": None}},
                "regen_train": {"hosts": {"b": None}},
                "elsewhere": {"hosts": {"c": None}},
            },
        }
    }
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory))
    play = [
        {
            "name": "Guard the capture server",
            "hosts": "a",
            "gather_facts": False,
            "roles": [
                {
                    "role": "cluster_firewall",
                    "cluster_firewall_manage_package": False,
                    "cluster_firewall_ruleset_path": str(tmp_path / "etc" / "cluster.nft"),
                    "cluster_firewall_services": [
                        {
                            "name": "capture server",
                            "ports": [GUARDED],
                            "servers": ["regen_capture"],
                            "clients": ["regen_train"],
                        },
                        {
                            "name": "transfer engine",
                            "ports": [GUARDED_RANGE],
                            "servers": ["regen_capture"],
                            "clients": ["regen_train"],
                        },
                    ],
                }
            ],
        }
    ]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play))
    a, b, c = namespaces["a"], namespaces["b"], namespaces["c"]
    # Another table of the host's own, which the role must leave alone.
    subprocess.run(["ip", "netns", "exec", a, "nft", "add", "table", "inet", "admin_own"], check=True)
    listener = subprocess.Popen(
        ["ip", "netns", "exec", a, sys.executable, "-c", LISTENER, ADDRESS["a"], *map(str, PORTS)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout.readline().strip() == "ready"
        # Before the role: every host reaches both ports (the probe can tell a refusal from a connection).
        assert _reaches(b, GUARDED) and _reaches(c, GUARDED) and _reaches(c, OPEN) and _reaches(c, IN_RANGE)

        assert _play(a, tmp_path)["changed"] >= 2  # the script written, the table loaded
        assert _reaches(b, GUARDED), "a host of regen_train must reach the capture server"
        assert not _reaches(c, GUARDED), "a host outside the client groups reached the capture server"
        assert _reaches(c, OPEN), "the table dropped a port it does not guard"
        assert _reaches(b, IN_RANGE) and not _reaches(c, IN_RANGE), "the port range is not guarded"
        tables = subprocess.run(
            ["ip", "netns", "exec", a, "nft", "list", "tables"], capture_output=True, text=True, check=True
        ).stdout
        assert "inet admin_own" in tables and "inet regen_cluster" in tables

        assert _play(a, tmp_path)["changed"] == 0
        assert _play(a, tmp_path, "--check")["changed"] == 0
        # The table lost (a reboot, someone's nft delete): the next run loads it again.
        subprocess.run(
            ["ip", "netns", "exec", a, "nft", "delete", "table", "inet", "regen_cluster"], check=True
        )
        assert _reaches(c, GUARDED)
        assert _play(a, tmp_path)["changed"] == 1
        assert not _reaches(c, GUARDED)
    finally:
        listener.kill()
        listener.wait()
