"""The online (disaggregated) stack's planning: attempts, endpoints, capture flags, flow control, topology."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ansible.module_utils import regen_disagg as g
from ansible.module_utils.regen_training_topology import TopologyError, plan_topology

ROOT = Path(__file__).resolve().parents[2]
KIMI_DRAFT = json.loads((ROOT / "tests" / "fixtures" / "drafter" / "golden" / "kimi-k2.6.json").read_text())
RTX_PRO_6000 = 97887 * 1024 * 1024


def test_attempts_follow_what_happened_to_the_last_one() -> None:
    assert g.choose_attempt([], False, None, False)[0] == 1
    # Prepared but never claimed by a producer (the launch failed before SpecForge started): reused.
    assert g.choose_attempt([1], False, "failed", False)[0] == 1
    assert g.choose_attempt([1], True, "succeeded", False) == (1, "attempt 1 succeeded")
    assert g.choose_attempt([1, 2], True, "running", True)[0] == 2
    # A run that says "running" but whose supervisor is gone ended: SpecForge refuses its control path.
    number, reason = g.choose_attempt([1, 2], True, "running", False)
    assert number == 3 and "fresh control" in reason
    assert g.choose_attempt([3], True, "failed", False)[0] == 4
    assert g.attempt_numbers(["attempt-2", "attempt-10", "attempt-x", "notes"]) == [2, 10]


def test_attempt_paths_are_under_the_run() -> None:
    paths = g.attempt_paths("/w/runs/r", 2)
    assert paths["control_dir"] == "/w/runs/r/online/attempt-2/control"
    assert paths["consumer_state_dir"] == "/w/runs/r/online/attempt-2/consumer-state"
    # The file SpecForge's producer creates when it claims the attempt (_claim_fresh_control_path).
    assert paths["claim"].endswith("/control/refs.jsonl.producer_claim")


def test_endpoints_and_urls() -> None:
    assert g.mooncake_endpoints("127.0.0.1", 50051, 8080) == {
        "master_server_addr": "127.0.0.1:50051",
        "metadata_server": "http://127.0.0.1:8080/metadata",
        "local_hostname": "127.0.0.1",
        "protocol": "tcp",
    }
    six = g.mooncake_endpoints("fd00::1", 1, 2, "rdma")
    assert (
        six["master_server_addr"] == "[fd00::1]:1" and six["metadata_server"] == "http://[fd00::1]:2/metadata"
    )
    servers = [{"host": "cap1", "gpus": 8}]
    assert g.capture_urls(servers, {"cap1": "10.0.0.7"}, 30200) == ["http://10.0.0.7:30200"]
    with pytest.raises(g.DisaggPlanError, match="no address for capture host cap1"):
        g.capture_urls(servers, {}, 30200)
    with pytest.raises(g.DisaggPlanError, match="which no other host reaches"):
        g.check_reachable(["train1"], ["cap1"], "127.0.0.1")
    g.check_reachable(["one"], ["one"], "127.0.0.1")


def test_capture_flags_are_specforges_managed_local_line() -> None:
    args = g.sglang_capture_args([1, 12, 24], 4096)
    assert args == [
        "--skip-tokenizer-init",
        "--chunked-prefill-size",
        "-1",
        "--disable-radix-cache",
        "--enable-spec-capture",
        "--spec-capture-method",
        "dflash",
        "--spec-capture-aux-layer-ids",
        "1",
        "12",
        "24",
    ]
    # SGLang refuses input_len >= context_len - 6 (SpecForge's SGLANG_CAPTURE_CONTEXT_HEADROOM).
    assert g.capture_context_length(4096) == 4103
    # The capture_server role launches SGLang with the same flags.
    role = (ROOT / "roles" / "capture_server" / "tasks" / "sglang.yml").read_text()
    for flag in args[:-3]:
        assert f"'{flag}'" in role, flag


def test_flow_control_keeps_the_capture_segment_from_overflowing() -> None:
    # Kimi K2.6: 6 layers x 7168 x 2 B = 86,016 B per token; 6,152 tokens; 32 GiB segment, DP7 trainer.
    runtime, arithmetic = g.runtime_watermarks(32 << 30, 1, 6152, 86016, quantum=7)
    per_sample = 6152 * (86016 + 16)
    high = int((32 << 30) * 0.9) - 8 * per_sample
    assert runtime == {
        "producer_lease": 8,
        "resident_high_watermark_bytes": high,
        "resident_low_watermark_bytes": high * 3 // 4,
    }
    assert f"= {per_sample} B" in arithmetic and f"= {high} B" in arithmetic
    with pytest.raises(g.DisaggPlanError, match="drafter_training_online_segment_bytes"):
        g.runtime_watermarks(4 << 30, 1, 6152, 86016, quantum=7)


def test_online_steps_count_whole_global_windows() -> None:
    # SpecForge's resolve_online_total_steps: prompts x epochs // (ranks x batch x accumulation).
    assert g.online_total_steps(100, 1, 7, 1, 1) == 14
    assert g.online_total_steps(8, 2, 1, 1, 1) == 16
    assert g.online_total_steps(8, 1, 1, 1, 1, max_steps=3) == 3
    with pytest.raises(g.DisaggPlanError, match="no online optimizer step"):
        g.online_total_steps(3, 1, 4, 1, 1)


def _host(name: str, gpus: int) -> dict:
    return {"name": name, "gpus": gpus, "gpu_memory_bytes": RTX_PRO_6000 if gpus else None}


def test_one_server_beside_a_dp7_trainer_on_one_host() -> None:
    # SpecForge's one-server + DP7 layout: a target that needs one GPU, eight GPUs on the host.
    plan = plan_topology(
        "online",
        10**15,
        10**9,
        1000,
        capture_gpus_needed=1,
        capture_hosts=[_host("gpu8", 8)],
        train_hosts=[_host("gpu8", 8)],
        draft_config=KIMI_DRAFT,
        max_length=2048,
    )
    assert plan["mode"] == "online"
    assert plan["capture_servers"] == [{"host": "gpu8", "gpus": 1, "gpu_ids": [0]}]
    assert plan["trainer_gpus"] == 7 and plan["trainer_gpu_ids"] == {"gpu8": [1, 2, 3, 4, 5, 6, 7]}


def test_hosts_without_gpus_stream_from_a_cpu_capture_server() -> None:
    args = dict(
        capture_gpus_needed=None,
        capture_hosts=[_host("localhost", 0)],
        train_hosts=[_host("localhost", 0)],
        draft_config=KIMI_DRAFT,
        max_length=512,
    )
    plan = plan_topology("online", 10**6, 10**9, 10, **args)
    assert plan["mode"] == "online" and plan["capture_servers"] == [
        {"host": "localhost", "gpus": 0, "gpu_ids": []}
    ]
    assert "CPU" in plan["arithmetic"][-1]
    # auto captures offline when it fits; online on a CPU is only what the inventory asks for.
    assert plan_topology("auto", 10**6, 10**9, 10, **args)["mode"] == "offline"
    with pytest.raises(TopologyError, match="or online to stream them from a capture server on its CPU"):
        plan_topology("auto", 10**9, 10**6, 10, **args)
