"""Rolling offline training (src/regen/training/rolling.py): which samples each optimizer step reads, the
rounds inside a disk budget, and the ledger commands the role runs between captures and trainings.

The ledger commands run on real files in a temporary directory: feature files are bytes of known sizes
(the capture job's own tests cover their content), SpecForge checkpoints are step directories with a
`training_state.pt`, as regen.training.checkpoints reads them. SpecForge's sampler order itself is checked
against torch's DistributedSampler in tests/unit/test_drafter_specforge.py, and the whole mechanism (one
round's weights from several) by the train-stage test (tests/integration/test_train_rolling.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from ansible.module_utils.regen_drafter import FEATURE_FILE_OVERHEAD_BYTES

from regen.training import rolling
from regen.training.capture import digests_path, record_digest, sample_path


def test_a_feature_file_is_counted_whole_blocks_with_its_container() -> None:
    # 71 tokens x 144 B = 10,224 B of tensors + 4,096 B of container = 14,320 B -> four 4 KiB blocks. The
    # demo's real file of 71 tokens is 12,257 B in three blocks: the estimate is never below the disk.
    assert rolling.file_bytes(71, 144) == 16384
    assert rolling.file_bytes(0, 144, block=512) == 4096
    assert rolling.FILE_OVERHEAD_BYTES == FEATURE_FILE_OVERHEAD_BYTES  # the plan counts the same allowance
    # The directory itself: 64 B per name (100,000 names: 6.1 MiB) and the capture manifest's block.
    assert rolling.reserved_bytes(4) == 8192 and rolling.reserved_bytes(100_000) == 6_402_048 + 4096


def test_a_budget_below_the_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(rolling.RollingError, match=r"does not even hold the feature directory of 4 samples"):
        _ledger(tmp_path, 8192)


def test_each_step_reads_its_ranks_batches_in_sampler_order() -> None:
    # One rank, batch 1: step k reads the k-th sample of the epoch's order.
    assert rolling.step_positions([[[6, 3, 0, 7, 2, 1, 4, 5]]], 1, 1, 8) == [
        [6],
        [3],
        [0],
        [7],
        [2],
        [1],
        [4],
        [5],
    ]
    # Two ranks, batch 2: each step reads both ranks' batch (SpecForge pads 5 samples to 6: 4 repeats).
    orders = [[[4, 0, 1], [2, 3, 4]]]
    assert rolling.step_positions(orders, 2, 1, 1) == [[0, 2, 3, 4]]
    # Accumulation spans the epoch boundary (the loader drops the short last batch of each epoch): 3 samples
    # in batches of 2 give one batch per epoch, so a step of 2 micro-batches takes one from each epoch.
    epochs = [[[2, 0, 1]], [[1, 2, 0]]]
    assert rolling.step_positions(epochs, 2, 2, 1) == [[0, 1, 2]]
    with pytest.raises(rolling.RollingError, match="need 4 batches, but 2 epoch"):
        rolling.step_positions(epochs, 2, 2, 2)
    with pytest.raises(rolling.RollingError, match="differ in length"):
        rolling.step_positions([[[0, 1], [2]]], 1, 1, 1)


def test_rounds_are_the_fewest_consecutive_windows_inside_the_budget() -> None:
    sizes = [10, 20, 30, 40]
    steps = [[0], [1], [0, 2], [3], [1]]
    rounds = rolling.partition_rounds(steps, sizes, 60)
    # Steps 1-3 read samples 0, 1, 2 (60 B: sample 0 counted once); step 4's sample 3 would make 100.
    assert [(r["first_step"], r["last_step"], r["positions"], r["bytes"]) for r in rounds] == [
        (1, 3, [0, 1, 2], 60),
        (4, 5, [1, 3], 60),
    ]
    with pytest.raises(
        rolling.RollingError, match=r"optimizer step 3 reads 2 sample\(s\) whose features take 40 B"
    ):
        rolling.partition_rounds(steps, sizes, 39)


def test_random_partitions_keep_every_promise() -> None:
    rng = random.Random(7)
    for _ in range(200):
        samples = rng.randint(1, 30)
        sizes = [rng.randint(1, 50) for _ in range(samples)]
        steps = [
            sorted(rng.sample(range(samples), rng.randint(1, min(4, samples))))
            for _ in range(rng.randint(1, 40))
        ]
        budget = max(sum(sizes[p] for p in step) for step in steps) + rng.randint(0, 100)
        rounds = rolling.partition_rounds(steps, sizes, budget)
        # Consecutive windows covering every step once, in order.
        assert [r["first_step"] for r in rounds] == [1] + [r["last_step"] + 1 for r in rounds[:-1]]
        assert rounds[-1]["last_step"] == len(steps)
        for index, item in enumerate(rounds):
            window = steps[item["first_step"] - 1 : item["last_step"]]
            assert item["positions"] == sorted({p for step in window for p in step})
            assert item["bytes"] == sum(sizes[p] for p in item["positions"]) <= budget
            if index + 1 < len(rounds):  # greedy: the next step would not have fitted
                grown = set(item["positions"]) | set(steps[item["last_step"]])
                assert sum(sizes[p] for p in grown) > budget
        assert rolling.current_round(rounds, 0) == 0
        assert rolling.current_round(rounds, len(steps)) is None


# ---- the ledger commands, on real files -------------------------------------------------------------------

RUN = "dflash-test"
# Kept samples by index (1 and 4 were dropped by the capture's filter: the indices keep gaps), and tokens.
KEPT = [(0, 10), (2, 20), (3, 30), (5, 40)]
STEPS = [[3], [0], [1], [2], [0]]  # positions read by steps 1..5


def _inputs(**changes: object) -> dict:
    inputs = {
        "samples": len(KEPT),
        "fingerprint": "f" * 16,
        "world_size": 1,
        "batch_size": 1,
        "accumulation_steps": 1,
        "epochs": 1,
        "total_steps": len(STEPS),
        "seed": 42,
        "file_bytes_per_token": 100,
        "max_length": 64,
        "max_samples": None,
    }
    return {**inputs, **changes}


def _ledger(tmp_path: Path, budget: int, old: dict | None = None, checkpoint: int = 0) -> Path:
    sizes = [rolling.file_bytes(tokens, 100, 4096) for _, tokens in KEPT]  # 8 KiB each
    ledger, documents = rolling.build_ledger(
        old,
        inputs=_inputs(),
        kept=KEPT,
        sizes=sizes,
        steps=STEPS,
        budget=budget,
        checkpoint=checkpoint,
        run_id=RUN,
        features=str(tmp_path / "features"),
        block=4096,
    )
    path = tmp_path / "run" / "rolling" / "ledger.json"
    rolling.write_ledger(path, ledger, documents)
    return path


def _cli(ledger: Path, command: str, *extra: str) -> tuple[int, dict]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = rolling.main(
            [
                command,
                "--ledger",
                str(ledger),
                "--checkpoints",
                str(ledger.parents[1] / "ckpt"),
                "--run-id",
                RUN,
                *extra,
            ]
        )
    return code, json.loads(out.getvalue())


def _checkpoint(ledger: Path, step: int) -> None:
    directory = ledger.parents[1] / "ckpt" / f"{RUN}-step{step}"
    directory.mkdir(parents=True)
    (directory / "training_state.pt").write_bytes(b"state")


def _capture(features: Path, indices: list[int], size: int = 3000) -> None:
    # As the capture job writes a sample: the file, then its line in the digest record.
    for index in indices:
        sample_path(features, index).write_bytes(b"x" * size)
        record_digest(features, index, sample_path(features, index))


def test_a_rolling_run_round_by_round(tmp_path: Path) -> None:
    # 8 KiB per sample, a 24 KiB budget: 8 KiB for the directory (4 names, the manifest), two samples a round.
    ledger = _ledger(tmp_path, 24576)
    doc = json.loads(ledger.read_text())
    assert [(r["first_step"], r["last_step"], r["samples"]) for r in doc["rounds"]] == [
        (1, 2, 2),
        (3, 4, 2),
        (5, 5, 1),
    ]
    first = json.loads((ledger.parent / "round-000.json").read_text())
    assert (
        first["indices"] == [0, 5] and first["steps"] == [[5], [0]] and first["sample_bytes"] == [8192, 8192]
    )
    features = tmp_path / "features"

    code, state = _cli(ledger, "status")
    assert code == 0 and state["current_round"] == 0 and state["planned"] and not state["done"]
    code, prepared = _cli(ledger, "prepare", "--round", "0")
    # Every sample has a name SpecForge lists (empty: not captured); the round's two are to capture.
    assert code == 0 and prepared["placeholders"] == 4 and prepared["to_capture"] == 2
    assert sorted(p.name for p in features.iterdir()) == [f"data_{i:08d}.ckpt" for i in (0, 2, 3, 5)]
    assert all(p.stat().st_size == 0 for p in features.iterdir())
    code, again = _cli(ledger, "prepare", "--round", "0")
    assert code == 0 and not again["changed"]
    code, refused = _cli(ledger, "prepare", "--round", "1")
    assert code == 2 and "the current round is 0" in refused["msg"]

    # The capture left a sample out: check names it and the fix.
    _capture(features, [0])
    code, missing = _cli(ledger, "check", "--round", "0")
    assert code == 2 and "1 of its 2 samples have no features" in missing["msg"]
    assert "data_00000005.ckpt" in missing["msg"]
    _capture(features, [5])
    code, checked = _cli(ledger, "check", "--round", "0")
    assert code == 0 and checked["held_bytes"] == rolling.disk_usage(features) <= 24576
    assert checked["peak_bytes"] == checked["held_bytes"] > 0 and checked["changed"]
    peak = checked["peak_bytes"]
    code, checked_again = _cli(ledger, "check", "--round", "0")
    assert code == 0 and not checked_again["changed"]

    # Trained to the round's last step: finish empties its features, the names stay for SpecForge.
    _checkpoint(ledger, 2)
    code, finished = _cli(ledger, "finish")
    assert code == 0 and finished["evicted"] == 2 and finished["current_round"] == 1 and not finished["done"]
    assert sample_path(features, 0).stat().st_size == 0 and len(list(features.iterdir())) == 4
    assert json.loads(ledger.read_text())["records"]["0"]["trained_to_step"] == 2

    # Round 2: a temporary file a killed capture left goes; the features over budget are refused.
    code, prepared = _cli(ledger, "prepare", "--round", "1")
    assert code == 0 and prepared["to_capture"] == 2
    (features / ".data_00000002.ckpt.abc.tmp").write_bytes(b"x" * 100)
    code, prepared = _cli(ledger, "prepare", "--round", "1")
    assert code == 0 and prepared["temporary"] == 1
    _capture(features, [2, 3], size=13000)  # 4 blocks each: 32 KiB against 24 KiB
    code, over = _cli(ledger, "check", "--round", "1")
    assert code == 2 and "over the budget of 24.0 KiB" in over["msg"]
    _capture(features, [2, 3])
    # Today's budget may be lower than the ledger's (the lower wins).
    code, lower = _cli(ledger, "check", "--round", "1", "--budget-bytes", "4096")
    assert code == 2 and "over the budget of 4.0 KiB" in lower["msg"]
    code, checked = _cli(ledger, "check", "--round", "1")
    assert code == 0

    # A kill mid-round: the checkpoint is inside round 2, which stays the current one and keeps its files.
    _checkpoint(ledger, 3)
    code, finished = _cli(ledger, "finish")
    assert code == 0 and finished["current_round"] == 1 and finished["evicted"] == 0
    assert sample_path(features, 2).stat().st_size > 0

    # The last round trained: the directory goes, the ledger says finished, and again changes nothing.
    _checkpoint(ledger, 5)
    code, done = _cli(ledger, "finish")
    assert code == 0 and done["done"] and done["removed"] and not features.exists()
    assert json.loads(ledger.read_text())["finished"]
    code, idle = _cli(ledger, "finish")
    assert code == 0 and not idle["changed"]
    code, state = _cli(ledger, "status")
    assert state["done"] and state["finished"] and "all 3 rounds trained (step 5/5)" in state["line"]
    assert json.loads(ledger.read_text())["peak_bytes"] == peak


def test_no_ledger_is_nothing_planned(tmp_path: Path) -> None:
    code, state = _cli(tmp_path / "run" / "rolling" / "ledger.json", "status")
    assert code == 0 and not state["planned"] and state["current_round"] is None


def test_a_ledger_is_kept_until_a_lower_budget_no_longer_holds_its_rounds(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path, 24576)
    old = json.loads(ledger.read_text())
    # The same budget, a larger one, and a smaller one its rounds still fit: kept.
    assert rolling.keep_ledger(old, _inputs(), 24576, 0) and rolling.keep_ledger(old, _inputs(), 10**9, 0)
    assert rolling.keep_ledger(old, _inputs(), 24576 - 1, 4)  # only round 3 (8 KiB + 8 KiB) is left
    assert not rolling.keep_ledger(old, _inputs(), 16384, 0)
    with pytest.raises(rolling.RollingError, match=r"other data or another recipe \{'seed': \(42, 7\)\}"):
        rolling.keep_ledger(old, _inputs(seed=7), 24576, 0)
    # Lowered to one sample a round after a kill at step 3 (inside round 2): round 1 stays, round 2 keeps
    # its trained step 3, steps 4 and 5 are planned again.
    replanned = json.loads(_ledger(tmp_path, 16384, old=old, checkpoint=3).read_text())
    assert [(r["first_step"], r["last_step"]) for r in replanned["rounds"]] == [
        (1, 2),
        (3, 3),
        (4, 4),
        (5, 5),
    ]
    assert replanned["rounds"][1]["cut_at_replan"] and replanned["replans"] == [
        {"at_step": 3, "budget_bytes": 16384, "previous_budget_bytes": 24576}
    ]
    assert rolling.current_round(replanned["rounds"], 3) == 2
    assert json.loads((ledger.parent / "round-002.json").read_text())["indices"] == [3]


def test_a_round_launch_resumes_and_stops_at_its_last_step() -> None:
    launcher = ["py", "-m", "regen.training.launcher", "start", "--status", "s.json"]
    trainer = ["py", "-m", "specforge.cli", "train", "--config", "run.yaml"]
    item = {"round": 1, "first_step": 5, "last_step": 8, "file": "round-001.json"}
    argv = rolling.launch_command(
        launcher, trainer, run_id=RUN, item=item, rounds=2, resume_from="/c/r-step4"
    )
    cut = argv.index("--")
    # The round is kept in the trainer's status; SpecForge's own feature checks are not turned off.
    assert argv[:6] == launcher and not any("SPECFORGE_VALIDATE" in a for a in argv)
    meta = json.loads(argv[argv.index("--meta") + 1])
    assert meta == {
        "run_id": RUN,
        "resume_from": "/c/r-step4",
        "round": 1,
        "rounds": 2,
        "round_first_step": 5,
        "round_last_step": 8,
    }
    assert argv[cut + 1 :] == [*trainer, "training.resume_from=/c/r-step4", "training.max_steps=8"]
    fresh = rolling.launch_command(launcher, trainer, run_id=RUN, item=item, rounds=2, resume_from=None)
    assert not any(a.startswith("training.resume_from=") for a in fresh)
    capture = rolling.capture_command(
        ["py", "-m", "regen.training.capture"], Path("/r/rolling/ledger.json"), item
    )
    assert capture[-2:] == ["--only", "/r/rolling/round-001.json"]


def test_the_driver_in_dry_run_shows_a_round_it_cannot_plan_yet(tmp_path: Path) -> None:
    """Check mode on a host without the tokenized data: nothing written, the first round's commands shown
    with a placeholder stop, and why it could not plan."""
    ledger = tmp_path / "run" / "rolling" / "ledger.json"
    code, shown = _cli(
        ledger,
        "run",
        "--features",
        str(tmp_path / "features"),
        "--data",
        str(tmp_path / "absent"),
        "--max-length",
        "64",
        "--budget-bytes",
        "100000",
        "--file-bytes-per-token",
        "100",
        "--total-steps",
        "5",
        "--capture",
        json.dumps(["py", "-m", "regen.training.capture"]),
        "--launcher",
        json.dumps(["py", "-m", "regen.training.launcher", "start"]),
        "--trainer",
        json.dumps(["specforge", "train"]),
        "--status",
        str(tmp_path / "status.json"),
        "--dry-run",
    )
    assert code == 0 and shown["dry_run"] and not shown["changed"] and shown["plan"] is None
    assert "run the tokenize stage first" in shown["plan_error"]
    assert shown["commands"]["capture"][-1] == str(ledger.parent / "round-000.json")
    assert "'training.max_steps=<last step of round 1>'" in shown["shell"]["launch"]
    assert not ledger.parent.exists() and not (tmp_path / "features").exists()


def test_a_damaged_feature_file_is_found_by_content_and_made_again(tmp_path: Path) -> None:
    # Issue 25: a feature file cut to 100 bytes passed `check` ("captured" meant size > 0) and was never
    # captured again. Now the capture's digest record decides, by sha256, before training reads it.
    ledger = _ledger(tmp_path, 24576)
    features = tmp_path / "features"
    assert _cli(ledger, "prepare", "--round", "0")[0] == 0
    _capture(features, [0, 5])
    assert _cli(ledger, "check", "--round", "0")[0] == 0
    with open(sample_path(features, 5), "r+b") as handle:
        handle.truncate(100)
    code, refused = _cli(ledger, "check", "--round", "0")
    assert code == 2 and "not what the capture wrote" in refused["msg"]
    assert "data_00000005.ckpt" in refused["msg"]
    assert sample_path(features, 5).stat().st_size == 0  # emptied: the next capture makes it again
    code, prepared = _cli(ledger, "prepare", "--round", "0")
    assert code == 0 and prepared["to_capture"] == 1
    # The same size, other bytes (a flipped bit): only the content digest sees it; prepare empties it.
    _capture(features, [5])
    data = bytearray(sample_path(features, 5).read_bytes())
    data[10] ^= 1
    sample_path(features, 5).write_bytes(bytes(data))
    code, prepared = _cli(ledger, "prepare", "--round", "0")
    assert code == 0 and prepared["damaged_files"] == ["data_00000005.ckpt"] and prepared["to_capture"] == 1
    # A file the record does not know (written by hand, or before the record existed) is not trusted.
    sample_path(features, 5).write_bytes(b"y" * 3000)
    code, refused = _cli(ledger, "check", "--round", "0")
    assert code == 2 and "data_00000005.ckpt" in refused["msg"]
    assert digests_path(features).exists() and digests_path(features).parent == features.parent


def test_a_missing_round_file_is_refused_with_the_fix(tmp_path: Path) -> None:
    # Issue 25: a missing round-NNN.json of a later round let `prepare` lay fewer names than samples and
    # exit 0 (SpecForge would then see another data set), and a traceback when it was the current round.
    ledger = _ledger(tmp_path, 24576)
    (ledger.parent / "round-002.json").unlink()
    code, refused = _cli(ledger, "prepare", "--round", "0")
    assert code == 2 and "round-002.json, the sample list of round 3, is missing" in refused["msg"]
    assert not (tmp_path / "features").exists() or not any((tmp_path / "features").iterdir())
    (ledger.parent / "round-000.json").unlink()
    for command in (["prepare", "--round", "0"], ["check", "--round", "0"]):
        code, refused = _cli(ledger, *command)
        assert code == 2 and "round-000.json, the sample list of round 1, is missing" in refused["msg"]
