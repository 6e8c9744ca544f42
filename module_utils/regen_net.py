"""Addresses and URLs, as the modules and the regen package both judge them (standard library only;
shared as module_utils/__init__.py describes): is a host loopback or one of this machine's own addresses,
and a URL fit to show.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit, urlunsplit


def is_loopback(host):
    """True for addresses that only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_own_address(host):
    """True for loopback and for an IP address assigned to one of this machine's interfaces.

    Asked of the kernel itself: binding a socket to an address (port 0, nothing listens) succeeds only
    where the address is this machine's (EADDRNOTAVAIL otherwise). A name is not resolved: only loopback
    names count.
    """
    if is_loopback(host):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if address.is_unspecified or address.is_multicast:
        return False
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(address), 0))
    except OSError:
        return False
    return True


def redact_url(url):
    """The URL as it may be shown or stored: a password (or a lone user token) in it becomes `***`."""
    try:
        parts = urlsplit(url or "")
    except ValueError:
        return url
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None:
        host += f":{parts.port}"
    user = f"{parts.username}:***" if parts.password is not None else "***"
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))
