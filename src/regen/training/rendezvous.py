"""Run a torch.distributed job on one host (SpecForge's trainer) with every listener on one address.

    python -m regen.training.rendezvous --host 127.0.0.1 --port 29500 [--nproc N] -- specforge.cli train ...

Why a wrapper: SpecForge 0.2.0 trains a one-process run in its own process with an ``env://``
rendezvous on ``MASTER_ADDR=127.0.0.1`` and a random port, and a one-host multi-process run under
``torchrun --standalone``; either way torch's TCPStore server listens on every interface (``*:<port>``)
whatever the address says, and gloo and NCCL listen on the interface the host name resolves to. This module

* listens on ``--host:--port`` itself and hands that socket to the store (torch's ``master_listen_fd``),
  so the store is reachable there and nowhere else (``--port 0``: any free port);
* gives each rank the whole ``env://`` contract (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT), which SpecForge then follows instead of choosing its own or launching
  torchrun, and makes every rank's process group a client of that store (``TORCHELASTIC_USE_AGENT_STORE``,
  as under torchrun's agent);
* pins gloo's and NCCL's sockets to the interface that holds ``--host`` (``lo`` for loopback) unless the
  environment already names one;
* runs the module: in this process for one rank (as ``python -m MODULE ARGS`` would), else as ``--nproc``
  child processes (as torchrun would: ``OMP_NUM_THREADS=1`` unless set, signals forwarded, the first rank
  that fails stops the others and its exit code is the run's).

Multi-host runs still go through torchrun, on the address the inventory gives (drafter_training_master_addr).
Exit code 2: the address could not be listened on (the message says which and what to change).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
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


def rendezvous_environment(
    host: str, port: int, env: dict[str, str], rank: int = 0, nproc: int = 1
) -> dict[str, str]:
    """The variables rank ``rank`` of a one-host ``env://`` job needs to use the store on ``host:port``."""
    update = {
        "RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    if nproc > 1 and not env.get("OMP_NUM_THREADS"):
        update["OMP_NUM_THREADS"] = "1"  # what torchrun sets: N ranks must not each take every core
    interface = interface_of(host)
    if interface is not None:
        update.update({name: interface for name in _IFNAME_VARS if not env.get(name)})
    return update


def host_store(host: str, port: int, nproc: int = 1) -> int:
    """Start the store's server on ``host:port`` in this process; return the port it listens on."""
    global _STORE
    from torch.distributed import TCPStore

    sock = listen(host, port)
    bound = sock.getsockname()[1]
    _STORE = TCPStore(
        host,
        bound,
        nproc,
        True,
        timedelta(minutes=30),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )
    # torch now owns the listening socket through its descriptor; keep the object from closing it.
    sock.detach()
    return bound


def _run_in_process(module: str, args: list[str]) -> int:
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        code = done.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    return 0


def _run_ranks(module: str, args: list[str], host: str, port: int, nproc: int, grace: float = 30.0) -> int:
    """``nproc`` ranks as child processes; the first failure (or a signal) stops the rest."""
    base = dict(os.environ)
    children = [
        subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env={**base, **rendezvous_environment(host, port, base, rank, nproc)},
        )
        for rank in range(nproc)
    ]
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    code = 0
    while None in [child.poll() for child in children]:  # a list: poll every child, not just the first
        failed = [c.returncode for c in children if c.returncode not in (None, 0)]
        if failed:
            code = failed[0]
            break
        time.sleep(0.2)
    stopping_since = time.monotonic()
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(timeout=max(0.0, grace - (time.monotonic() - stopping_since)))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    if code == 0:
        code = next((c.returncode for c in children if c.returncode != 0), 0)
    if received and code == 0:
        code = 128 + received[0]
    return 128 - code if code < 0 else code  # a rank killed by signal N exits 128 + N, as in a shell


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m regen.training.rendezvous", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="the address every listener binds (default loopback)"
    )
    parser.add_argument("--port", type=int, default=29500, help="the store's port (0: any free port)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks on this host (1: in this process)")
    parser.add_argument("module", help="the module to run, after --")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    try:
        port = host_store(args.host, args.port, args.nproc)
    except OSError as exc:
        print(
            f"regen.training.rendezvous: {exc.strerror}: another process holds the port or the address "
            "is not this host's; set drafter_training_master_port to a free port "
            "(or drafter_training_listen_addr)",
            file=sys.stderr,
        )
        return 2
    # One line in the run's log: where the store is, so an operator can check what listens.
    print(f"regen.training.rendezvous: torch.distributed store on {args.host}:{port}", file=sys.stderr)
    sys.stderr.flush()
    if args.nproc > 1:
        return _run_ranks(args.module, args.args, args.host, port, args.nproc)
    os.environ.update(rendezvous_environment(args.host, port, dict(os.environ)))
    return _run_in_process(args.module, args.args)


if __name__ == "__main__":
    raise SystemExit(main())
