"""Addresses and URLs, as the modules and the regen package both judge them (standard library only;
shared as module_utils/__init__.py describes): is a host loopback, and a URL fit to show.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit, urlunsplit


def is_loopback(host):
    """True for addresses that only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
