"""The NCCL P2P probe run for real: ranks under regen.training.rendezvous on CPU (gloo), a hang bounded.

The P2P-on mode is made to hang by the probe's fault injection (`--fault-injection hang-p2p`, tests only):
that is what a P2P hang on PCIe Blackwell looks like from outside, and the timeout must turn it into a
decision instead of a stall. The P2P-off mode runs a real all-reduce whose sums are checked. (~30 s)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


def _probe(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "regen.serving.p2p_probe", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )


def test_a_hanging_p2p_mode_is_timed_out_and_turned_off(tmp_path: Path) -> None:
    output = tmp_path / "facts" / "nccl_p2p.json"
    started = time.monotonic()
    run = _probe(
        "--backend", "gloo", "--gpus", "2", "--output", str(output), "--size-mib", "1", "--iters", "3",
        "--timeout", "25", "--fingerprint", "fp-1", "--fault-injection", "hang-p2p",
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(output.read_text())
    assert doc["schema"] == "regen.nccl_p2p/1" and doc["world_size"] == 2 and doc["fingerprint"] == "fp-1"
    assert doc["modes"]["p2p_on"] == {"ok": False, "error": "hung: no result after 25 s", "seconds": None}
    off = doc["modes"]["p2p_off"]
    assert off["ok"] is True and off["error"] is None and off["busbw_gbps"] > 0
    assert doc["decision"]["p2p"] is False and doc["decision"]["env"] == {"NCCL_P2P_DISABLE": "1"}
    assert json.loads(run.stdout)["decision"] == doc["decision"]
    # The hung ranks were killed with their process group: nothing of them is left running.
    pattern = "regen-p2p-.*p2p_on.json"
    left = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True, check=False)
    assert left.stdout == "", left.stdout
    assert time.monotonic() - started < 200

    # Same fingerprint: kept, nothing runs; another fingerprint would measure again.
    again = _probe("--backend", "gloo", "--output", str(output), "--fingerprint", "fp-1")
    assert again.returncode == 0 and json.loads(again.stdout) == {"changed": False, "output": str(output)}


def test_too_few_gpus_is_a_clear_refusal(tmp_path: Path) -> None:
    run = _probe("--backend", "gloo", "--gpus", "1", "--output", str(tmp_path / "p.json"))
    assert run.returncode == 3
    assert "peer-to-peer needs at least two" in run.stderr
    assert not (tmp_path / "p.json").exists()
