"""Rolling offline training: one SpecForge run trained shard by shard inside a disk budget.

    python -m regen.training.rolling plan    --ledger L --features DIR --checkpoints DIR --run-id ID
                                             --data D --max-length N [--max-samples N] --budget-bytes B
                                             --file-bytes-per-token X --world-size W --batch-size b
                                             --accumulation-steps a --epochs E --total-steps T --seed S
                                             [--dry-run]
    python -m regen.training.rolling status  --ledger L --checkpoints DIR --run-id ID
    python -m regen.training.rolling prepare --ledger L --checkpoints DIR --run-id ID --round R
    python -m regen.training.rolling check   --ledger L --checkpoints DIR --run-id ID --round R
                                             [--budget-bytes B]
    python -m regen.training.rolling finish  --ledger L --checkpoints DIR --run-id ID
    python -m regen.training.rolling run     <plan's flags> --capture JSON --launcher JSON --trainer JSON
                                             --status S [--wait SECONDS] [--dry-run]

`run` is the driver the train stage calls once: it plans, then takes the current round through prepare,
capture, check, the trainer's launch (a supervised job, regen.training.launcher) and its watch, finish,
and on to the next round, until every round is trained, the trainer is still running after --wait
seconds, or a step failed. With --dry-run it plans without writing and prints the commands the current
round would run (check mode).

Why R rounds give the result of one round. SpecForge 0.2.0's offline run lists the feature files of
`data.hidden_states_path` by name (sorted) and opens a file only when its loader reaches it
(`offline_reader`: "Assembly only lists filenames"). Each epoch it visits them in the order of
`DistributedSampler(seed + epoch)` (`launch._distributed_sampler_indices`), rank by rank, in batches. A
checkpoint records the optimizer, the schedule, every RNG and the position in the epoch, and a resume
refuses a different `dataset_size`, `source_dataset_size`, sampler seed or `effective_total_steps`. So the
rolling run keeps every one of them: the feature directory always holds a file name for every sample (the
samples of other rounds are empty placeholders, never opened), `training.total_steps` fixes the horizon of
the whole run (the LR schedule is the one-round schedule), and each round is the same `specforge train
--config run.yaml` with `training.max_steps=<the round's last step>` (a stop, not a horizon) and
`training.resume_from=<the previous round's checkpoint>`. Round r's shard is exactly the samples that
SpecForge's own sampler hands the trainer ranks in its steps, so the steps see the same batches in the
same order with the same state: the weights are those of one round (bit for bit on the CPU demo, which the
train-stage test checks).

The partition is computed here from SpecForge's sampler and each sample's feature size, and kept in a
ledger: rounds are runs of consecutive optimizer steps, as long as the features their samples need stay
inside the budget (`partition_rounds`). Progress lives where SpecForge keeps it, in its checkpoints: the
current round is the first whose last step is past the newest complete checkpoint. So every command is
idempotent and a kill anywhere loses nothing: `prepare` empties the features of other rounds (never of
the current one) and lays the placeholders, the capture job writes the round's missing files, `check`
measures the directory against the budget and records the peak, the trainer resumes from the newest
checkpoint, and `finish` empties the features of trained rounds (the whole directory once the run is
done). Every command prints one JSON object; exit 2 means bad input (the message says what to change),
exit 1 (`run` only) a capture or launch that failed or a round the trainer ended before its last step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from regen.fsio import TMP_SUFFIX, atomic_write_json
from regen.module_utils.regen_estimate import human_bytes
from regen.training.capture import (
    CaptureError,
    Fingerprint,
    damaged,
    digests_path,
    read_digests,
    sample_path,
    select,
)
from regen.training.capture import is_captured as _has_recorded_features
from regen.training.checkpoints import latest_checkpoint

LEDGER_VERSION = 1
# What torch.save adds to a feature file around its three tensors (a zip archive: the pickle, a record per
# tensor aligned to 64 bytes, the central directory): 2.0-2.2 KiB measured on the demo's files. 4 KiB is
# counted, then the file is rounded up to the filesystem's block, so the estimate is never below the disk
# a file takes.
FILE_OVERHEAD_BYTES = 4096
# Bytes one file name takes in the feature directory itself (ext4: an 8-byte header and the 18-byte name,
# 4-byte aligned, is 28; hashed-directory blocks add some): 64 counted. With the capture manifest's block,
# this is what the directory takes besides the features (`reserved_bytes`), and the budget counts it.
DIR_ENTRY_BYTES = 64
# Fields of the ledger's inputs that decide the partition (the budget aside, see `plan`).
_INPUT_KEYS = (
    "samples",
    "fingerprint",
    "world_size",
    "batch_size",
    "accumulation_steps",
    "epochs",
    "total_steps",
    "seed",
    "file_bytes_per_token",
    "max_length",
    "max_samples",
)


class RollingError(Exception):
    """Bad input or a broken promise (the budget); the message says what and how to fix it."""


# --------------------------------------------------------------------------------------------------
# Pure logic: the samples of each optimizer step, rounds inside a budget, where a run stands
# --------------------------------------------------------------------------------------------------


def file_bytes(tokens: int, file_bytes_per_token: int, block: int = 4096) -> int:
    """Disk one sample's feature file takes at most: its tensors, torch.save's container, whole blocks."""
    raw = int(tokens) * int(file_bytes_per_token) + FILE_OVERHEAD_BYTES
    block = max(1, int(block))
    return -(-raw // block) * block


def reserved_bytes(samples: int, block: int = 4096) -> int:
    """What the feature directory takes besides the features: its own entries (a name per sample, the
    placeholders' included) and the capture manifest's block."""
    block = max(1, int(block))
    return -(-(int(samples) * DIR_ENTRY_BYTES) // block) * block + block


def step_positions(
    orders: Sequence[Sequence[Sequence[int]]], batch_size: int, accumulation_steps: int, total_steps: int
) -> list[list[int]]:
    """The positions (in SpecForge's sorted list of feature files) each optimizer step reads, all ranks.

    `orders[epoch][rank]` is the rank's visiting order in that epoch (SpecForge's sampler: every rank gets
    the same number of positions). The trainer's loader drops an incomplete last batch per epoch, and an
    optimizer step takes `accumulation_steps` micro-batches, which may span an epoch boundary, exactly as
    SpecForge's controller counts them. Returns one sorted, duplicate-free list per step, steps 1..T.
    """
    batch, accumulation, total = int(batch_size), int(accumulation_steps), int(total_steps)
    if batch < 1 or accumulation < 1 or total < 1:
        raise RollingError(
            f"batch_size {batch}, accumulation_steps {accumulation} and total_steps {total} must be >= 1"
        )
    per_epoch = []
    for epoch, ranks in enumerate(orders):
        lengths = {len(order) for order in ranks}
        if len(lengths) != 1:
            raise RollingError(f"epoch {epoch}: the ranks' orders differ in length {sorted(lengths)}")
        per_epoch.append(lengths.pop() // batch)
    available = sum(per_epoch)
    if total * accumulation > available:
        raise RollingError(
            f"{total} optimizer steps x {accumulation} micro-batches need {total * accumulation} batches, "
            f"but {len(orders)} epoch(s) give {available} (batch size {batch}): the step horizon does not "
            "match the data (plan the run again)"
        )
    steps: list[list[int]] = []
    epoch, batch_in_epoch = 0, 0
    for _ in range(total):
        positions: set[int] = set()
        for _ in range(accumulation):
            while batch_in_epoch >= per_epoch[epoch]:
                epoch, batch_in_epoch = epoch + 1, 0
            start = batch_in_epoch * batch
            for order in orders[epoch]:
                positions.update(order[start : start + batch])
            batch_in_epoch += 1
        steps.append(sorted(positions))
    return steps


def partition_rounds(
    steps: Sequence[Sequence[int]], position_bytes: Sequence[int], budget: int, first_step: int = 1
) -> list[dict[str, Any]]:
    """Consecutive optimizer steps grouped into rounds whose samples' features fit `budget` bytes.

    Greedy: a round takes steps while the features of the samples they read (each sample counted once)
    stay within the budget, so the rounds are as few as contiguous windows allow. `steps[i]` is step
    `first_step + i`. A step that alone needs more than the budget cannot be trained this way: refused
    with the numbers.
    """
    rounds: list[dict[str, Any]] = []
    current: set[int] = set()
    size = 0
    start = first_step
    for offset, positions in enumerate(steps):
        step = first_step + offset
        new = [p for p in positions if p not in current]
        extra = sum(position_bytes[p] for p in new)
        alone = sum(position_bytes[p] for p in set(positions))
        if alone > budget:
            raise RollingError(
                f"optimizer step {step} reads {len(set(positions))} sample(s) whose features take "
                f"{human_bytes(alone)}, more than the disk budget of {human_bytes(budget)}: give the "
                "features more disk (drafter_training_hidden_states_max_bytes, or a larger disk for "
                "drafter_training_hidden_states_dir), a smaller batch, or a shorter length budget"
            )
        if current and size + extra > budget:
            rounds.append(
                {"first_step": start, "last_step": step - 1, "positions": sorted(current), "bytes": size}
            )
            current, size, start = set(), 0, step
            new, extra = list(set(positions)), alone
        current.update(new)
        size += extra
    if current:
        rounds.append(
            {
                "first_step": start,
                "last_step": first_step + len(steps) - 1,
                "positions": sorted(current),
                "bytes": size,
            }
        )
    return rounds


def current_round(rounds: Sequence[dict[str, Any]], checkpoint_step: int) -> int | None:
    """Index of the round to work on: the first whose last step is past the newest checkpoint (None: done)."""
    for index, item in enumerate(rounds):
        if int(item["last_step"]) > int(checkpoint_step):
            return index
    return None


# --------------------------------------------------------------------------------------------------
# The samples, SpecForge's order, the disk
# --------------------------------------------------------------------------------------------------


def kept_samples(data: str, max_length: int, max_samples: int | None) -> tuple[list[tuple[int, int]], str]:
    """(sample index, tokens) of every sample the capture keeps, in SpecForge's file order, and their
    fingerprint (the capture's own selection: files are `data_<index>.ckpt`, so name order is index order)."""
    kept, fingerprint = [], Fingerprint()
    for index, ids, mask in select(data, max_length, max_samples):
        if ids:
            kept.append((index, len(ids)))
            fingerprint.add(index, ids, mask)
    return kept, fingerprint.hexdigest()


def sampler_orders(size: int, world_size: int, seed: int, epochs: int) -> list[list[list[int]]]:
    """orders[epoch][rank]: SpecForge 0.2.0's own offline sampler (`_distributed_sampler_indices`)."""
    try:
        from specforge.launch import _distributed_sampler_indices
    except ImportError as exc:
        raise RollingError(
            f"rolling training needs SpecForge 0.2.0's offline sampler (specforge.launch."
            f"_distributed_sampler_indices) to know which samples each step reads: {exc}; run this in the "
            "training venv with specforge==0.2.0"
        ) from None
    return [
        [
            list(_distributed_sampler_indices(size, dp_rank=rank, dp_size=world_size, seed=seed, epoch=epoch))
            for rank in range(world_size)
        ]
        for epoch in range(epochs)
    ]


def _block_size(path: Path) -> int:
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        return os.statvfs(probe).f_bsize or 4096
    except OSError:
        return 4096


def free_bytes(path: Path) -> int | None:
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        stat = os.statvfs(probe)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def disk_usage(features: Path) -> int:
    """Bytes the feature directory takes on disk now: the directory itself and every file in it (features,
    placeholders, the capture manifest, a temporary file a killed capture left), counted by the blocks
    allocated to them."""
    if not features.is_dir():
        return 0
    total = features.stat().st_blocks * 512
    with os.scandir(features) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def is_captured(path: Path) -> bool:
    """A feature file with content (a placeholder is empty; the capture writes a file whole or not at all)."""
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:
        return False


def _uncaptured(features: Path, indices: list[int]) -> list[int]:
    """The samples whose file is not the one the capture recorded (absent, a placeholder, another size)."""
    digests = read_digests(features)
    return [i for i in indices if not _has_recorded_features(sample_path(features, i), digests, i)]


def _empty_damaged(features: Path, indices: list[int]) -> list[str]:
    """Empty (back to placeholders, which the capture fills again) the files of `indices` whose content is
    not what the capture wrote, by their sha256; returns their names."""
    bad = damaged(features, indices)
    for index in bad:
        os.truncate(sample_path(features, index), 0)
    return [sample_path(features, i).name for i in bad]


# --------------------------------------------------------------------------------------------------
# The ledger
# --------------------------------------------------------------------------------------------------


def _round_file(ledger_path: Path, number: int) -> Path:
    return ledger_path.parent / f"round-{number:03d}.json"


def read_ledger(path: Path) -> dict[str, Any]:
    try:
        ledger = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RollingError(
            f"no rolling ledger at {path}: run the train stage (it plans the rounds)"
        ) from None
    except ValueError as exc:
        raise RollingError(
            f"the rolling ledger {path} is unreadable ({exc}); remove it to plan again"
        ) from None
    if ledger.get("version") != LEDGER_VERSION:
        raise RollingError(
            f"the rolling ledger {path} has version {ledger.get('version')}, not {LEDGER_VERSION}"
        )
    return ledger


def read_round(ledger_path: Path, ledger: dict[str, Any], number: int) -> dict[str, Any]:
    if not 0 <= number < len(ledger["rounds"]):
        raise RollingError(f"round {number} is not in {ledger_path} ({len(ledger['rounds'])} rounds)")
    path = _round_file(ledger_path, number)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RollingError(
            f"{path.name}, the sample list of round {number + 1}, is missing from {path.parent}: the ledger "
            f"names {len(ledger['rounds'])} rounds; remove {ledger_path} to plan the rounds again (the "
            "checkpoints are kept, training resumes from the newest)"
        ) from None
    except ValueError as exc:
        raise RollingError(
            f"{path} is unreadable ({exc}); remove {ledger_path} to plan the rounds again"
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("indices"), list):
        raise RollingError(f"{path} has no 'indices' list; remove {ledger_path} to plan the rounds again")
    return doc


def _checkpoint_step(checkpoints: str, run_id: str) -> int:
    latest = latest_checkpoint(checkpoints, run_id)
    return int(latest["step"]) if latest else 0


def _rounds_from(
    steps: list[list[int]], kept: list[tuple[int, int]], sizes: list[int], budget: int, first_step: int
) -> list[dict[str, Any]]:
    """The rounds of steps `first_step`..T as round documents: sample indices (file names), their bytes,
    and the samples each step reads."""
    rounds = []
    for item in partition_rounds(steps[first_step - 1 :], sizes, budget, first_step=first_step):
        positions = item["positions"]
        rounds.append(
            {
                "first_step": item["first_step"],
                "last_step": item["last_step"],
                "samples": len(positions),
                "estimated_bytes": item["bytes"],
                "indices": [kept[p][0] for p in positions],
                "sample_bytes": [sizes[p] for p in positions],
                "steps": [
                    [kept[p][0] for p in steps[s - 1]]
                    for s in range(item["first_step"], item["last_step"] + 1)
                ],
            }
        )
    return rounds


def keep_ledger(old: dict[str, Any], inputs: dict[str, Any], budget: int, checkpoint: int) -> bool:
    """Whether a ledger's partition still holds: made for these inputs (else refused: another run's
    ledger), and every round not trained yet fits the budget given now. A budget taken from the free disk
    moves a little from run to run; that alone never re-plans."""
    differ = {k: (old["inputs"].get(k), inputs[k]) for k in _INPUT_KEYS if old["inputs"].get(k) != inputs[k]}
    if differ:
        raise RollingError(
            f"the rolling ledger was planned for other data or another recipe {differ}; the run id should "
            "have changed with them. Remove the ledger to plan again (progress is in SpecForge's "
            "checkpoints; features are captured again)"
        )
    remaining = [r for r in old["rounds"] if int(r["last_step"]) > checkpoint]
    reserved = int(old.get("reserved_bytes", 0))
    return all(int(r["estimated_bytes"]) + reserved <= budget for r in remaining)


def build_ledger(
    old: dict[str, Any] | None,
    *,
    inputs: dict[str, Any],
    kept: list[tuple[int, int]],
    sizes: list[int],
    steps: list[list[int]],
    budget: int,
    checkpoint: int,
    run_id: str,
    features: str,
    block: int,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ledger and the documents of its new rounds (`round-NNN.json`: indices, their bytes, the samples
    of each step). Without an `old` ledger every step is partitioned; with one (a lowered budget), the
    steps after the newest checkpoint are, the rounds trained stay as they were, and a round the
    checkpoint cuts keeps its trained part."""
    history: list[dict[str, Any]] = []
    first = 1
    if old is not None:
        first = checkpoint + 1
        history = [dict(r) for r in old["rounds"] if int(r["last_step"]) <= checkpoint]
        cut = next(
            (r for r in old["rounds"] if int(r["first_step"]) <= checkpoint < int(r["last_step"])), None
        )
        if cut is not None:
            history.append({**cut, "last_step": checkpoint, "cut_at_replan": True})
    total = int(inputs["total_steps"])
    reserved = reserved_bytes(len(kept), block)
    if reserved >= budget:
        raise RollingError(
            f"the disk budget of {human_bytes(budget)} does not even hold the feature directory of "
            f"{len(kept)} samples ({human_bytes(reserved)} for its names and the capture manifest): raise "
            "drafter_training_hidden_states_max_bytes or free disk"
        )
    fresh = _rounds_from(steps, kept, sizes, budget - reserved, first) if first <= total else []
    ledger = {
        "version": LEDGER_VERSION,
        "run_id": run_id,
        "features_dir": str(features),
        "inputs": inputs,
        "budget_bytes": budget,
        "total_steps": total,
        "block_bytes": block,
        "file_overhead_bytes": FILE_OVERHEAD_BYTES,
        "reserved_bytes": reserved,
        "rounds": history,
        "records": (old or {}).get("records", {}),
        "peak_bytes": (old or {}).get("peak_bytes", 0),
        "finished": False,
        "replans": list((old or {}).get("replans", [])),
        "created_at": (old or {}).get("created_at", time.time()),
    }
    if old is not None:
        ledger["replans"].append(
            {"at_step": checkpoint, "budget_bytes": budget, "previous_budget_bytes": old["budget_bytes"]}
        )
    documents = []
    for item in fresh:
        number = len(ledger["rounds"])
        summary = {
            "round": number,
            "first_step": item["first_step"],
            "last_step": item["last_step"],
            "samples": item["samples"],
            "estimated_bytes": item["estimated_bytes"],
            "file": f"round-{number:03d}.json",
        }
        ledger["rounds"].append(summary)
        documents.append({**item, **summary})
    return ledger, documents


def write_ledger(ledger_path: Path, ledger: dict[str, Any], documents: list[dict[str, Any]]) -> None:
    """Round documents first, then the ledger that names them: a kill between leaves the old ledger whole."""
    ledger_path.parent.mkdir(parents=True, exist_ok=True)
    for document in documents:
        atomic_write_json(ledger_path.parent / document["file"], document)
    atomic_write_json(ledger_path, ledger)


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Partition the run into rounds, or keep the ledger's partition while it still fits the budget."""
    ledger_path, features = Path(args.ledger), Path(args.features)
    budget = int(args.budget_bytes)
    if budget <= 0:
        raise RollingError(
            f"the disk budget for rolling features is {budget} B: set "
            "drafter_training_hidden_states_max_bytes, or free disk where drafter_training_hidden_states_dir "
            "is"
        )
    kept, fingerprint = kept_samples(args.data, args.max_length, args.max_samples)
    if not kept:
        raise RollingError(f"no training samples under {args.data}: run the tokenize stage first")
    inputs = {
        "samples": len(kept),
        "fingerprint": fingerprint,
        "world_size": args.world_size,
        "batch_size": args.batch_size,
        "accumulation_steps": args.accumulation_steps,
        "epochs": args.epochs,
        "total_steps": args.total_steps,
        "seed": args.seed,
        "file_bytes_per_token": args.file_bytes_per_token,
        "max_length": args.max_length,
        "max_samples": args.max_samples,
    }
    checkpoint = _checkpoint_step(args.checkpoints, args.run_id)
    old = read_ledger(ledger_path) if ledger_path.exists() else None
    if old is not None and keep_ledger(old, inputs, budget, checkpoint):
        return _plan_summary(old, checkpoint, created=False, note=None)
    block = _block_size(features)
    sizes = [file_bytes(tokens, args.file_bytes_per_token, block) for _, tokens in kept]
    orders = sampler_orders(len(kept), args.world_size, args.seed, args.epochs)
    steps = step_positions(orders, args.batch_size, args.accumulation_steps, args.total_steps)
    ledger, documents = build_ledger(
        old,
        inputs=inputs,
        kept=kept,
        sizes=sizes,
        steps=steps,
        budget=budget,
        checkpoint=checkpoint,
        run_id=args.run_id,
        features=str(features),
        block=block,
    )
    if not args.dry_run:
        write_ledger(ledger_path, ledger, documents)
    note = None
    if old is not None:
        note = (
            f"re-planned from step {checkpoint + 1}: a round not trained yet no longer fit the budget of "
            f"{human_bytes(budget)} (it was {human_bytes(old['budget_bytes'])})"
        )
    return _plan_summary(ledger, checkpoint, created=True, note=note)


def _plan_summary(ledger: dict[str, Any], checkpoint: int, created: bool, note: str | None) -> dict[str, Any]:
    current = current_round(ledger["rounds"], checkpoint)
    largest = max((int(r["estimated_bytes"]) for r in ledger["rounds"]), default=0)
    largest += int(ledger.get("reserved_bytes", 0))
    line = (
        f"{len(ledger['rounds'])} round(s) over {ledger['total_steps']} optimizer steps of "
        f"{ledger['inputs']['samples']} samples; the largest shard takes {human_bytes(largest)} (with the "
        f"directory) of a {human_bytes(ledger['budget_bytes'])} budget"
    )
    return {
        "changed": created,
        "rounds": len(ledger["rounds"]),
        "current_round": current,
        "checkpoint_step": checkpoint,
        "done": current is None,
        "finished": bool(ledger.get("finished")),
        "budget_bytes": ledger["budget_bytes"],
        "largest_round_bytes": largest,
        "rounds_detail": ledger["rounds"],
        "note": note,
        "line": line + (f"; {note}" if note else ""),
    }


def status(args: argparse.Namespace) -> dict[str, Any]:
    """Where the run stands: the current round (from the newest checkpoint), the disk the features take."""
    ledger_path = Path(args.ledger)
    if not ledger_path.exists():
        return {
            "changed": False,
            "planned": False,
            "done": False,
            "finished": False,
            "current_round": None,
            "line": "no rounds planned yet",
        }
    ledger = read_ledger(ledger_path)
    checkpoint = _checkpoint_step(args.checkpoints, args.run_id)
    current = current_round(ledger["rounds"], checkpoint)
    features = Path(ledger["features_dir"])
    held = disk_usage(features)
    total = len(ledger["rounds"])
    if current is None:
        where = f"all {total} rounds trained (step {checkpoint}/{ledger['total_steps']})"
    else:
        item = ledger["rounds"][current]
        where = (
            f"round {current + 1}/{total}: steps {item['first_step']}-{item['last_step']} of "
            f"{ledger['total_steps']}, {item['samples']} samples; checkpoint at step {checkpoint}"
        )
    return {
        "changed": False,
        "planned": True,
        "rounds": total,
        "current_round": current,
        "checkpoint_step": checkpoint,
        "done": current is None,
        "finished": bool(ledger.get("finished")),
        "held_bytes": held,
        "peak_bytes": ledger.get("peak_bytes", 0),
        "budget_bytes": ledger["budget_bytes"],
        "round": ledger["rounds"][current] if current is not None else None,
        "line": (
            f"{where}; features on disk {human_bytes(held)}, peak {human_bytes(ledger.get('peak_bytes', 0))} "
            f"of a {human_bytes(ledger['budget_bytes'])} budget"
        ),
    }


def _evict(features: Path, keep: set[int]) -> dict[str, int]:
    """Empty every captured feature file not in `keep` (by sample index) and drop temporary files a killed
    capture left; the names stay, as placeholders SpecForge lists but this run never reads."""
    evicted = dropped = 0
    if not features.is_dir():
        return {"evicted": 0, "temporary": 0}
    with os.scandir(features) as entries:
        for entry in entries:
            name = entry.name
            if name.endswith(TMP_SUFFIX):
                os.unlink(entry.path)
                dropped += 1
                continue
            if not (name.startswith("data_") and name.endswith(".ckpt")):
                continue
            try:
                index = int(name[len("data_") : -len(".ckpt")])
            except ValueError:
                continue
            if index not in keep and entry.stat().st_size > 0:
                os.truncate(entry.path, 0)
                evicted += 1
    return {"evicted": evicted, "temporary": dropped}


def _placeholders(features: Path, indices: list[int]) -> int:
    features.mkdir(parents=True, exist_ok=True)
    made = 0
    for index in indices:
        path = sample_path(features, index)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        os.close(fd)
        made += 1
    return made


def _all_indices(ledger_path: Path, ledger: dict[str, Any]) -> list[int]:
    # Every round's file must be there: a missing one would leave its samples without a name, and
    # SpecForge's sampler would then see another data set size than the one the rounds were planned for.
    seen: set[int] = set()
    for number in range(len(ledger["rounds"])):
        seen.update(read_round(ledger_path, ledger, number)["indices"])
    return sorted(seen)


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Make the feature directory ready for round R's capture: other rounds' features emptied, a
    placeholder for every sample, and enough free disk for what the capture will write."""
    ledger_path = Path(args.ledger)
    ledger = read_ledger(ledger_path)
    checkpoint = _checkpoint_step(args.checkpoints, args.run_id)
    current = current_round(ledger["rounds"], checkpoint)
    if current != args.round:
        raise RollingError(
            f"round {args.round} is not the round to train: the newest checkpoint is at step {checkpoint}, "
            f"so the current round is {current if current is not None else 'none (all trained)'}"
        )
    doc = read_round(ledger_path, ledger, args.round)
    features = Path(ledger["features_dir"])
    keep = set(doc["indices"])
    changes = _evict(features, keep)
    changes["placeholders"] = _placeholders(features, _all_indices(ledger_path, ledger))
    # A file of this round whose content is not what the capture wrote is emptied, so the capture
    # that follows makes it again.
    remade = _empty_damaged(features, list(doc["indices"]))
    changes["damaged"] = len(remade)
    sizes = dict(zip(doc["indices"], doc["sample_bytes"], strict=True))
    missing = _uncaptured(features, list(doc["indices"]))
    to_write = sum(sizes[i] for i in missing)
    free = free_bytes(features)
    if free is not None and to_write > free:
        raise RollingError(
            f"round {args.round + 1} still has {len(missing)} samples to capture (about "
            f"{human_bytes(to_write)}) but the disk holding {features} has {human_bytes(free)} free: free "
            "disk, or lower drafter_training_hidden_states_max_bytes (the rounds are planned again, smaller)"
        )
    return {
        "changed": any(changes.values()),
        "round": args.round,
        "damaged_files": remade,
        "to_capture": len(missing),
        "estimated_bytes": to_write,
        "held_bytes": disk_usage(features),
        **changes,
    }


def check(args: argparse.Namespace) -> dict[str, Any]:
    """After round R's capture: every sample of the round is on disk, and the directory within budget."""
    ledger_path = Path(args.ledger)
    ledger = read_ledger(ledger_path)
    doc = read_round(ledger_path, ledger, args.round)
    features = Path(ledger["features_dir"])
    # Verified by content (sha256 against the capture's record), not by size: training reads these next.
    bad = _empty_damaged(features, list(doc["indices"]))
    if bad:
        raise RollingError(
            f"round {args.round + 1}: {len(bad)} feature file(s) in {features} are not what the capture "
            f"wrote (sha256 differs from {digests_path(features).name}; first: {bad[0]}); they were emptied: "
            "run the train stage again (the capture makes them again)"
        )
    missing = _uncaptured(features, list(doc["indices"]))
    if missing:
        raise RollingError(
            f"round {args.round + 1}: {len(missing)} of its {len(doc['indices'])} samples have no features "
            f"in {features} (first: {sample_path(features, missing[0]).name}); run the train stage again "
            "(the capture resumes)"
        )
    held = disk_usage(features)
    budget = int(ledger["budget_bytes"])
    if args.budget_bytes:
        budget = min(budget, int(args.budget_bytes))
    if held > budget:
        raise RollingError(
            f"round {args.round + 1}'s features take {human_bytes(held)} on disk ({held} B), over the "
            f"budget of {human_bytes(budget)} ({budget} B) they were planned for; this is a bug in the "
            f"estimate ({ledger['file_overhead_bytes']} B of overhead per file, {ledger['block_bytes']} B "
            f"blocks, {ledger.get('reserved_bytes', 0)} B for the directory): report it, "
            "and lower drafter_training_hidden_states_max_bytes meanwhile"
        )
    record = ledger["records"].get(str(args.round), {})
    changed = record.get("captured_bytes") != held or ledger.get("peak_bytes", 0) < held
    if changed:
        record = {
            **record,
            "captured_bytes": held,
            "samples": len(doc["indices"]),
            "captured_at": time.time(),
        }
        ledger["records"][str(args.round)] = record
        ledger["peak_bytes"] = max(int(ledger.get("peak_bytes", 0)), held)
        atomic_write_json(ledger_path, ledger)
    return {
        "changed": changed,
        "round": args.round,
        "held_bytes": held,
        "peak_bytes": ledger["peak_bytes"],
        "budget_bytes": budget,
        "line": (
            f"round {args.round + 1}/{len(ledger['rounds'])}: {len(doc['indices'])} samples captured, "
            f"{human_bytes(held)} on disk (peak {human_bytes(ledger['peak_bytes'])}) of a "
            f"{human_bytes(budget)} budget"
        ),
    }


def finish(args: argparse.Namespace) -> dict[str, Any]:
    """Empty the features of every trained round; once all are trained, remove the directory."""
    ledger_path = Path(args.ledger)
    ledger = read_ledger(ledger_path)
    checkpoint = _checkpoint_step(args.checkpoints, args.run_id)
    current = current_round(ledger["rounds"], checkpoint)
    features = Path(ledger["features_dir"])
    now = time.time()
    changed = False
    for number, item in enumerate(ledger["rounds"]):
        if int(item["last_step"]) <= checkpoint and "evicted_at" not in ledger["records"].get(
            str(number), {}
        ):
            ledger["records"][str(number)] = {
                **ledger["records"].get(str(number), {}),
                "trained_to_step": checkpoint,
                "evicted_at": now,
            }
            changed = True
    if current is None:
        removed = features.is_dir()
        if removed:
            # The directory holds nothing but this data's features, placeholders and capture manifest.
            shutil.rmtree(features)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(digests_path(features))
        changes = {"evicted": 0, "temporary": 0, "removed": removed}
        changed = changed or removed or not ledger.get("finished")
        ledger["finished"] = True
    else:
        keep = set(read_round(ledger_path, ledger, current)["indices"])
        changes = {**_evict(features, keep), "removed": False}
        changed = changed or bool(changes["evicted"] or changes["temporary"])
    if changed:
        atomic_write_json(ledger_path, ledger)
    return {
        "changed": changed,
        "current_round": current,
        "checkpoint_step": checkpoint,
        "done": current is None,
        "held_bytes": disk_usage(features),
        "peak_bytes": ledger.get("peak_bytes", 0),
        "budget_bytes": ledger["budget_bytes"],
        **changes,
    }


# --------------------------------------------------------------------------------------------------
# run: the driver of the rounds
# --------------------------------------------------------------------------------------------------

# A check-mode plan that cannot run (no data on the host yet) still shows the shape of a round.
_PLACEHOLDER_ROUND = {
    "round": 0,
    "first_step": 1,
    "last_step": "<last step of round 1>",
    "file": "round-000.json",
}


# How often a watched round prints its progress (to stderr, which the train stage's log keeps).
_WATCH_SLICE_S = 30.0


class StepFailed(Exception):
    """A capture or a launch that failed, or a round its trainer ended early: the run stops here."""


def _ledger_args(args: argparse.Namespace, **extra: Any) -> argparse.Namespace:
    return argparse.Namespace(ledger=args.ledger, checkpoints=args.checkpoints, run_id=args.run_id, **extra)


def capture_command(capture: list[str], ledger_path: Path, item: dict[str, Any]) -> list[str]:
    """The capture job for one round: only the samples its round file lists."""
    return [*capture, "--only", str(ledger_path.parent / item["file"])]


def launch_command(
    launcher: list[str],
    trainer: list[str],
    *,
    run_id: str,
    item: dict[str, Any],
    rounds: int,
    resume_from: str | None,
) -> list[str]:
    """The launcher's `start` for one round: the trainer resumes from the newest checkpoint and stops at
    the round's last step (training.total_steps in run.yaml keeps the run's horizon); the round is kept in
    the trainer's status. SpecForge's own checks stay as SpecForge sets them: its loader only lists the
    other rounds' placeholders (the eager pass over every file is opt-in), and this round's files were
    checked by content (sha256) in `check` before the trainer starts."""
    meta = {
        "run_id": run_id,
        "resume_from": resume_from,
        "round": item["round"],
        "rounds": rounds,
        "round_first_step": item["first_step"],
        "round_last_step": item["last_step"],
    }
    return [
        *launcher,
        "--meta",
        json.dumps(meta, sort_keys=True),
        "--",
        *trainer,
        *([f"training.resume_from={resume_from}"] if resume_from else []),
        f"training.max_steps={item['last_step']}",
    ]


def _resume_from(args: argparse.Namespace) -> str | None:
    latest = latest_checkpoint(args.checkpoints, args.run_id)
    return str(latest["path"]) if latest else None


def _json_tail(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.strip().startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def _run_step(argv: list[str], what: str) -> dict[str, Any]:
    """Run a job step in the foreground (its stderr passes through); its last stdout line is its JSON."""
    result = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        answer = _json_tail(result.stdout) if result.stdout else {}
        raise StepFailed(
            f"{what} exited {result.returncode}: "
            f"{answer.get('msg') or answer.get('reason') or result.stdout[-2000:]}"
        )
    return _json_tail(result.stdout)


def _trainer(args: argparse.Namespace, wait: float = 0.0) -> dict[str, Any]:
    """The trainer's status from the launcher (liveness checked), after up to `wait` seconds for it to end.
    Asked through the helper interpreter, as the role asks it: this driver runs in the training venv
    (the plan needs SpecForge's sampler), which need not have the launcher's dependencies."""
    argv = [args.helper_python, "-m", "regen.training.launcher", "status", "--status", args.status]
    if wait > 0:
        argv += ["--until-final", "--wait", f"{wait:.1f}"]
    return _run_step(argv, "the trainer's status")


def _watch(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """The trainer's status once it is final (lost counts), or at the deadline; progress lines to stderr."""
    status = _trainer(args)
    while status.get("state") in ("starting", "running") and time.monotonic() < deadline:
        print(status.get("line"), file=sys.stderr, flush=True)
        status = _trainer(args, wait=min(_WATCH_SLICE_S, max(0.1, deadline - time.monotonic())))
    return status


def _dry_run(args: argparse.Namespace) -> dict[str, Any]:
    ledger_path = Path(args.ledger)
    summary, error = None, None
    try:
        summary = plan(args)
    except (RollingError, CaptureError, OSError) as exc:
        error = str(exc)
    except ImportError as exc:
        # Check mode on a host whose training venv is not there yet: the helper shows the commands.
        error = f"the plan needs SpecForge's sampler, which this interpreter cannot import ({exc})"
    item, rounds = dict(_PLACEHOLDER_ROUND), 1
    if summary and summary["current_round"] is not None:
        item = {**summary["rounds_detail"][summary["current_round"]], "round": summary["current_round"]}
        rounds = summary["rounds"]
    commands = {
        "capture": capture_command(args.capture, ledger_path, item) if args.capture else [],
        "launch": launch_command(
            args.launcher,
            args.trainer,
            run_id=args.run_id,
            item=item,
            rounds=rounds,
            resume_from=_resume_from(args),
        ),
    }
    return {
        "changed": False,
        "dry_run": True,
        "plan": summary,
        "plan_error": error,
        "round": item["round"],
        "commands": commands,
        "shell": {name: shlex.join(argv) for name, argv in commands.items() if argv},
        "lines": [f"rolling: {summary['line']}" if summary else f"rolling: not planned here ({error})"],
    }


def drive(args: argparse.Namespace) -> dict[str, Any]:
    """Plan, then train round after round (see the module's docstring); what every step said is kept."""
    if args.dry_run:
        return _dry_run(args)
    ledger_path = Path(args.ledger)
    summary = plan(args)
    changed = bool(summary["changed"])
    lines = [f"rolling: {summary['line']}"]
    lines += [json.dumps(item, sort_keys=True) for item in summary["rounds_detail"]]
    trainer = _trainer(args)
    outcome = "finished"
    for number in range(summary["rounds"]):
        where = status(_ledger_args(args))
        if where["current_round"] != number:
            continue
        item = {**where["round"], "round": number}
        trainer = _trainer(args)
        if trainer.get("state") not in ("starting", "running"):
            prepared = prepare(_ledger_args(args, round=number))
            changed = changed or bool(prepared["changed"])
            if args.capture:
                captured = _run_step(
                    capture_command(args.capture, ledger_path, item), f"round {number + 1}'s capture"
                )
                changed = changed or int(captured.get("written", 0)) > 0
                lines.append(
                    f"round {number + 1}: {captured.get('samples')} samples, {captured.get('written')} "
                    f"captured now, {captured.get('skipped')} already on disk, {captured.get('dropped')} "
                    "dropped"
                )
            checked = check(_ledger_args(args, round=number, budget_bytes=args.budget_bytes))
            changed = changed or bool(checked["changed"])
            lines.append(checked["line"])
            launched = _run_step(
                launch_command(
                    args.launcher,
                    args.trainer,
                    run_id=args.run_id,
                    item=item,
                    rounds=summary["rounds"],
                    resume_from=_resume_from(args),
                ),
                f"round {number + 1}'s launch",
            )
            changed = changed or bool(launched.get("started"))
        trainer = _watch(args, time.monotonic() + args.wait)
        lines.append(f"round {number + 1}/{summary['rounds']}: {trainer.get('line', trainer.get('state'))}")
        if trainer.get("state") != "succeeded":
            outcome = "running" if trainer.get("state") in ("starting", "running") else "failed"
            break
        finished = finish(_ledger_args(args))
        changed = changed or bool(finished["changed"])
        if finished["current_round"] == number:
            raise StepFailed(
                f"SpecForge ended round {number + 1} with success but its newest checkpoint is at step "
                f"{finished['checkpoint_step']}, before the round's last step {item['last_step']}: the run "
                f"stopped early (see {trainer.get('log') or 'the training log'}). Running the train stage "
                "again trains the round again from that checkpoint."
            )
    if outcome != "failed":
        # After the last round the feature directory goes; after a watch that ran out of time the current
        # round's features stay for the trainer still running, the trained rounds' are emptied.
        finished = finish(_ledger_args(args))
        changed = changed or bool(finished["changed"])
    where = status(_ledger_args(args))
    lines.append(f"rolling: {where['line']}")
    return {
        "changed": changed,
        "state": outcome if not where["finished"] else "finished",
        "rounds": summary["rounds"],
        "current_round": where["current_round"],
        "finished": where["finished"],
        "trainer": trainer,
        "lines": lines,
        "line": where["line"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m regen.training.rolling", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        name: sub.add_parser(name) for name in ("plan", "status", "prepare", "check", "finish", "run")
    }
    for p in commands.values():
        p.add_argument("--ledger", required=True, help="the rounds ledger (JSON)")
        p.add_argument("--checkpoints", required=True, help="SpecForge's output_dir of the run")
        p.add_argument("--run-id", required=True, help="SpecForge's run_id")
    for p in (commands["plan"], commands["run"]):
        _plan_arguments(p)
    p = commands["run"]
    p.add_argument(
        "--capture", type=json.loads, required=True, help="capture job argv (JSON list, [] for none)"
    )
    p.add_argument(
        "--launcher", type=json.loads, required=True, help="launcher `start` argv up to its `--` (JSON)"
    )
    p.add_argument("--trainer", type=json.loads, required=True, help="the trainer's argv (JSON list)")
    p.add_argument("--status", required=True, help="the trainer's status document (the launcher's --status)")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to watch each round's trainer")
    p.add_argument(
        "--helper-python",
        default=sys.executable,
        help="interpreter that asks the launcher for the trainer's status (the role's helper)",
    )
    for name in ("prepare", "check"):
        commands[name].add_argument("--round", type=int, required=True, help="round number, from 0")
    commands["check"].add_argument(
        "--budget-bytes", type=int, default=None, help="today's budget (the lower wins)"
    )
    args = parser.parse_args(argv)
    handler = {
        "plan": plan,
        "status": status,
        "prepare": prepare,
        "check": check,
        "finish": finish,
        "run": drive,
    }[args.command]
    try:
        result = handler(args)
    except (RollingError, CaptureError) as exc:
        print(json.dumps({"failed": True, "msg": str(exc)}))
        return 2
    except StepFailed as exc:
        print(json.dumps({"failed": True, "msg": str(exc)}))
        return 1
    print(json.dumps(result, sort_keys=True))
    return 0


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--features", required=True, help="the run's feature directory (SpecForge's hidden_states_path)"
    )
    p.add_argument("--data", required=True, help="tokenized dataset")
    p.add_argument("--max-length", type=int, required=True)
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--budget-bytes", type=int, required=True, help="disk the features may take")
    p.add_argument(
        "--file-bytes-per-token", type=int, required=True, help="feature bytes per token (+ ids, mask)"
    )
    p.add_argument("--world-size", type=int, default=1, help="trainer ranks (data parallel)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--accumulation-steps", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--total-steps", type=int, required=True, help="optimizer steps of the whole run")
    p.add_argument("--seed", type=int, default=42, help="SpecForge's training.seed (its sampler's seed)")
    p.add_argument("--dry-run", action="store_true", help="plan and print, write nothing")


if __name__ == "__main__":
    sys.exit(main())
