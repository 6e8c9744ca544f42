"""Run a one-process torch.distributed job (SpecForge's trainer) with every listener on one address.

    python -m regen.training.rendezvous --host 127.0.0.1 --port 29500 -- specforge.cli train --config run.yaml

Why a wrapper: SpecForge 0.2.0 trains a one-process run in its own process with an ``env://``
rendezvous on ``MASTER_ADDR=127.0.0.1`` and a random port, but torch's TCPStore server listens on every
interface (``*:<port>``) whatever ``MASTER_ADDR`` says, and gloo and NCCL listen on the interface the
host name resolves to. This module

* listens on ``--host:--port`` itself and hands that socket to the store (torch's ``master_listen_fd``),
  so the store is reachable there and nowhere else (``--port 0``: any free port);
* gives the job the whole ``env://`` contract (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
  which SpecForge then keeps instead of choosing its own, and makes the job's process group a client of
  that store (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun's agent);
* pins gloo's and NCCL's sockets to the interface that holds ``--host`` (``lo`` for loopback) unless the
  environment already names one;
* then runs the module in this process, as ``python -m MODULE ARGS`` would, and exits with its code.

Multi-process runs go through torchrun (SpecForge launches it); this covers the one-process run.
Exit code 2: the address could not be listened on (the message says which and what to change).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import runpy
import socket
import sys
from datetime import timedelta

# Kept for the life of the process: the store's server thread runs as long as this object lives.
_STORE: object | None = None
_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_of(host: str) -> str | None:
    """The network interface that holds ``host``'s address (``lo`` for loopback), None if unknown."""
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if address.is_loopback:
        names = [name for _, name in socket.if_nameindex()]
        return "lo" if "lo" in names else None
    try:
        import psutil
    except ImportError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == str(address) for a in addresses):
            return name
    return None


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port``; OSError names the address when that is impossible."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port} ({exc.strerror})") from exc
    sock.set_inheritable(False)
    return sock


def rendezvous_environment(host: str, port: int, env: dict[str, str]) -> dict[str, str]:
    """The variables a one-process ``env://`` job needs to use the store on ``host:port`` only."""
    update = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    interface = interface_of(host)
    if interface is not None:
        update.update({name: interface for name in _IFNAME_VARS if not env.get(name)})
    return update


def host_store(host: str, port: int) -> int:
    """Start the store's server on ``host:port`` in this process; return the port it listens on."""
    global _STORE
    from torch.distributed import TCPStore

    sock = listen(host, port)
    bound = sock.getsockname()[1]
    _STORE = TCPStore(
        host,
        bound,
        1,
        True,
        timedelta(minutes=30),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    # torch now owns the listening socket through its descriptor; keep the object from closing it.
    sock.detach()
    return bound


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m regen.training.rendezvous", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="the address every listener binds (default loopback)"
    )
    parser.add_argument("--port", type=int, default=29500, help="the store's port (0: any free port)")
    parser.add_argument("module", help="the module to run, after --")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    try:
        port = host_store(args.host, args.port)
    except OSError as exc:
        print(
            f"regen.training.rendezvous: {exc.strerror}: another process holds the port or the address "
            "is not this host's; set drafter_training_master_port to a free port "
            "(or drafter_training_listen_addr)",
            file=sys.stderr,
        )
        return 2
    os.environ.update(rendezvous_environment(args.host, port, dict(os.environ)))
    sys.argv = [args.module, *args.args]
    try:
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        code = done.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
