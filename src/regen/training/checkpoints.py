"""SpecForge checkpoints of one run: list them, pick the one to resume from.

SpecForge 0.2.0 (training/checkpoint.py) writes `<output_dir>/<run_id>-step<N>/training_state.pt` (rank 0,
atomically) plus one `training_state_rank<r>.pt` per rank, then points `<run_id>-latest` at it. A step
directory without `training_state.pt` is a save that a crash interrupted: it is listed as incomplete and
never resumed from.

    python -m regen.training.checkpoints --output-dir DIR --run-id ID   # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

STATE_FILE = "training_state.pt"


def list_checkpoints(output_dir: str | Path, run_id: str) -> list[dict[str, Any]]:
    """Every step directory of `run_id`, oldest first, with its completeness and size."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    pattern = re.compile(rf"^{re.escape(run_id)}-step(\d+)$")
    found = []
    for entry in root.iterdir():
        match = pattern.match(entry.name)
        if not match or not entry.is_dir() or entry.is_symlink():
            continue
        files = [f for f in entry.iterdir() if f.is_file()]
        found.append(
            {
                "step": int(match.group(1)),
                "path": str(entry),
                "complete": (entry / STATE_FILE).is_file(),
                "bytes": sum(f.stat().st_size for f in files),
                "files": sorted(f.name for f in files),
            }
        )
    return sorted(found, key=lambda item: item["step"])


def latest_checkpoint(output_dir: str | Path, run_id: str) -> dict[str, Any] | None:
    """The newest complete checkpoint: SpecForge's `<run_id>-latest` pointer when valid, else the highest
    complete step."""
    checkpoints = [c for c in list_checkpoints(output_dir, run_id) if c["complete"]]
    link = Path(output_dir) / f"{run_id}-latest"
    if link.is_symlink():
        target = os.path.realpath(link)
        for checkpoint in checkpoints:
            if os.path.realpath(checkpoint["path"]) == target:
                return checkpoint
    return checkpoints[-1] if checkpoints else None


def describe(output_dir: str | Path, run_id: str) -> dict[str, Any]:
    checkpoints = list_checkpoints(output_dir, run_id)
    latest = latest_checkpoint(output_dir, run_id)
    return {
        "output_dir": str(output_dir),
        "run_id": run_id,
        "checkpoints": checkpoints,
        "latest": latest,
        "resume_from": latest["path"] if latest else None,
        "incomplete": [c["path"] for c in checkpoints if not c["complete"]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m regen.training.checkpoints", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--output-dir", required=True, help="SpecForge's output_dir of the run")
    parser.add_argument("--run-id", required=True, help="SpecForge's run_id")
    args = parser.parse_args(argv)
    json.dump(describe(args.output_dir, args.run_id), sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
