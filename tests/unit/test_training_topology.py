"""The training topology: offline for the demo, rolling for CT200, online for a capture host + a trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ansible.module_utils.regen_drafter import FEATURE_FILE_OVERHEAD_BYTES, hidden_state_bytes_per_token
from ansible.module_utils.regen_training_topology import (
    TopologyError,
    draft_parameters,
    plan_topology,
    trainer_gpu_bytes,
)

ROOT = Path(__file__).resolve().parents[2]
KIMI_DRAFT = json.loads((ROOT / "tests" / "fixtures" / "drafter" / "golden" / "kimi-k2.6.json").read_text())
# RTX PRO 6000 Blackwell Server Edition: 97,887 MiB (the recorded nvidia-smi fixture).
RTX_PRO_6000 = 97887 * 1024 * 1024
TB = 10**12


def _kimi_offline_bytes(samples: int, tokens_per_sample: int) -> int:
    layers = len(KIMI_DRAFT["dflash_config"]["target_layer_ids"])
    # 6 layers x 7168 x 2 B = 86,016 B of hidden state per token, + 16 B of ids and loss mask.
    return samples * tokens_per_sample * (hidden_state_bytes_per_token(7168, layers) + 16)


def test_kimi_drafter_parameters_by_hand() -> None:
    # Per layer: q,o 7168*64*128*2 = 117,440,512; k,v 7168*8*128*2 = 14,680,064; q/k norms 256;
    # MLP 3*7168*18432 = 396,361,728; layer norms 2*7168 = 14,336 -> 528,496,896. Six layers,
    # fc 6*7168*7168 = 308,281,344, norm + hidden_norm 14,336.
    params = draft_parameters(KIMI_DRAFT)
    assert params["per_layer"] == 528_496_896
    assert params["trainable"] == 6 * 528_496_896 + 308_281_344 + 14_336 == 3_479_277_056
    assert params["frozen"] == 2 * 163840 * 7168


def test_a_kimi_trainer_fits_one_rtx_pro_6000() -> None:
    need, arithmetic = trainer_gpu_bytes(KIMI_DRAFT, max_length=4096, batch_size=1, world_size=1)
    # 3,479,277,056 x 16 B = 51.85 GiB; frozen 2*163840*7168 x 2 B = 4.38 GiB; activations 4096*7168*6*34 B
    # = 5.58 GiB; logits 4096*163840*8 B = 5.00 GiB: 66.8 GiB, under 90% of the card's 95.6 GiB.
    assert need == 3_479_277_056 * 16 + 2 * 163840 * 7168 * 2 + 4096 * 7168 * 6 * 34 + 4096 * 163840 * 8
    assert need < RTX_PRO_6000 * 0.9
    assert "3.48B trainable params" in arithmetic and "per trainer GPU" in arithmetic


def _host(name: str, gpus: int, memory: int | None = RTX_PRO_6000) -> dict:
    return {"name": name, "gpus": gpus, "gpu_memory_bytes": memory}


def test_ct200_trains_rolling() -> None:
    # One host, 8 GPUs, all of which the INT4 target needs (the serving plan's TP 8); 100,000 samples
    # of 4,096 tokens is 35 TB of hidden states against a 3 TB budget.
    offline = _kimi_offline_bytes(100_000, 4096)
    plan = plan_topology(
        "auto",
        offline,
        3 * TB,
        100_000,
        capture_gpus_needed=8,
        capture_hosts=[_host("ct200", 8)],
        train_hosts=[_host("ct200", 8)],
        draft_config=KIMI_DRAFT,
        max_length=4096,
    )
    assert plan["mode"] == "rolling", plan
    # A feature file is the sample's features plus torch.save's container (4 KiB counted).
    per_file = offline / 100_000 + FEATURE_FILE_OVERHEAD_BYTES
    assert plan["shard_samples"] == int(3 * TB // per_file)
    assert plan["disk_budget_bytes"] == 3 * TB
    assert plan["rounds"] == -(-100_000 // plan["shard_samples"]) >= 2
    assert "no host has GPUs for both at once" in plan["reason"]
    assert any("rounds" in line for line in plan["arithmetic"])


def test_a_capture_host_beside_a_trainer_host_trains_online() -> None:
    offline = _kimi_offline_bytes(100_000, 4096)
    plan = plan_topology(
        "auto",
        offline,
        3 * TB,
        100_000,
        capture_gpus_needed=8,
        capture_hosts=[_host("capture1", 8)],
        train_hosts=[_host("train1", 8)],
        draft_config=KIMI_DRAFT,
        max_length=4096,
    )
    assert plan["mode"] == "online", plan
    assert plan["capture_servers"] == [{"host": "capture1", "gpus": 8, "gpu_ids": list(range(8))}]
    assert plan["trainer_gpus"] == 8 and plan["trainer_gpu_ids"] == {"train1": list(range(8))}
    assert "a capture server fits beside the trainer" in plan["reason"]


def test_data_that_fits_the_disk_trains_offline() -> None:
    # The demo's order of magnitude: a few hundred samples of a 64-wide model, a disk with room.
    plan = plan_topology(
        "auto",
        40 * 1024**2,
        10 * 1024**3,
        200,
        capture_gpus_needed=None,
        capture_hosts=[_host("localhost", 0, None)],
        train_hosts=[_host("localhost", 0, None)],
        draft_config=dict(
            KIMI_DRAFT,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=4096,
        ),
        max_length=512,
    )
    assert plan["mode"] == "offline" and plan["rounds"] == 1 and "fit the disk budget" in plan["reason"]


def test_forced_modes_and_refusals_say_what_to_change() -> None:
    args = dict(
        capture_hosts=[_host("ct200", 8)],
        train_hosts=[_host("ct200", 8)],
        draft_config=KIMI_DRAFT,
        max_length=4096,
    )
    offline = _kimi_offline_bytes(100_000, 4096)
    with pytest.raises(TopologyError, match="add a capture host"):
        plan_topology("online", offline, 3 * TB, 100_000, capture_gpus_needed=8, **args)
    with pytest.raises(TopologyError, match="offline hidden states need"):
        plan_topology("offline", offline, 3 * TB, 100_000, capture_gpus_needed=8, **args)
    with pytest.raises(TopologyError, match=r"cannot hold even one optimizer step: its 1 sample\(s\) take"):
        plan_topology("rolling", offline, 1000, 100_000, capture_gpus_needed=8, **args)
    with pytest.raises(TopologyError, match="no capture host has the 16 GPU"):
        plan_topology("auto", offline, 3 * TB, 100_000, capture_gpus_needed=16, **args)
    # A CPU host (the demo) whose disk budget is too small: rolling is only planned when asked for.
    with pytest.raises(TopologyError, match=r"facts show no GPUs.*set drafter_training_topology: rolling"):
        plan_topology(
            "auto",
            offline,
            3 * TB,
            100_000,
            capture_gpus_needed=None,
            capture_hosts=[_host("localhost", 0, None)],
            train_hosts=[_host("localhost", 0, None)],
            draft_config=KIMI_DRAFT,
            max_length=4096,
        )
    with pytest.raises(TopologyError, match="choose one of auto, offline, online, rolling"):
        plan_topology("streaming", offline, 3 * TB, 100_000, capture_gpus_needed=8, **args)


def test_rolling_shards_hold_whole_optimizer_steps_over_every_epoch() -> None:
    # 1,000 samples of 1,000 tokens of a 64-wide, one-layer drafter's features (144 B/token in the file),
    # batch 2 x accumulation 2 x 2 ranks = 8 samples per step; 2 epochs of 1,000 samples = 250 steps.
    per_token = hidden_state_bytes_per_token(64, 1) + 16
    offline = 1000 * 1000 * per_token
    per_file = 1000 * per_token + FEATURE_FILE_OVERHEAD_BYTES
    small = dict(
        KIMI_DRAFT,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=4096,
    )
    budget = 30 * per_file + 5  # room for 30 files: 3 whole steps of 8
    plan = plan_topology(
        "rolling",
        offline,
        budget,
        1000,
        capture_gpus_needed=None,
        capture_hosts=[_host("localhost", 0, None)],
        train_hosts=[_host("localhost", 0, None)],
        draft_config=small,
        max_length=1000,
        samples_per_step=8,
        total_steps=250,
    )
    assert plan["shard_samples"] == 24 and plan["rounds"] == -(-2000 // 24) == 84
    assert "2000 samples read over the run (8 per optimizer step)" in plan["arithmetic"][1]
    with pytest.raises(TopologyError, match=r"one optimizer step: its 8 sample\(s\)"):
        plan_topology(
            "rolling",
            offline,
            7 * per_file,
            1000,
            capture_gpus_needed=None,
            capture_hosts=[_host("localhost", 0, None)],
            train_hosts=[_host("localhost", 0, None)],
            draft_config=small,
            max_length=1000,
            samples_per_step=8,
            total_steps=250,
        )
