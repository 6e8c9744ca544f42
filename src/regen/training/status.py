"""Progress of a SpecForge run, read from its log: step, loss, acceptance proxy, ETA.

SpecForge 0.2.0's trainer prints one line per logged optimizer step on rank 0:

    step 3: {'acc': 0.41, 'loss': 2.53, 'grad_norm': 1.4, 'lr': 0.0006, 'perf/optimizer_step_time_s': 0.4}

(a Python dict literal). `acc` is the drafter's per-token accuracy on the supervised block positions: the
acceptance proxy. The status document is what the role reads and what `regen` shows; it is rewritten
atomically, so a reader never sees half of it.
"""

from __future__ import annotations

import ast
import json
import math
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from regen.fsio import atomic_write_json
from regen.status import Status

STEP_LINE = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?step (?P<step>\d+): (?P<metrics>\{.*\})\s*$")
# Lines that name why a run failed; the last one seen is reported.
ERROR_LINE = re.compile(
    r"^\s*(?:\[rank\d+\]:\s*)?(?P<error>(?:[A-Za-z_.]*Error|Exception|RuntimeError)(?::.*)?)$"
)
# The states a training reports (a subset of `regen.status.STATES`); "lost" is the launcher's
# verdict on a supervisor that vanished, which a later look may still revise.
STATES = ("starting", "running", "succeeded", "failed", "stopped", "lost")
FINAL_STATES = ("succeeded", "failed", "stopped")


def parse_step_line(line: str) -> tuple[int, dict[str, float]] | None:
    """`(step, metrics)` for a SpecForge step line, None for any other line."""
    match = STEP_LINE.match(line)
    if not match:
        return None
    try:
        metrics = ast.literal_eval(match["metrics"])
    except (ValueError, SyntaxError):
        return None
    if not isinstance(metrics, dict):
        return None
    clean = {
        str(k): float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return int(match["step"]), clean


def new_status(total_steps: int | None = None, **extra: Any) -> dict[str, Any]:
    """A training status document (`regen.status`: `done`/`total` count optimizer steps, `pid` is
    the supervisor's) with SpecForge's metrics beside the schema's keys, and the launcher's `extra`."""
    now = time.time()
    doc = Status(job="train", state="starting", item="step", line="", done=0, total=total_steps, pid=None)
    return {
        **doc.document(
            loss=None, acc=None, lr=None, grad_norm=None, step_time_s=None, started_at=now, log_lines=0
        ),
        **extra,
    }


# The loss of one step swings widely (0.3 to 2.5 on the demo); the summary reports an exponential moving
# average over about this many steps (bias-corrected, so the first steps are not pulled towards 0), and
# plots the curve from at most LOSS_CURVE_POINTS (step, loss) pairs (halved by dropping every other one
# when full, so a long run keeps an even sample of its whole length).
LOSS_SMOOTHING_STEPS = 20
LOSS_CURVE_POINTS = 400


def _fold_loss(status: dict[str, Any], step: int, loss: Any) -> None:
    if not isinstance(loss, int | float) or isinstance(loss, bool) or loss != loss:
        return
    beta = 1.0 - 2.0 / (LOSS_SMOOTHING_STEPS + 1)
    count = int(status.get("loss_count") or 0) + 1
    raw = beta * float(status.get("loss_ema_raw") or 0.0) + (1.0 - beta) * float(loss)
    status["loss_count"] = count
    status["loss_ema_raw"] = raw
    status["loss_smoothed"] = raw / (1.0 - beta**count)
    status["loss_smoothing_steps"] = LOSS_SMOOTHING_STEPS
    curve = status.setdefault("loss_curve", [])
    curve.append([step, float(loss)])
    if len(curve) > LOSS_CURVE_POINTS:
        status["loss_curve"] = curve[::2] if curve[-1] == curve[::2][-1] else [*curve[::2], curve[-1]]


def apply_line(status: dict[str, Any], line: str, now: float | None = None) -> bool:
    """Fold one log line into the status; True when the status changed in a way worth writing."""
    status["log_lines"] = status.get("log_lines", 0) + 1
    parsed = parse_step_line(line)
    if parsed is None:
        error = ERROR_LINE.match(line.rstrip())
        if error:
            status["error"] = error["error"][:500]
            return True
        return False
    step, metrics = parsed
    now = time.time() if now is None else now
    status["state"] = "running"
    status["done"] = step
    status["loss"] = metrics.get("loss")
    _fold_loss(status, step, metrics.get("loss"))
    status["acc"] = metrics.get("acc")
    status["lr"] = metrics.get("lr")
    status["grad_norm"] = metrics.get("grad_norm")
    step_time = metrics.get("perf/optimizer_step_time_s")
    if step_time is not None:
        status["step_time_s"] = step_time
    status["eta_s"] = eta_seconds(status, now)
    status["updated_at"] = now
    return True


def eta_seconds(status: dict[str, Any], now: float | None = None) -> float | None:
    """Seconds left: remaining steps x the mean time per step so far (or SpecForge's last step time)."""
    total, step = status.get("total"), status.get("done") or 0
    if not total or step <= 0:
        return None
    remaining = max(0, total - step)
    started, now = status.get("first_step_at"), time.time() if now is None else now
    if started is None:
        status["first_step_at"] = now
        status["first_step"] = step
        per_step = status.get("step_time_s")
    else:
        done = step - status.get("first_step", 0)
        per_step = (now - started) / done if done > 0 else status.get("step_time_s")
    if per_step is None or math.isnan(per_step):
        return None
    return round(remaining * per_step, 1)


def fold(lines: Iterable[str], status: dict[str, Any]) -> dict[str, Any]:
    for line in lines:
        apply_line(status, line)
    return status


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


def progress_line(status: dict[str, Any]) -> str:
    """One line for Ansible's output: state, step/total, loss, acceptance proxy, ETA."""
    total = status.get("total")
    parts = [status.get("state", "?"), f"step {status.get('done', 0)}/{total if total else '?'}"]
    if status.get("rounds"):
        # A rolling run's round (launched with it in the status): its trainer stops at the round's last step.
        parts.insert(1, f"round {int(status.get('round', 0)) + 1}/{status['rounds']}")
    if status.get("loss") is not None:
        parts.append(f"loss {status['loss']:.4f}")
    if status.get("acc") is not None:
        parts.append(f"acc {status['acc']:.3f}")
    if status.get("state") in ("starting", "running"):
        parts.append(f"eta {human_duration(status.get('eta_s'))}")
    if status.get("exit_code") is not None:
        parts.append(f"exit {status['exit_code']}")
    if status.get("error") and status.get("state") in ("failed", "lost"):
        parts.append(f"error: {status['error']}")
    return " | ".join(parts)


def write_status(path: str | Path, status: dict[str, Any]) -> None:
    """Atomic replace: readers see the old or the new document, never a torn one."""
    status["line"] = progress_line(status)
    status["updated_at"] = time.time()
    atomic_write_json(path, status, durable=False)


def read_status(path: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None
