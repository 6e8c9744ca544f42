"""The stage `firewall` (playbooks/firewall.yml) derives, from the inventory, which hosts each unauthenticated
service admits: the two-host CT200 example guards CT200's capture server for train1, train1's Mooncake
master for CT200, and Mooncake's transfer-engine port range on both for the other; the embedded one-host
default guards nothing. Check mode, every host run locally
(ansible_connection=local from the command line), so nothing connects anywhere."""

from __future__ import annotations

import sys

from tests.helpers.ansible import ansible_env, run_playbook

LOCAL = ("-e", "ansible_connection=local", "-e", f"ansible_python_interpreter={sys.executable}")


def _messages(output: str, host: str) -> str:
    """The output lines of the debug task for `host`."""
    marker = f"ok: [{host}] => "
    start = output.index("TASK [cluster_firewall : Show the admitted sources]")
    section = output[start:].split("TASK [", 2)[1]
    return section[section.index(marker) :].split("\nok: [", 1)[0]


def test_the_two_host_example_admits_each_service_only_to_its_users() -> None:
    run = run_playbook(
        "playbooks/firewall.yml",
        "--check",
        *LOCAL,
        inventory="inventory/production-two-hosts.example",
        env=ansible_env(ANSIBLE_CALLBACK_RESULT_FORMAT="json"),
        timeout=300,
    )
    assert run.returncode == 0, run.output[-4000:]
    ct200, train1 = _messages(run.output, "ct200"), _messages(run.output, "train1")
    assert "capture server (TCP 30200): admits train1 (10.1.2.200, 10.1.2.201), drops the rest" in ct200
    assert "Mooncake master" not in ct200 and "rendezvous" not in ct200
    assert (
        "Mooncake master (RPC, HTTP metadata, metrics) (TCP 8080, 9003, 50051): admits ct200 "
        "(10.1.2.200, 10.1.2.201), drops the rest" in train1
    )
    # Mooncake's transfer engine listens on both hosts, for the other: its whole port range is guarded.
    for here, there in ((ct200, "train1"), (train1, "ct200")):
        assert (
            f"Mooncake transfer engine (handshake RPC, TCP data) (TCP 15000-17000): admits {there} "
            "(10.1.2.200, 10.1.2.201), drops the rest" in here
        ), here
    # One trainer host: its rendezvous store has no user elsewhere.
    assert "rendezvous" not in train1 and "capture server" not in train1
    assert run.counts("ct200")["failed"] == 0 and run.counts("train1")["failed"] == 0


def test_the_embedded_one_host_inventory_guards_nothing() -> None:
    run = run_playbook("playbooks/firewall.yml", "--check", timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    assert "nothing to guard" in _messages(run.output, "localhost")
    assert run.counts()["changed"] == 0
