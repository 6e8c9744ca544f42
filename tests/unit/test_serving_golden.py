"""Golden launch lines: the argv the sglang_server role renders for known deployments.

Each case is `tests/fixtures/serving/<case>.spec.json` (the planner's input: facts fixture, inventory
overrides, host facts) and `<case>.argv` (the expected argv, one element per line). The expected files
were written by hand-checking the rendered line against SGLang 0.5.23's flags; test_serving_argv.py
parses the same lines with SGLang's own parser. After an intended change, regenerate with
`REGEN_UPDATE_GOLDEN=1 pytest tests/unit/test_serving_golden.py` and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "serving"

from ansible.module_utils import regen_serving

CASES = sorted(p.name[: -len(".spec.json")] for p in FIXTURES.glob("*.spec.json"))


def render(case: str) -> dict:
    """The plan for a golden case, exactly as the role's module computes it."""
    doc = json.loads((FIXTURES / f"{case}.spec.json").read_text())
    spec = dict(doc["spec"])
    if doc.get("facts_file"):
        spec["facts"] = json.loads((FIXTURES / doc["facts_file"]).read_text())
    if doc["kind"] == "router":
        return regen_serving.plan_router(spec)
    return regen_serving.plan_server(spec)


def test_the_required_cases_exist():
    # The "done means": Kimi K2.6 EP8, DeepSeek-V3 TP8, dense Qwen3 TP1, a two-node plan (+ router).
    assert {"kimi-k2.6-ep8", "deepseek-v3-tp8", "qwen3-8b-tp1", "kimi-k2.6-two-node-rank1",
            "router-two-workers"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_golden_launch_line(case):
    argv = render(case)["argv"]
    golden = FIXTURES / f"{case}.argv"
    if os.environ.get("REGEN_UPDATE_GOLDEN") == "1":
        golden.write_text("\n".join(argv) + "\n")
    assert golden.exists(), f"{golden} missing; run with REGEN_UPDATE_GOLDEN=1 and review it"
    assert argv == golden.read_text().splitlines()


def _flag(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_kimi_ep8_takes_parallelism_and_parsers_from_the_facts():
    plan = render("kimi-k2.6-ep8")
    argv = plan["argv"]
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert (_flag(argv, "--tp-size"), _flag(argv, "--ep-size")) == ("8", "8")
    assert _flag(argv, "--reasoning-parser") == _flag(argv, "--tool-call-parser") == "kimi_k2"
    assert plan["settings"]["ep_size"]["source"] == "plan"
    assert _flag(argv, "--attention-backend") == "flashinfer"  # sm_120 MLA: the table's row sm120-mla
    assert plan["settings"]["attention_backend"]["source"] == "plan"
    assert plan["settings"]["context_length"]["source"] == "override"
    assert plan["endpoint"] == "http://127.0.0.1:30000"
    assert plan["readiness"] == {"method": "GET", "path": "/health_generate"}
    assert plan["gpus_per_node"] == 8
    # Derived from the GPU facts (8x sm_120 on PCIe only): the arch list and NCCL without peer-to-peer.
    assert plan["env"] == {"TORCH_CUDA_ARCH_LIST": "12.0", "NCCL_P2P_DISABLE": "1", "HF_HUB_OFFLINE": "1",
                           "HF_HUB_DISABLE_TELEMETRY": "1"}
    assert plan["settings"]["nccl_env"]["source"] == "facts"


def test_api_key_travels_in_a_config_file_not_in_argv():
    plan = render("deepseek-v3-tp8")
    assert "--api-key" not in plan["argv"]
    assert _flag(plan["argv"], "--config") == "/root/regen/serving/deepseek.secret.yaml"
    router = render("router-two-workers")
    # sglang-router 0.3.2 has no config file or environment variable for its key: the role's launcher
    # (the router's own parse_router_args + launch_router) reads it from the environment instead.
    assert "--api-key" not in router["argv"]
    assert not any("REGEN_SERVING_API_KEY}" in a for a in router["argv"])
    assert router["argv"][1:3] == ["-c", regen_serving.ROUTER_LAUNCHER]
    assert "os.environ.pop('REGEN_SERVING_API_KEY'" in router["argv"][2]
    assert (_flag(router["argv"], "--prometheus-host"), _flag(router["argv"], "--prometheus-port")) == (
        "127.0.0.1", "29000")


def test_two_node_ranks_differ_only_in_node_rank_and_rank0_serves_the_api():
    doc = json.loads((FIXTURES / "kimi-k2.6-two-node-rank1.spec.json").read_text())
    spec = dict(doc["spec"], facts=json.loads((FIXTURES / doc["facts_file"]).read_text()))
    rank1 = regen_serving.plan_server(spec)
    rank0 = regen_serving.plan_server(dict(spec, node_rank=0))
    diff = [(a, b) for a, b in zip(rank0["argv"], rank1["argv"], strict=True) if a != b]
    assert diff == [("0", "1")]
    assert rank0["serves_api"] and rank0["endpoint"] == "http://127.0.0.1:30000"
    assert not rank1["serves_api"] and rank1["endpoint"] is None and rank1["readiness"] is None
    assert rank1["gpus_per_node"] == 8


def test_config_hash_changes_with_the_launch_line_only():
    a, b = render("kimi-k2.6-ep8"), render("kimi-k2.6-ep8")
    assert a["config_hash"] == b["config_hash"]
    doc = json.loads((FIXTURES / "kimi-k2.6-ep8.spec.json").read_text())
    spec = dict(doc["spec"], facts=json.loads((FIXTURES / doc["facts_file"]).read_text()))
    spec["port"] = 30001
    assert regen_serving.plan_server(spec)["config_hash"] != a["config_hash"]


def test_the_model_facts_plan_drives_the_launch_line():
    """Contract with the model_facts role: its real planner (module_utils/regen_plan.py) over the Kimi
    config fixture and CT200's GPU facts yields the keys this role reads, and they land in the line."""
    from ansible.module_utils import regen_config, regen_plan

    config = json.loads((ROOT / "tests" / "fixtures" / "configs" / "kimi-k2.5" / "config.json").read_text())
    architecture = regen_config.normalize_config(config)
    architecture["weight_bytes"] = 594 * 10**9  # the INT4 checkpoint's size (the fixture has no weights)
    gpu = {"count": 8, "memory_per_gpu_bytes": 96 * 10**9, "compute_capabilities": ["12.0"],
           "interconnect": "pcie"}
    facts = {"architecture": architecture, "environment": {"gpu": gpu},
             "plan": regen_plan.make_plan(architecture, {"think_tokens": ["<think>"]}, gpu)}
    spec = {"backend": "sglang", "model_path": "/root/models/Kimi-K2.6",
            "python": "/root/venv_sglang/bin/python", "facts": facts, "gpu_count": 8}
    plan = regen_serving.plan_server(spec)
    argv = plan["argv"]
    assert (_flag(argv, "--tp-size"), _flag(argv, "--ep-size")) == ("8", "8")
    assert _flag(argv, "--reasoning-parser") == _flag(argv, "--tool-call-parser") == "kimi_k2"
    # The static share keeps the stated margin free: 96e9 B = 91,553 MiB per GPU (SGLang's < 90 GiB class:
    # 8,192 chunked-prefill tokens at TP8), decode graphs only up to the planned concurrency (16), margin
    # 512 + 1.5 x 8,192 + 2 x 16 + 1,024 x 8/8 + 1,536 (MLA) = 15,392 MiB;
    # 1 - 15,392 / 91,553 = 0.8319 -> 0.83.
    assert _flag(argv, "--mem-fraction-static") == "0.83"
    assert _flag(argv, "--cuda-graph-max-bs-decode") == "16"
    # INT4 (compressed-tensors W4A16) experts off sm_100: the MoE table's Marlin; the quantization flag is
    # left to the checkpoint. FlashInfer MLA reads a bf16 cache (the KV dtype table).
    assert _flag(argv, "--moe-runner-backend") == "marlin" and "--quantization" not in argv
    assert _flag(argv, "--kv-cache-dtype") == "bf16"
    # The context length is the plan's length budget: no prompt statistics, so 2,048 assumed prompt tokens
    # + 1 turn x (4,096 max_tokens + 8 template tokens) = 6,152.
    assert _flag(argv, "--context-length") == "6152"
    assert plan["settings"]["context_length"]["source"] == "plan"
    # MLA on sm_120: the backend table's FlashInfer, never TRT-LLM MLA (Unsupported architecture there).
    assert _flag(argv, "--attention-backend") == "flashinfer"
    assert "--dp-size" not in argv and "--device" not in argv
    for key in ("tp_size", "ep_size", "dp_size", "device", "mem_fraction_static", "reasoning_parser",
                "tool_call_parser", "attention_backend"):
        assert plan["settings"][key]["source"] == "plan", key
    assert plan["env"]["NCCL_P2P_DISABLE"] == "1"
