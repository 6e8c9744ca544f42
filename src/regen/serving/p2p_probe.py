"""Measure NCCL peer-to-peer on this host, and decide whether the server may use it.

    python -m regen.serving.p2p_probe --output FILE [--gpus N] [--size-mib 64] [--iters 20] [--timeout 120]

Why: on PCIe-only Blackwell workstation cards (RTX PRO 6000, sm_120) NCCL's peer-to-peer path hangs on the
first all-reduce, or returns wrong sums, unless IOMMU/ACS are off on the host (NVIDIA/nccl#1999); where it
works it is the faster path. A blanket ``NCCL_P2P_DISABLE=1`` pays for the hosts where it works, so this
measures it: an all-reduce of ``--size-mib`` over every GPU, ``--iters`` times, once with P2P allowed
(``NCCL_P2P_DISABLE=0``) and once with it off (``=1``), each in a fresh set of processes (NCCL reads the
variable once, at initialisation), each bounded by ``--timeout`` (a hang is a result, not a stall). Every
sum is checked. The decision (``decide``): P2P on when it finished, summed right and moved at least
``--min-gain`` times the bandwidth of P2P off; otherwise off, with the numbers as the reason.

The ranks run under ``regen.training.rendezvous`` (every listener on loopback). ``--backend gloo`` runs the
same measurement on CPU processes (the variable then changes nothing): that is how the tests exercise it on
a machine without GPUs.

Output (``regen.nccl_p2p/1``): ``{"schema", "fingerprint", "backend", "world_size", "size_bytes", "iters",
"modes": {"p2p_on": {...}, "p2p_off": {...}}, "decision": {"p2p": bool, "env": {...}, "reason"}}``. Each mode:
``{"ok", "busbw_gbps", "algbw_gbps", "seconds", "error"}`` (bus bandwidth as nccl-tests reports it:
2(n-1)/n x bytes / time). With ``--fingerprint`` (the roles pass the GPUs' UUIDs, the driver and torch),
an output that holds the same fingerprint is kept and nothing runs: ``{"changed": false}`` on stdout.

Exit codes: 0 measured (or up to date), whatever the decision; 2 bad arguments; 3 no GPU (or fewer than
two) for the NCCL backend; 4 crashed; 5 the output cannot be written.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from regen.fsio import atomic_write_json

SCHEMA = "regen.nccl_p2p/1"
MODES = {"p2p_on": "0", "p2p_off": "1"}
EXIT_OK, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_CRASHED, EXIT_OUTPUT = 0, 2, 3, 4, 5


# --------------------------------------------------------------------------------------------------
# Pure parts
# --------------------------------------------------------------------------------------------------


def bus_bandwidth_gbps(size_bytes: int, seconds_per_iter: float, world_size: int) -> tuple[float, float]:
    """(bus, algorithm) bandwidth in GB/s of one all-reduce, as nccl-tests defines them."""
    if seconds_per_iter <= 0 or world_size < 1:
        raise ValueError("an all-reduce takes a positive time over at least one rank")
    algbw = size_bytes / seconds_per_iter / 1e9
    return algbw * 2 * (world_size - 1) / world_size, algbw


def decide(modes: dict[str, dict[str, Any]], min_gain: float = 1.0) -> dict[str, Any]:
    """P2P on or off from the two measurements, with the numbers as the reason."""
    on, off = modes.get("p2p_on") or {}, modes.get("p2p_off") or {}
    if not on.get("ok"):
        why = on.get("error") or "it did not finish"
        if off.get("ok"):
            return {
                "p2p": False,
                "env": {"NCCL_P2P_DISABLE": "1"},
                "reason": f"NCCL peer-to-peer failed ({why}); with it off the all-reduce ran at "
                f"{off['busbw_gbps']:.1f} GB/s bus bandwidth, so the server runs with NCCL_P2P_DISABLE=1",
            }
        return {
            "p2p": False,
            "env": {"NCCL_P2P_DISABLE": "1"},
            "reason": f"NCCL all-reduce failed with peer-to-peer on ({why}) and off "
            f"({off.get('error') or 'it did not finish'}): the host's GPUs cannot all-reduce; see the "
            "server's NCCL log (NCCL_DEBUG=INFO) before serving across GPUs",
        }
    if not off.get("ok"):
        return {
            "p2p": True,
            "env": {},
            "reason": f"peer-to-peer all-reduce ran at {on['busbw_gbps']:.1f} GB/s and the run with it off "
            f"failed ({off.get('error') or 'it did not finish'}): P2P stays on",
        }
    gain = on["busbw_gbps"] / off["busbw_gbps"] if off["busbw_gbps"] > 0 else float("inf")
    numbers = (
        f"{on['busbw_gbps']:.1f} GB/s bus bandwidth with peer-to-peer, {off['busbw_gbps']:.1f} GB/s "
        f"without ({gain:.2f}x)"
    )
    if gain >= min_gain:
        return {"p2p": True, "env": {}, "reason": f"{numbers}: P2P stays on"}
    return {
        "p2p": False,
        "env": {"NCCL_P2P_DISABLE": "1"},
        "reason": f"{numbers}, below the {min_gain:.2f}x it must gain: NCCL_P2P_DISABLE=1",
    }


def up_to_date(output: Path, fingerprint: str | None) -> bool:
    """True when ``output`` already holds a measurement for ``fingerprint``."""
    if not fingerprint or not output.is_file():
        return False
    try:
        doc = json.loads(output.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("schema") == SCHEMA and doc.get("fingerprint") == fingerprint


# --------------------------------------------------------------------------------------------------
# One rank (run by regen.training.rendezvous with the env:// contract)
# --------------------------------------------------------------------------------------------------


def _rank(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.fault_injection == "hang-p2p" and os.environ.get("NCCL_P2P_DISABLE") == "0":
        time.sleep(3600)  # fault injection (tests only): what a P2P hang on sm_120 looks like from outside
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, init_method="env://", rank=rank, world_size=world)
    elements = max(1, args.size_bytes // 4)
    tensor = torch.full((elements,), float(rank + 1), dtype=torch.float32, device=device)

    def sync() -> None:
        if args.backend == "nccl":
            torch.cuda.synchronize(device)

    for _ in range(2):  # warm-up: NCCL builds its rings and channels on the first calls
        dist.all_reduce(tensor)
    sync()
    tensor.fill_(float(rank + 1))
    started = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(tensor)
    sync()
    seconds = time.perf_counter() - started
    # After k all-reduces of (rank + 1) the value is S * n^(k-1), S = n(n+1)/2: check it exactly.
    expected = world * (world + 1) / 2 * world ** (args.iters - 1)
    wrong = int((tensor != expected).sum().item())
    dist.destroy_process_group()
    if rank == 0:
        per_iter = seconds / args.iters
        busbw, algbw = bus_bandwidth_gbps(args.size_bytes, per_iter, world)
        result = {
            "ok": wrong == 0,
            "busbw_gbps": round(busbw, 3),
            "algbw_gbps": round(algbw, 3),
            "seconds": round(seconds, 6),
            "error": None if wrong == 0 else f"{wrong} of {elements} elements summed wrong",
        }
        Path(args.result).write_text(json.dumps(result), encoding="utf-8")
    return 0


# --------------------------------------------------------------------------------------------------
# The measurement
# --------------------------------------------------------------------------------------------------


def measure_mode(args: argparse.Namespace, mode: str, workdir: Path) -> dict[str, Any]:
    """One fresh set of ranks with NCCL_P2P_DISABLE set for ``mode``; a hang or a crash is a result."""
    result = workdir / f"{mode}.json"
    log = workdir / f"{mode}.log"
    argv = [
        sys.executable, "-m", "regen.training.rendezvous", "--host", "127.0.0.1", "--port", "0",
        "--nproc", str(args.gpus), "regen.serving.p2p_probe", "--rank-of-probe", "--backend", args.backend,
        "--size-bytes", str(args.size_bytes), "--iters", str(args.iters), "--result", str(result),
    ]
    if args.fault_injection:
        argv += ["--fault-injection", args.fault_injection]
    env = {**os.environ, "NCCL_P2P_DISABLE": MODES[mode]}
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"ok": False, "error": f"hung: no result after {args.timeout:g} s", "seconds": None}
    if code != 0 or not result.is_file():
        tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
        return {
            "ok": False,
            "error": f"exited {code} after {time.monotonic() - started:.1f} s: " + " | ".join(tail),
            "seconds": None,
        }
    return json.loads(result.read_text(encoding="utf-8"))


def _visible_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m regen.serving.p2p_probe", description=__doc__.split("\n")[0])
    p.add_argument("--output", type=Path, help="where the measurement (JSON) is written")
    p.add_argument("--gpus", type=int, help="ranks (default: every visible GPU; 2 for --backend gloo)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--size-mib", type=float, default=64.0, help="all-reduce size (default 64 MiB)")
    p.add_argument("--iters", type=int, default=20, help="timed all-reduces per mode (default 20)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a mode counts as hung")
    p.add_argument("--min-gain", type=float, default=1.0, help="P2P must be this much faster (default 1.0)")
    p.add_argument("--fingerprint", help="keep an output measured for this fingerprint (GPUs, driver, torch)")
    # Internal: one rank of one mode, and fault injection for the tests (named as such).
    p.add_argument("--rank-of-probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size-bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--fault-injection", choices=("hang-p2p",), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_of_probe:
        return args
    if args.output is None:
        p.error("--output is required")
    if args.iters < 1 or args.size_mib <= 0 or args.timeout <= 0 or args.min_gain <= 0:
        p.error("--iters, --size-mib, --timeout and --min-gain must be positive")
    args.size_bytes = int(args.size_mib * 1024 * 1024)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_of_probe:
        return _rank(args)
    if up_to_date(args.output, args.fingerprint):
        print(json.dumps({"changed": False, "output": str(args.output)}))
        return EXIT_OK
    if args.gpus is None:
        args.gpus = 2 if args.backend == "gloo" else _visible_gpus()
    if args.gpus < 2:
        print(
            f"p2p_probe: {args.gpus} GPU(s) visible: peer-to-peer needs at least two "
            "(with fewer, the server never all-reduces across GPUs and NCCL_P2P_DISABLE changes nothing)",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    with tempfile.TemporaryDirectory(prefix="regen-p2p-") as tmp:
        modes = {mode: measure_mode(args, mode, Path(tmp)) for mode in MODES}
    doc = {
        "schema": SCHEMA,
        "fingerprint": args.fingerprint,
        "backend": args.backend,
        "world_size": args.gpus,
        "size_bytes": args.size_bytes,
        "iters": args.iters,
        "modes": modes,
        "decision": decide(modes, args.min_gain),
    }
    try:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.output, doc)
    except OSError as exc:
        print(f"p2p_probe: cannot write {args.output}: {exc.strerror}", file=sys.stderr)
        return EXIT_OUTPUT
    print(json.dumps({"changed": True, "output": str(args.output), "decision": doc["decision"]}))
    return EXIT_OK


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # a bug: say so plainly, keep the traceback
        import traceback

        traceback.print_exc()
        print(f"p2p_probe crashed: {exc!r}", file=sys.stderr)
        sys.exit(EXIT_CRASHED)
