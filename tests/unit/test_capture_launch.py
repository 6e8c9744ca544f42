"""Golden launch lines of the SGLang capture server (role capture_server, backend sglang) and SGLang 0.5.14's
flags.

The line is what role capture_server asks role sglang_server to launch: the serving plan's line
(`regen_serving.plan_server`, from the facts) with the capture server's context (`max_length + 7`), port,
GPUs and MOONCAKE_* environment, then SpecForge's capture flags (`regen_disagg.sglang_capture_args`). Each
case's expected argv and environment are in tests/fixtures/serving/capture/<case>.argv / .env.json; after
an intended change, regenerate with `REGEN_UPDATE_GOLDEN=1 pytest tests/unit/test_capture_launch.py` and
review the diff. Every flag of every line, and its value's kind, must be one SGLang 0.5.14 with SpecForge's
spec-capture patch defines (tests/fixtures/serving/sglang_flags.py reads them from its server_args.py,
since its parser does not import on this CPU-only machine).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from ansible.module_utils import regen_disagg, regen_serving
from ansible.module_utils.regen_plan import dflash_target_layer_ids

ROOT = Path(__file__).resolve().parents[2]
SERVING = ROOT / "tests" / "fixtures" / "serving"
GOLDEN = SERVING / "capture"
sys.path.insert(0, str(SERVING))

import sglang_flags

KIMI_LAYERS = [1, 12, 24, 35, 47, 58]  # SpecForge's published Kimi DFlash drafter (the plan's)


def _spec(facts: str, layers: list[int], max_length: int, host: str, master: str, own: str, **extra) -> dict:
    endpoints = regen_disagg.mooncake_endpoints(master, 50051, 8080)
    return {
        "backend": "sglang",
        "name": "capture",
        "model_path": extra.pop("model_path"),
        "python": "/root/venv_capture/bin/python",
        "facts": json.loads((SERVING / facts).read_text()),
        "overrides": {"context_length": regen_disagg.capture_context_length(max_length)},
        "host": host,
        "port": 30200,
        "env": regen_disagg.capture_environment(endpoints, 32 << 30, 64 << 20, own),
        "extra_args": regen_disagg.sglang_capture_args(layers, max_length),
        **extra,
    }


CASES = {
    # Kimi K2.6 on a capture host of 8x RTX PRO 6000 (sm_120, 10.1.2.202): TP8 EP8, the Mooncake master on
    # the training host's private address (10.1.2.201), the capture segment on the capture host's. The HTTP
    # server itself listens on loopback: SpecForge 0.2.0's producer sends no
    # API key (SGLangServerCaptureAdapter posts without headers) and the serving role refuses a reachable
    # address without one, so a producer on another host reaches it through a tunnel.
    "kimi-k2.6-capture-ep8": _spec(
        "facts-kimi-k2.6.json",
        KIMI_LAYERS,
        6152,
        "127.0.0.1",
        "10.1.2.201",
        "10.1.2.202",
        model_path="/root/models/Kimi-K2.6",
        gpu_count=8,
    ),
    # SpecForge's one-server + DP7 layout: a Qwen3-8B capture server on GPU 0 of an 8-GPU host whose
    # other seven GPUs train; everything on loopback.
    "qwen3-8b-capture-gpu0": _spec(
        "facts-qwen3-8b.json",
        dflash_target_layer_ids(36, 5),
        4096,
        "127.0.0.1",
        "127.0.0.1",
        "127.0.0.1",
        model_path="/root/models/Qwen3-8B",
        gpu_count=1,
        gpu_ids=[0],
    ),
}


@pytest.fixture(scope="module")
def flags() -> dict:
    return sglang_flags.flag_table(sglang_flags.patched_server_args())


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_capture_line(case: str, flags: dict) -> None:
    plan = regen_serving.plan_server(dict(CASES[case]))
    argv, env = plan["argv"], plan["env"]
    golden_argv, golden_env = GOLDEN / f"{case}.argv", GOLDEN / f"{case}.env.json"
    if os.environ.get("REGEN_UPDATE_GOLDEN") == "1":
        golden_argv.write_text("\n".join(argv) + "\n")
        golden_env.write_text(json.dumps(env, indent=2, sort_keys=True) + "\n")
    assert argv == golden_argv.read_text().splitlines()
    assert env == json.loads(golden_env.read_text())
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert sglang_flags.problems(argv[3:], flags) == []


def test_the_kimi_line_captures_what_the_trainer_reads() -> None:
    argv = regen_serving.plan_server(dict(CASES["kimi-k2.6-capture-ep8"]))["argv"]
    flag = argv.index("--spec-capture-aux-layer-ids")
    assert argv[flag + 1 :] == [str(layer) for layer in KIMI_LAYERS]
    assert argv[argv.index("--spec-capture-method") + 1] == "dflash"
    # SGLang refuses a prompt of input_len >= context_len - 6: max_length 6152 needs 6159.
    assert argv[argv.index("--context-length") + 1] == "6159"
    assert argv[argv.index("--chunked-prefill-size") + 1] == "-1" and "--skip-tokenizer-init" in argv
    assert (argv[argv.index("--tp-size") + 1], argv[argv.index("--ep-size") + 1]) == ("8", "8")


def test_the_flag_check_can_fail(flags: dict) -> None:
    # Without this the golden test could pass against a table that accepts anything.
    assert sglang_flags.problems(["--model-path", "/m", "--bogus-flag"], flags) == [
        "--bogus-flag is not a flag of SGLang 0.5.14"
    ]
    assert sglang_flags.problems(["--enable-spec-capture", "yes", "--tp-size", "eight"], flags) == [
        "--enable-spec-capture is a switch but got ['yes']",
        "--tp-size takes an integer, got 'eight'",
    ]
    assert sglang_flags.problems(["--spec-capture-aux-layer-ids"], flags) == [
        "--spec-capture-aux-layer-ids needs at least one value"
    ]
    # Unpatched SGLang 0.5.14 has no capture flags at all: the patch is what adds them.
    import zipfile

    with zipfile.ZipFile(sglang_flags.wheel()) as archive:
        plain = sglang_flags.flag_table(archive.read("sglang/srt/server_args.py").decode())
    assert "--enable-spec-capture" not in plain and "--skip-tokenizer-init" in plain


def test_the_kimi_k26_nvfp4_capture_line_on_sm120_names_the_moe_kernels_0_5_14_needs(flags: dict) -> None:
    # SGLang 0.5.14 (the capture server) picks flashinfer_cutlass for NVFP4 experts on sm_120 only when
    # --quantization modelopt_fp4 is on the line (server_args.py _handle_moe_kernel_config); its `auto`
    # otherwise resolves to the SM100-only trtllm-gen kernels. The real K2.6 NVFP4 config, planned live.
    from ansible.module_utils.regen_config import read_model_dir
    from ansible.module_utils.regen_gpu import described
    from ansible.module_utils.regen_plan import make_plan

    arch = read_model_dir(str(ROOT / "tests" / "fixtures" / "configs" / "kimi-k2.6-nvfp4"))
    gpu = dict(described(8, 97887 * 1024**2, "12.0"), interconnect="pcie")
    facts = {"architecture": arch, "environment": {"gpu": gpu},
             "plan": make_plan(arch, {"think_tokens": ["<think>"]}, gpu)}
    spec = dict(CASES["kimi-k2.6-capture-ep8"], facts=facts, model_path="/root/models/Kimi-K2.6-NVFP4")
    plan = regen_serving.plan_server(spec)
    argv = plan["argv"]
    assert argv[argv.index("--quantization") + 1] == "modelopt_fp4"
    assert argv[argv.index("--moe-runner-backend") + 1] == "flashinfer_cutlass"
    assert argv[argv.index("--kv-cache-dtype") + 1] == "bf16"
    assert sglang_flags.problems(argv[3:], flags) == []
    # The NCCL decision reaches the capture server's environment too (PCIe-only sm_120, not measured).
    assert plan["env"]["NCCL_P2P_DISABLE"] == "1"
