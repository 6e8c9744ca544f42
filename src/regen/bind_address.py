"""The one address policy for everything the pipeline binds: what a bind address means, by parsing it.

Model servers, the router, the Mooncake master and its metadata server, the capture server, the trainers'
rendezvous store and metrics listeners are all started with an address from the inventory. The policy:

* loopback by default;
* any other single address only when the variable that allows it is set (for a service without
  authentication of its own: Mooncake, the capture server, torch's store, also behind a firewall rule
  admitting only the pipeline's hosts, which the operator owns);
* "every interface" only when a variable says so explicitly, and recognised in every spelling a socket
  library accepts: ``0.0.0.0``, ``::``, ``[::]``, ``0``, ``0x0``, ``0.0``, ``000.0.0.0``, ``0:0::0``,
  ``::ffff:0.0.0.0``, an empty string, ``*``, and networks such as ``0.0.0.0/0`` or ``::/0``. They are
  found by parsing (``ipaddress``, and ``inet_aton``'s legacy IPv4 forms that ``bind`` accepts), never by
  comparing strings.

Standard library only, Python >= 3.8: the same file is `ansible.module_utils.regen_address` (a link to it),
which the Ansible side (`bind_address_info`) imports, so roles and jobs judge an address the same way.
"""

from __future__ import annotations

import ipaddress
import json
import socket

LOOPBACK = "loopback"
WILDCARD = "wildcard"
SPECIFIC = "specific"  # one address of this host that is not loopback
NAME = "name"  # a host name: what it binds depends on resolution (only "localhost" is judged)
INVALID = "invalid"

_WILDCARD_WORDS = {"", "*", "any", "inaddr_any"}


class BindAddressError(ValueError):
    """An address the policy refuses; the message names the variable to change."""


def _strip(text: str) -> str:
    value = str(text).strip()
    if value.startswith("[") and value.endswith("]"):
        value = value[1:-1].strip()
    return value.split("%", 1)[0]  # an IPv6 zone (fe80::1%eth0) names an interface, not an address


def classify(text) -> dict:
    """{"kind", "address" (canonical IP or None), "family" (4, 6 or None), "reason"} of a bind address."""
    raw = "" if text is None else str(text)
    value = _strip(raw)
    if value.lower() in _WILDCARD_WORDS:
        return {
            "kind": WILDCARD,
            "address": "0.0.0.0",
            "family": 4,
            "reason": f"{raw!r} means every interface",
        }
    if "/" in value:
        try:
            network = ipaddress.ip_network(value, strict=False)
        except ValueError:
            return {"kind": INVALID, "address": None, "family": None, "reason": f"{raw!r} is no address"}
        if network.prefixlen == 0 or network.network_address.is_unspecified:
            return {
                "kind": WILDCARD,
                "address": str(network.network_address),
                "family": network.version,
                "reason": f"{raw!r} is a network that covers every address",
            }
        return {
            "kind": INVALID,
            "address": None,
            "family": None,
            "reason": f"{raw!r} is a network, not one address to bind",
        }
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        address = None
    if address is None and value and all(c in "0123456789abcdefxABCDEFX." for c in value):
        # inet_aton's legacy forms (0, 0x0, 127.1, 0177.0.0.1), which bind() also accepts.
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(value))
        except OSError:
            address = None
    if address is None:
        if value.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
            return {"kind": LOOPBACK, "address": None, "family": None, "reason": f"{raw!r} names loopback"}
        if value and all(part and (part.isalnum() or "-" in part) for part in value.split(".")):
            return {"kind": NAME, "address": None, "family": None, "reason": f"{raw!r} is a host name"}
        return {"kind": INVALID, "address": None, "family": None, "reason": f"{raw!r} is no IP address"}
    mapped = getattr(address, "ipv4_mapped", None)
    judged = mapped if mapped is not None else address
    if judged.is_unspecified:
        kind = WILDCARD
    elif judged.is_loopback:
        kind = LOOPBACK
    else:
        kind = SPECIFIC
    return {"kind": kind, "address": str(address), "family": address.version, "reason": ""}


def _shown(text) -> str:
    value = "" if text is None else str(text)
    return value if value.strip() and value == value.strip() else json.dumps(value)


def is_wildcard(text) -> bool:
    return classify(text)["kind"] == WILDCARD


def is_loopback(text) -> bool:
    return classify(text)["kind"] == LOOPBACK


def local_url_host(text) -> str:
    """How a client on the same host reaches a server bound to `text` (a wildcard through loopback)."""
    info = classify(text)
    if info["kind"] == WILDCARD:
        return "[::1]" if info["family"] == 6 else "127.0.0.1"
    host = info["address"] or _strip(text)
    return f"[{host}]" if ":" in host else host


def check(
    text,
    *,
    service: str,
    variable: str,
    allow_variable: str,
    allowed: bool = False,
    specific_allowed: bool = True,
    require_ip: bool = True,
) -> dict:
    """Apply the policy to `text`, the value of `variable` for `service`: loopback passes, a host name or
    anything unparsable is refused, a wildcard (in any spelling) passes only with `allowed` (the value of
    `allow_variable`), one address of the host's own passes with `specific_allowed` (the service's cluster
    address, chosen in inventory) or `allowed`; with `require_ip` a name (even "localhost") is refused, for
    services whose flags take an IP address. Returns `classify`'s answer; raises BindAddressError."""
    info = classify(text)
    if info["kind"] in (INVALID, NAME) or (require_ip and info["address"] is None):
        raise BindAddressError(
            f"{variable} is {json.dumps(str(text))}, which is not an IPv4 or IPv6 address"
            f"{' (' + info['reason'] + ')' if info['reason'] else ''}; set it "
            f"to the address {service} is reached on (127.0.0.1 when everything runs on this host)"
        )
    if info["kind"] == LOOPBACK or (info["kind"] == SPECIFIC and specific_allowed) or allowed:
        return info
    where = (
        f"on every interface ({info['reason']})"
        if info["kind"] == WILDCARD
        else f"on {info['address']}, beyond this host"
    )
    raise BindAddressError(
        f"{variable} is {_shown(text)}, which would expose {service} (no authentication of its own) {where}; "
        f"keep it on loopback (127.0.0.1), or set {allow_variable}: true and admit only the pipeline's "
        "hosts with a firewall rule"
    )
