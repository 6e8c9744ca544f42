"""Verify the firewall stage on three real containers after `converge` (testinfra over SSH).

The Mooncake master runs on the CT200 stand-in (the first training host) bound to its address on the bridge,
because ct200-capture (group regen_capture: a capture server's host) uses it. It has no authentication of its
own, so `playbooks/firewall.yml` loaded regen's nftables table on the stand-in: its three ports admit the
training and capture hosts and drop everyone else; ct200-capture got a table of its own for its capture port
and Mooncake's transfer ports, which the trainers use. ct200-outsider is in no pipeline group.

A dropped connection times out; a port that admits the client but has no listener is refused at once. So a
port without a server still tells the two apart: the capture port on ct200-capture (no capture server runs
in this scenario) is refused for the trainer and times out for the outsider.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
import testinfra

INVENTORY = Path(os.environ.get("MOLECULE_INVENTORY_FILE", "/nonexistent"))
CAPTURE = "ct200-capture"
OUTSIDER = "ct200-outsider"
TABLE = "regen_cluster"  # cluster_firewall_table's default
MASTER_PORTS = {"rpc": 50051, "http metadata": 8080, "metrics": 9003}  # mooncake_master's defaults
CAPTURE_PORT = 30200  # drafter_training_online_capture_port's default
TRANSFER_PORT = 15500  # inside drafter_training_online_mooncake_transfer_ports (15000-17000)

# Prints open, refused or dropped (no answer within the timeout: what nftables' drop looks like).
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("open")
except ConnectionRefusedError:
    print("refused")
except (socket.timeout, TimeoutError):
    print("dropped")
"""


def _other(name: str):
    return testinfra.get_host(f"ansible://{name}?ansible_inventory={INVENTORY.parent}")


def _address(host) -> str:
    return host.ansible.get_variables()["ansible_host"]


def _connect(client, address: str, port: int, timeout: float = 3.0) -> str:
    return client.check_output(
        f"python3 -c {shlex.quote(CONNECT)} {shlex.quote(address)} {port} {timeout}"
    ).strip()


@pytest.fixture(scope="module")
def capture():
    return _other(CAPTURE)


@pytest.fixture(scope="module")
def outsider():
    return _other(OUTSIDER)


def test_the_capture_host_reaches_every_port_of_the_master(host, capture) -> None:
    master = _address(host)
    reached = {what: _connect(capture, master, port) for what, port in MASTER_PORTS.items()}
    assert reached == dict.fromkeys(MASTER_PORTS, "open"), reached


def test_a_host_of_no_pipeline_group_cannot_connect_to_the_master(host, outsider) -> None:
    master = _address(host)
    reached = {what: _connect(outsider, master, port) for what, port in MASTER_PORTS.items()}
    assert reached == dict.fromkeys(MASTER_PORTS, "dropped"), reached
    # Only the guarded ports: the outsider is on the bridge and reaches the stand-in's SSH.
    assert _connect(outsider, master, 22) == "open"


def test_the_capture_hosts_own_ports_admit_the_trainer_and_drop_the_outsider(host, capture, outsider) -> None:
    target = _address(capture)
    # Nothing listens on them here: admitted means refused at once, kept out means no answer.
    assert _connect(host, target, CAPTURE_PORT) == "refused"
    assert _connect(host, target, TRANSFER_PORT) == "refused"
    assert _connect(outsider, target, CAPTURE_PORT) == "dropped"
    assert _connect(outsider, target, TRANSFER_PORT) == "dropped"


def test_each_table_admits_the_addresses_of_the_users_and_no_other(host, capture, outsider) -> None:
    on_master = host.check_output(f"nft list table inet {TABLE}")
    on_capture = capture.check_output(f"nft list table inet {TABLE}")
    assert _address(capture) in on_master and _address(outsider) not in on_master, on_master
    assert _address(host) in on_capture and _address(outsider) not in on_capture, on_capture
    # The outsider serves nothing the pipeline uses: the stage gave it no table.
    assert not outsider.file("/etc/regen/cluster-firewall.nft").exists  # cluster_firewall_ruleset_path
