"""Which hosts may reach the pipeline's unauthenticated services, and the nftables table that says so.

The capture server, Mooncake's master and metadata server and torch's rendezvous store have no
authentication of their own. When the inventory puts a service and its users on different hosts, the
service must listen on a cluster address, and this host's own nftables table admits, on those TCP ports
(or port ranges, for Mooncake's transfer engine, which picks its listeners from one),
only the addresses of the inventory hosts in the groups that use it; everything else is dropped for those
ports. The table is regen's alone (``inet regen_cluster`` by default): it is replaced as a whole and never
touches the host's other tables. A drop in any base chain is final in nftables, so this table only ever
narrows what the host's own rules admit; it never opens a port they close.

Pure functions; ``library/cluster_firewall_info.py`` wraps them.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import re

TABLE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")


class FirewallPlanError(ValueError):
    """An input the rules cannot be derived from; the message names the variable to fix."""


def _members(name, groups, all_hosts):
    """The hosts a service entry names: a group's hosts, or one host of the inventory."""
    if name in groups:
        return list(groups[name])
    if name in all_hosts:
        return [name]
    raise FirewallPlanError(
        f"cluster_firewall_services names {name!r}, which is neither an inventory group nor a host"
    )


def host_address(host, overrides, inventory_addresses):
    """The IP address other hosts' packets carry from `host`.

    cluster_firewall_addresses[host] first (a cluster network beside the management one), then the host's
    ansible_host, then its inventory name. It must be an IP literal: a name would be resolved by nft once,
    at load time, silently."""
    given = overrides.get(host) or inventory_addresses.get(host) or host
    try:
        return ipaddress.ip_address(str(given).strip("[]"))
    except ValueError:
        raise FirewallPlanError(
            f"host {host} has no IP address ({given!r} is not one): set ansible_host to its cluster "
            f"address or cluster_firewall_addresses['{host}']"
        ) from None


def _port(service, value):
    """One entry of a service's ports: a port (22) or a range ("15000-17000"), as (first, last)."""
    first, sep, last = str(value).strip().partition("-")
    try:
        bounds = [int(first), int(last)] if sep else [int(first)]
    except ValueError:
        bounds = [0]
    if isinstance(value, bool) or not all(0 < b < 65536 for b in bounds) or bounds != sorted(bounds):
        raise FirewallPlanError(
            f"cluster_firewall_services entry {service!r} has port {value!r}: a TCP port is 1-65535, a "
            "range is written first-last"
        )
    return bounds[0], bounds[-1]


def _port_text(span):
    """A port as an int, a range as "first-last" (nft's syntax for both)."""
    first, last = span
    return first if first == last else f"{first}-{last}"


def guarded_services(services, groups, host, overrides=None, inventory_addresses=None):
    """The services `host` serves that users on other hosts reach, each with the sources it admits.

    `services`: entries {name, ports, servers, clients[, guard]}; servers/clients are inventory group or
    host names. A service whose users are all on `host` itself needs no rule (it listens on loopback),
    unless its `guard` is "always": a service that listens on every interface whatever it is told
    (Mooncake's transfer engine) is then closed to every other host. The admitted sources are the users'
    addresses plus this host's own (a process here may use the cluster address); loopback is admitted by
    the table as a whole."""
    overrides = overrides or {}
    inventory_addresses = inventory_addresses or {}
    all_hosts = set(groups.get("all", []))
    for members in groups.values():
        all_hosts.update(members)
    rules = []
    seen_ports = {}
    for service in services:
        name = service.get("name")
        if not name:
            raise FirewallPlanError("every cluster_firewall_services entry needs a name")
        ports = sorted({_port(name, p) for p in service.get("ports") or []})
        if not ports:
            raise FirewallPlanError(f"cluster_firewall_services entry {name!r} lists no ports")
        servers = {h for g in service.get("servers") or [] for h in _members(g, groups, all_hosts)}
        clients = {h for g in service.get("clients") or [] for h in _members(g, groups, all_hosts)}
        guard = service.get("guard") or "shared"
        if guard not in ("shared", "always"):
            raise FirewallPlanError(
                f"cluster_firewall_services entry {name!r} has guard {guard!r}: shared (only where users are "
                "on other hosts) or always"
            )
        if host not in servers:
            continue
        remote = sorted(clients - {host})
        if not remote and guard != "always":
            continue
        for span in ports:
            for other, owner in seen_ports.items():
                if owner != name and span[0] <= other[1] and other[0] <= span[1]:
                    raise FirewallPlanError(
                        f"port {_port_text(span)} of {name!r} overlaps port {_port_text(other)} of "
                        f"{owner!r} in cluster_firewall_services: each service needs ports of its own"
                    )
            seen_ports[span] = name
        sources = {host_address(h, overrides, inventory_addresses) for h in remote}
        # This host without a cluster address: its own processes use loopback, admitted anyway.
        with contextlib.suppress(FirewallPlanError):
            sources.add(host_address(host, overrides, inventory_addresses))
        rules.append(
            {
                "name": name,
                "ports": [_port_text(span) for span in ports],
                "clients": remote,
                "ipv4": sorted(str(a) for a in sources if a.version == 4),
                "ipv6": sorted(str(a) for a in sources if a.version == 6),
            }
        )
    return sorted(rules, key=lambda r: r["name"])


def _set(items):
    return "{ " + ", ".join(str(i) for i in items) + " }"


def render_ruleset(table, rules):
    """The nft script that replaces table `inet <table>` as a whole (one atomic transaction).

    The first two lines create the table if absent and delete it, so a re-load never duplicates rules
    and nothing outside the table is touched. The chain's comment carries the digest of the body, which
    the role compares with the live table to decide whether to load."""
    if not TABLE_NAME.match(table or ""):
        raise FirewallPlanError(f"cluster_firewall_table {table!r} is not an nftables table name")
    lines = []
    for rule in rules:
        ports = _set(rule["ports"])
        lines.append(f"    # {rule['name']}: {', '.join(rule['clients']) or 'this host only'}")
        if rule["ipv4"]:
            lines.append(f"    tcp dport {ports} ip saddr {_set(rule['ipv4'])} accept")
        if rule["ipv6"]:
            lines.append(f"    tcp dport {ports} ip6 saddr {_set(rule['ipv6'])} accept")
        lines.append(f"    tcp dport {ports} counter drop")
    body = "\n".join(lines)
    digest = hashlib.sha256(f"{table}\n{body}".encode()).hexdigest()[:16]
    script = (
        f"table inet {table}\n"
        f"delete table inet {table}\n"
        f"table inet {table} {{\n"
        "  chain input {\n"
        f'    comment "regen {digest}"\n'
        "    type filter hook input priority filter; policy accept;\n"
        '    iif "lo" accept\n'
        f"{body}\n"
        "  }\n"
        "}\n"
    )
    return script, digest


def _admitted(rule):
    """Who a rule admits, as the summary says it: its client hosts and their addresses, or this host only."""
    addresses = rule["ipv4"] + rule["ipv6"]
    if rule["clients"]:
        return f"{', '.join(rule['clients'])} ({', '.join(addresses)})"
    return f"this host only ({', '.join(['loopback', *addresses])})"


def firewall_plan(services, groups, host, table, overrides=None, inventory_addresses=None):
    """Everything the role needs: the guarded services, whether a table is needed, its script and digest."""
    rules = guarded_services(services, groups, host, overrides, inventory_addresses)
    script, digest = render_ruleset(table, rules)
    summary = [
        f"{r['name']} (TCP {', '.join(map(str, r['ports']))}): admits {_admitted(r)}, drops the rest"
        for r in rules
    ]
    return {
        "needed": bool(rules),
        "rules": rules,
        "summary": summary or ["no service here has users on other hosts: nothing to guard"],
        "ruleset": script if rules else "",
        "digest": digest,
    }
