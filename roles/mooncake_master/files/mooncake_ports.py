#!/usr/bin/env python3
"""Who holds the Mooncake master's ports, and where the master's own processes listen.

Run by the mooncake_master role on the host (ansible.builtin.script) with one JSON argument:

    {"host": "127.0.0.1",
     "ports": [{"port": 50051, "variable": "mooncake_master_rpc_port", "what": "RPC"}, ...],
     "own_pids": [1234]}

and prints one JSON object:

    {"ports": [{"port", "variable", "what", "free", "ours", "owners": [{"pid", "name", "cmdline",
                "address"}]}],
     "listeners": [{"pid", "name", "address", "port"}],   # every listening TCP socket of own_pids
     "changed": false}

A port is free when a socket can be bound to (host, port) now. When it cannot, the owners are the
processes with a listening socket on that port whose address overlaps the host (the same address, or
a wildcard on either side), found the way `ss -ltnp` finds them: /proc/net/tcp{,6} for the socket
inode, /proc/<pid>/fd for the process. `ours` is true when every owner is one of own_pids (the running
master keeps its port). Standard library only, Python >= 3.7: it runs with whatever python3 the host has.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys

_LISTEN = "0A"
_WILDCARDS = {"0.0.0.0", "::"}


def _decode(hex_address: str) -> tuple[str, int]:
    """'0100007F:C383' (or the 32-hex-digit IPv6 form) -> ('127.0.0.1', 50051)."""
    raw_host, raw_port = hex_address.split(":")
    port = int(raw_port, 16)
    packed = bytes.fromhex(raw_host)
    if len(packed) == 4:
        return socket.inet_ntop(socket.AF_INET, packed[::-1]), port
    # /proc prints IPv6 addresses as four little-endian 32-bit words.
    words = b"".join(packed[i : i + 4][::-1] for i in range(0, 16, 4))
    address = ipaddress.IPv6Address(words)
    mapped = address.ipv4_mapped
    return (str(mapped) if mapped else str(address)), port


def listening_sockets() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket in this network namespace."""
    sockets = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == _LISTEN:
                sockets[int(fields[9])] = _decode(fields[1])
    return sockets


def _process(pid: int) -> tuple[str, str]:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as handle:
            name = handle.read().strip()
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            cmdline = " ".join(p.decode("utf-8", "replace") for p in handle.read().split(b"\0") if p)
    except OSError:
        return "?", ""
    return name, cmdline


def socket_owners(inodes: set[int]) -> dict[int, list[int]]:
    """inode -> pids that hold it open (needs root to see other users' processes)."""
    owners: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fd_dir = f"/proc/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in inodes and int(entry) not in owners.setdefault(inode, []):
                    owners[inode].append(int(entry))
    return owners


def overlaps(host: str, address: str) -> bool:
    """Would binding `host` clash with a listener on `address` (same port)? Wildcards clash with all."""
    return host in _WILDCARDS or address in _WILDCARDS or host == address


def bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Like a server does: a port whose last connection is in TIME_WAIT is free to bind.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def inspect(request: dict) -> dict:
    host = str(request["host"])
    own = {int(p) for p in request.get("own_pids") or [] if int(p) > 0}
    sockets = listening_sockets()
    owners = socket_owners(set(sockets))
    ports = []
    for item in request.get("ports") or []:
        port = int(item["port"])
        free = bindable(host, port)
        holders = []
        if not free:
            for inode, (address, listen_port) in sorted(sockets.items()):
                if listen_port != port or not overlaps(host, address):
                    continue
                for pid in owners.get(inode, []):
                    name, cmdline = _process(pid)
                    holders.append({"pid": pid, "name": name, "cmdline": cmdline, "address": address})
        ours = bool(holders) and all(h["pid"] in own for h in holders)
        ports.append({**item, "port": port, "free": free, "ours": ours, "owners": holders})
    listeners = []
    for inode, (address, port) in sorted(sockets.items(), key=lambda kv: kv[1][1]):
        for pid in owners.get(inode, []):
            if pid in own:
                listeners.append({"pid": pid, "name": _process(pid)[0], "address": address, "port": port})
    return {"ports": ports, "listeners": listeners, "changed": False}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(json.dumps({"failed": True, "msg": "usage: mooncake_ports.py '<json request>'"}))
        return 2
    try:
        request = json.loads(argv[1])
        print(json.dumps(inspect(request), sort_keys=True))
    except (ValueError, KeyError, TypeError) as exc:
        print(json.dumps({"failed": True, "msg": f"bad request: {exc}"}))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
