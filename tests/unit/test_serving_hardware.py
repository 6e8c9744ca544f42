"""Golden launch lines for real models on real GPU generations, each accepted by SGLang 0.5.23's own parser.

Every input is real: the model's config.json from tests/fixtures/configs (introspected by the same
`read_model_dir` the model_facts role runs), the GPU facts parsed by gpu_info's parser from a recorded
`nvidia-smi` table in tests/fixtures/nvidia-smi, the plan computed by module_utils/regen_plan.py and the
launch line by module_utils/regen_serving.py, exactly the chain the introspect and serve stages run.

* sm_120: `rtx-pro-6000-maxq-2gpu-table.txt` (RTX PRO 6000 Blackwell, 97,887 MiB, as on CT200). The post
  shows two GPUs; an 8-GPU host repeats the same record with indices 0..7 (CT200 has eight of them).
  No `nvidia-smi topo -m` of such a box is recorded, so the interconnect is unknown here and the PCIe
  NCCL environment (tests/unit/test_serving_golden.py checks it) is not derived.
* sm_100: `b200-table-driver580.txt` (8x B200, 183,359 MiB; the post was cut after GPU 1, the same
  repetition gives the eight GPUs its header names).
* sm_90: `h200-table-driver580.txt` (one H200, 143,771 MiB, recorded on a lent GPU machine; an 8x H200
  HGX host repeats the same record with indices 0..7).

Models: Kimi K2.5 (INT4 compressed-tensors; tests/fixtures/configs has no Kimi K2.6, see its README),
DeepSeek-V3 (FP8), dense Qwen3-8B and a dense NVFP4 checkpoint with an FP8 KV cache (llama-70b-nvfp4: the
Llama 70B config with the quantization and index total_size nvidia's Llama-3.3-70B-Instruct-FP4 checks;
the plan names `--kv-cache-dtype fp8_e4m3` for it). Tokenizer facts are only the part the plan reads
(whether think tokens exist): Kimi K2.5 and Qwen3 have `<think>`, DeepSeek-V3 and Llama not. No prompt-set
statistics: the context length is the length budget of a plan from the config alone (2,048 assumed prompt
tokens + 4,096 + 8 = 6,152).

After an intended change: `REGEN_UPDATE_GOLDEN=1 pytest tests/unit/test_serving_hardware.py`, review
the diff of tests/fixtures/serving/hardware/*.argv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
SMI = ROOT / "tests" / "fixtures" / "nvidia-smi"
SERVING = ROOT / "tests" / "fixtures" / "serving"
GOLDEN = SERVING / "hardware"

from ansible.module_utils import regen_serving
from ansible.module_utils.regen_config import read_model_dir
from ansible.module_utils.regen_gpu import summarize
from ansible.module_utils.regen_plan import make_plan

from tests.helpers.nvidia_smi import parse_table

GPUS = {
    "sm120": ("rtx-pro-6000-maxq-2gpu-table.txt", "12.0"),
    "sm100": ("b200-table-driver580.txt", "10.0"),
    "sm90": ("h200-table-driver580.txt", "9.0"),
}
# (case, config dir, think tokens, GPU generation, GPU count, expected attention backend)
CASES = [
    ("kimi-k2.5-int4-8x-sm120", "kimi-k2.5", True, "sm120", 8, "flashinfer"),
    ("kimi-k2.5-int4-8x-sm100", "kimi-k2.5", True, "sm100", 8, "trtllm_mla"),
    ("deepseek-v3-8x-sm120", "deepseek-v3", False, "sm120", 8, "flashinfer"),
    ("deepseek-v3-8x-sm100", "deepseek-v3", False, "sm100", 8, "trtllm_mla"),
    ("qwen3-8b-1x-sm120", "qwen3-8b", True, "sm120", 1, "flashinfer"),
    ("qwen3-8b-1x-sm100", "qwen3-8b", True, "sm100", 1, "trtllm_mha"),
    ("llama-70b-nvfp4-8x-sm120", "llama-70b-nvfp4", False, "sm120", 8, "flashinfer"),
    ("llama-70b-nvfp4-8x-sm100", "llama-70b-nvfp4", False, "sm100", 8, "trtllm_mha"),
    ("kimi-k2.5-int4-8x-sm90", "kimi-k2.5", True, "sm90", 8, "fa3"),
    ("deepseek-v3-8x-sm90", "deepseek-v3", False, "sm90", 8, "fa3"),
    ("qwen3-8b-1x-sm90", "qwen3-8b", True, "sm90", 1, "fa3"),
    # The real Kimi K2.6 NVFP4 config (and its hf_quant_config.json) from the pinned aiconfigurator-core
    # wheel (tests/fixtures/configs/README.md names the file and its sha256).
    ("kimi-k2.6-nvfp4-8x-sm120", "kimi-k2.6-nvfp4", True, "sm120", 8, "flashinfer"),
    ("kimi-k2.6-nvfp4-8x-sm100", "kimi-k2.6-nvfp4", True, "sm100", 8, "trtllm_mla"),
    ("kimi-k2.6-nvfp4-8x-sm90", "kimi-k2.6-nvfp4", True, "sm90", 8, "fa3"),
]
# (case) -> (--quantization, --moe-runner-backend, --kv-cache-dtype) the MoE and KV dtype tables name
# (module_utils/regen_kernel_tables.py); None: the flag stays off.
KERNELS = {
    "kimi-k2.6-nvfp4-8x-sm120": ("modelopt_fp4", "flashinfer_cutlass", "bf16"),
    "kimi-k2.6-nvfp4-8x-sm100": ("modelopt_fp4", "flashinfer_trtllm", "fp8_e4m3"),
    "kimi-k2.6-nvfp4-8x-sm90": ("modelopt_fp4", "marlin", "fp8_e4m3"),
    "kimi-k2.5-int4-8x-sm120": (None, "marlin", "bf16"),
    "kimi-k2.5-int4-8x-sm100": (None, "flashinfer_trtllm", None),
    "kimi-k2.5-int4-8x-sm90": (None, "marlin", None),
}


def gpu_facts(generation: str, count: int) -> dict:
    table, _cc = GPUS[generation]
    gpus, driver, cuda = parse_table((SMI / table).read_text(encoding="utf-8"))
    eight = [dict(gpus[i % len(gpus)], index=i) for i in range(count)]
    return summarize(eight, driver=driver, cuda=cuda)


def facts_for(model: str, think: bool, generation: str, count: int) -> dict:
    architecture = read_model_dir(str(CONFIGS / model))
    gpu = gpu_facts(generation, count)
    tokenizer = {"think_tokens": ["<think>", "</think>"]} if think else {}
    plan = make_plan(architecture, tokenizer, gpu)
    return {"architecture": architecture, "environment": {"gpu": gpu}, "plan": plan}


def render(case: tuple) -> dict:
    _name, model, think, generation, count, _backend = case
    spec = {
        "backend": "sglang",
        "name": "main",
        "model_path": f"/root/models/{model}",
        "python": "/root/venv_sglang/bin/python",
        "facts": facts_for(model, think, generation, count),
        "host": "127.0.0.1",
        "port": 30000,
        "gpu_count": count,
    }
    return regen_serving.plan_server(spec)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_golden_launch_line(case):
    plan = render(case)
    argv = plan["argv"]
    golden = GOLDEN / f"{case[0]}.argv"
    if os.environ.get("REGEN_UPDATE_GOLDEN") == "1":
        GOLDEN.mkdir(exist_ok=True)
        golden.write_text("\n".join(argv) + "\n")
    assert golden.exists(), f"{golden} missing; run with REGEN_UPDATE_GOLDEN=1 and review it"
    assert argv == golden.read_text().splitlines()
    # The attention backend is named and comes from the plan's table row, with its sources.
    assert argv[argv.index("--attention-backend") + 1] == case[5]
    setting = plan["settings"]["attention_backend"]
    assert setting["source"] == "plan" and "backend table row" in setting["reason"]


def test_the_gpu_facts_come_from_the_recorded_tables():
    for generation, (_table, cc) in GPUS.items():
        gpu = gpu_facts(generation, 8)
        assert gpu["count"] == 8 and gpu["compute_capabilities"] == [cc]
    assert gpu_facts("sm120", 8)["memory_per_gpu_bytes"] == 97887 * 1024 * 1024


def test_what_the_plan_says_about_fit_on_each_host():
    fits = {case[0]: render(case)["settings"] for case in CASES}
    # DeepSeek-V3's FP8 weights (~627 GiB) leave no room for 65,536 KV tokens on 8x 96 GB at 0.85: the
    # plan says so rather than pretending; on B200 Kimi K2.5 INT4 fits at TP4, so two replicas.
    plans = {case[0]: facts_for(*case[1:5])["plan"]["serving"] for case in CASES}
    assert plans["deepseek-v3-8x-sm120"]["fits"]["value"] is False
    assert "does not fit" in plans["deepseek-v3-8x-sm120"]["fits"]["reason"]
    assert {k: v["fits"]["value"] for k, v in plans.items() if k != "deepseek-v3-8x-sm120"} == dict.fromkeys(
        [c[0] for c in CASES if c[0] != "deepseek-v3-8x-sm120"], True
    )
    kimi_b200 = fits["kimi-k2.5-int4-8x-sm100"]
    assert (kimi_b200["tp_size"]["value"], kimi_b200["dp_size"]["value"]) == (4, 2)


def test_the_sm120_mla_lines_avoid_trtllm_mla():
    for case in CASES:
        if case[3] == "sm120":
            assert "trtllm_mla" not in render(case)["argv"], case[0]


@pytest.fixture(scope="module")
def sglang_python():
    sys.path.insert(0, str(SERVING))
    from sglang_venv import VenvError, sglang_venv_python

    try:
        return sglang_venv_python()
    except VenvError as exc:
        pytest.fail(str(exc))


def test_every_golden_line_parses_with_sglangs_parser_and_means_the_plan(sglang_python):
    plans = [render(case) for case in CASES]
    items = [{"kind": "server", "argv": plan["argv"][3:]} for plan in plans]
    # A line with a backend SGLang does not know must fail, or this check could not.
    items.append({"kind": "server", "argv": [*plans[0]["argv"][3:], "--attention-backend", "made_up"]})
    proc = subprocess.run(
        [str(sglang_python), str(SERVING / "sglang_parse_argv.py")],
        input=json.dumps(items),
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert not results[-1]["ok"]
    for case, plan, result in zip(CASES, plans, results[:-1], strict=True):
        assert result["ok"], f"{case[0]}: SGLang rejected {plan['command_line']}: {result['error']}"
        values = result["values"]
        settings = {k: v["value"] for k, v in plan["settings"].items()}
        assert values["attention_backend"] == settings["attention_backend"] == case[5]
        for key in ("tp_size", "ep_size", "dp_size", "attn_dp_size", "context_length"):
            assert values[key] == settings[key], (case[0], key)
        # The KV dtype of the (backend, KV dtype) table reaches SGLang: the NVFP4 checkpoints' declared FP8
        # where the backend reads it natively, bf16 under FlashInfer MLA (sm_120), else SGLang's `auto`.
        assert values["kv_cache_dtype"] == (settings["kv_cache_dtype"] or "auto"), case[0]
        if "llama-70b-nvfp4" in case[0]:
            assert values["kv_cache_dtype"] == "fp8_e4m3", case[0]
        quantization, runner, kv = KERNELS.get(case[0], (None, settings.get("moe_runner_backend"), None))
        if case[0] in KERNELS:
            assert values["kv_cache_dtype"] == (kv or "auto"), case[0]
        assert values["quantization"] == quantization == settings["quantization"], case[0]
        assert values["moe_runner_backend"] == (runner or "auto"), case[0]
        assert values["cuda_graph_max_bs_decode"] == settings["cuda_graph_max_bs"], case[0]
        assert values["mem_fraction_static"] == pytest.approx(settings["mem_fraction_static"])
        assert values["reasoning_parser"] == settings["reasoning_parser"]
        assert values["tool_call_parser"] == settings["tool_call_parser"]
