"""The sources admitted to the pipeline's unauthenticated services (module_utils/regen_cluster_firewall.py,
library/cluster_firewall_info.py): derived from the inventory's groups, only where users are elsewhere."""

from __future__ import annotations

import pytest
from ansible.module_utils.regen_cluster_firewall import (
    FirewallPlanError,
    firewall_plan,
    guarded_services,
    render_ruleset,
)

from tests.helpers.modules import run_module

GROUPS = {
    "all": ["serve1", "train1", "train2", "outsider"],
    "regen_serve": ["serve1"],
    "regen_train": ["train1", "train2"],
}
ADDRESSES = {
    "serve1": "192.0.2.10",
    "train1": "192.0.2.21",
    "train2": "2001:db8::22",
    "outsider": "192.0.2.99",
}
CAPTURE = {"name": "capture server", "ports": [30200], "servers": ["regen_serve"], "clients": ["regen_train"]}
MOONCAKE = {
    "name": "mooncake master",
    "ports": [8080, 50051],
    "servers": ["train1"],
    "clients": ["regen_train", "regen_serve"],
}


def test_a_service_admits_the_hosts_of_its_client_groups_and_its_own_host() -> None:
    [rule] = guarded_services([CAPTURE, MOONCAKE], GROUPS, "serve1", inventory_addresses=ADDRESSES)
    assert rule["name"] == "capture server"
    assert rule["clients"] == ["train1", "train2"]
    assert rule["ipv4"] == ["192.0.2.10", "192.0.2.21"]
    assert rule["ipv6"] == ["2001:db8::22"]
    assert "192.0.2.99" not in rule["ipv4"]


def test_a_host_serves_only_its_own_services() -> None:
    [rule] = guarded_services([CAPTURE, MOONCAKE], GROUPS, "train1", inventory_addresses=ADDRESSES)
    assert rule["name"] == "mooncake master"
    assert rule["ports"] == [8080, 50051]
    assert rule["clients"] == ["serve1", "train2"]
    assert guarded_services([CAPTURE, MOONCAKE], GROUPS, "outsider", inventory_addresses=ADDRESSES) == []


def test_every_user_on_the_service_host_needs_no_rule_and_no_address() -> None:
    groups = {"all": ["localhost"], "regen_serve": ["localhost"], "regen_train": ["localhost"]}
    services = [CAPTURE, MOONCAKE | {"servers": ["localhost"]}]
    plan = firewall_plan(services, groups, "localhost", "regen_cluster")
    assert plan["needed"] is False
    assert plan["rules"] == [] and plan["ruleset"] == ""


def test_cluster_addresses_override_ansible_host() -> None:
    [rule] = guarded_services(
        [CAPTURE], GROUPS, "serve1", overrides={"train1": "10.9.0.21"}, inventory_addresses=ADDRESSES
    )
    assert "10.9.0.21" in rule["ipv4"] and "192.0.2.21" not in rule["ipv4"]


def test_a_client_without_an_ip_address_is_refused_naming_the_variables() -> None:
    expected = r"train1 .*ansible_host.*cluster_firewall_addresses\['train1'\]"
    with pytest.raises(FirewallPlanError, match=expected):
        guarded_services([CAPTURE], GROUPS, "serve1", inventory_addresses={"train1": "gpu-a.example"})


@pytest.mark.parametrize(
    ("service", "message"),
    [
        (CAPTURE | {"servers": ["regen_nowhere"]}, "neither an inventory group nor a host"),
        (CAPTURE | {"ports": []}, "lists no ports"),
        (CAPTURE | {"ports": [70000]}, "a TCP port is 1-65535"),
        (CAPTURE | {"ports": ["x"]}, "a TCP port is 1-65535"),
        ({k: v for k, v in CAPTURE.items() if k != "name"}, "needs a name"),
    ],
)
def test_malformed_services_are_refused(service, message) -> None:
    with pytest.raises(FirewallPlanError, match=message):
        guarded_services([service], GROUPS, "serve1", inventory_addresses=ADDRESSES)


def test_two_services_on_one_port_are_refused() -> None:
    other = CAPTURE | {"name": "store"}
    expected = "port 30200 of 'store' overlaps port 30200 of 'capture server'"
    with pytest.raises(FirewallPlanError, match=expected):
        guarded_services([CAPTURE, other], GROUPS, "serve1", inventory_addresses=ADDRESSES)


TRANSFER = {"name": "transfer engine", "ports": ["15000-17000"], "servers": ["regen_serve"],
            "clients": ["regen_train"]}  # fmt: skip


def test_a_port_range_is_guarded_as_one_nft_interval() -> None:
    rules = guarded_services([CAPTURE, TRANSFER], GROUPS, "serve1", inventory_addresses=ADDRESSES)
    assert [r["ports"] for r in rules] == [[30200], ["15000-17000"]]
    script, _ = render_ruleset("regen_cluster", rules)
    assert "    tcp dport { 15000-17000 } counter drop" in script.splitlines()


@pytest.mark.parametrize(
    ("ports", "message"),
    [
        (["17000-15000"], "a range is written first-last"),
        (["15000-70000"], "a TCP port is 1-65535"),
        (["15000-"], "a TCP port is 1-65535"),
        (["16000", "30000-30300"], "overlaps port 30200 of 'capture server'"),
    ],
)
def test_a_range_that_is_not_one_or_overlaps_another_service_is_refused(ports, message) -> None:
    with pytest.raises(FirewallPlanError, match=message):
        services = [CAPTURE, TRANSFER | {"ports": ports}]
        guarded_services(services, GROUPS, "serve1", inventory_addresses=ADDRESSES)


def test_the_ruleset_replaces_only_its_own_table_and_drops_the_rest_of_the_ports() -> None:
    rules = guarded_services([CAPTURE], GROUPS, "serve1", inventory_addresses=ADDRESSES)
    script, digest = render_ruleset("regen_cluster", rules)
    lines = script.splitlines()
    assert lines[:3] == [
        "table inet regen_cluster",
        "delete table inet regen_cluster",
        "table inet regen_cluster {",
    ]
    assert "flush ruleset" not in script
    assert f'comment "regen {digest}"' in script
    assert "tcp dport { 30200 } ip saddr { 192.0.2.10, 192.0.2.21 } accept" in script
    assert "tcp dport { 30200 } ip6 saddr { 2001:db8::22 } accept" in script
    assert script.index("accept\n    tcp dport { 30200 } counter drop") > 0
    # Same rules, same digest; other rules, another one (the role reloads only then).
    assert render_ruleset("regen_cluster", rules)[1] == digest
    assert render_ruleset("regen_cluster", [dict(rules[0], ipv4=["192.0.2.10"])])[1] != digest


def test_a_table_name_nft_would_misread_is_refused() -> None:
    with pytest.raises(FirewallPlanError, match="cluster_firewall_table"):
        render_ruleset("regen; flush ruleset", [])


def test_module_returns_the_plan_and_fails_with_the_message(capsys) -> None:
    args = {
        "services": [CAPTURE],
        "groups": GROUPS,
        "host": "serve1",
        "table": "regen_cluster",
        "inventory_addresses": ADDRESSES,
    }
    result = run_module("cluster_firewall_info", args, capsys)
    assert result["needed"] is True and result["changed"] is False
    assert result["rules"][0]["clients"] == ["train1", "train2"]
    failed = run_module("cluster_firewall_info", dict(args, inventory_addresses={}), capsys)
    assert failed["failed"] is True and "has no IP address" in failed["msg"]


def test_a_service_guarded_always_is_closed_to_other_hosts_even_with_only_local_users() -> None:
    alone = {"name": "transfer engine", "ports": ["21000-21999"], "servers": ["regen_train"],
             "clients": ["regen_train"]}  # fmt: skip
    groups = {"all": ["ct200"], "regen_train": ["ct200"]}
    assert guarded_services([alone], groups, "ct200") == []  # shared (the default): nothing to guard
    plan = firewall_plan([alone | {"guard": "always"}], groups, "ct200", "regen_online")
    assert plan["needed"] and plan["rules"][0]["clients"] == []
    (summary,) = plan["summary"]
    assert summary == "transfer engine (TCP 21000-21999): admits this host only (loopback), drops the rest"
    lines = plan["ruleset"].splitlines()
    assert '    iif "lo" accept' in lines and "    tcp dport { 21000-21999 } counter drop" in lines
    assert not [line for line in lines if "saddr" in line]
    with pytest.raises(FirewallPlanError, match="guard 'sometimes'"):
        guarded_services([alone | {"guard": "sometimes"}], groups, "ct200")
