"""Failures public reports have already explained: the log line (or the output) they show, and the fix.

Two tables of data, each row with its public source, for readiness diagnosis and the quality gate:

* LOG_SIGNATURES: a regex over the server log, what it means and what to change. `match_log(text)`
  returns a `regen.serving.cause.Cause`; `diagnose.diagnose` asks it first (these are more specific
  than the generic causes there, e.g. "Unsupported architecture" would otherwise surface as a plain
  exception), so the readiness wait of the sglang_server role shows the cause, the fix and its source.
* OUTPUT_SIGNATURES: serving setups that public reports found answering with garbage while healthy,
  keyed by what the plan knows (compute capability, expert parallelism, quantization); the quality
  gate prints the matching rows' suggestion when its probes fail (`suggest_for_output`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .cause import Cause

SGLANG_0_5_23_SOURCE = "SGLang 0.5.23 (PyPI wheel): python/sglang/srt/arg_groups/attention_hook.py"


@dataclass(frozen=True)
class LogSignature:
    kind: str
    pattern: re.Pattern[str]
    summary: str
    hint: str
    sources: tuple[str, ...]


LOG_SIGNATURES: list[LogSignature] = [
    LogSignature(
        "trtllm_mla_unsupported_arch",
        re.compile(
            r"TllmGenFmhaRunner.*Unsupported architectur|fmhaRunner\.cuh:\d+: Unsupported architectur"
        ),
        "the TRT-LLM MLA/FMHA kernels (attention backend trtllm_mla) do not run on this GPU: FlashInfer's "
        "TllmGenFmhaRunner accepts only SM100/SM103, so sm_120 (RTX PRO 6000) fails in prefill",
        "serve with --attention-backend flashinfer (FlashInfer MLA runs on sm_120; "
        "module_utils/regen_attention_backends.py, row sm120-mla): sglang_server_attention_backend: "
        "flashinfer where the plan names the backend, else sglang_server_extra_args: "
        "['--attention-backend', 'flashinfer']; then re-run the serve stage",
        (
            "https://github.com/sgl-project/sglang/issues/24633",
            "https://github.com/flashinfer-ai/flashinfer/issues/3263",
            "https://github.com/sgl-project/sglang/issues/40558",
        ),
    ),
    LogSignature(
        "trtllm_mha_prefill_sm120_fp8_kv",
        re.compile(r"TRTLLM FMHAv2 prefill on SM120 does not support fp8_e4m3 KV cache"),
        "the TRT-LLM MHA prefill kernels on sm_120 do not take an fp8_e4m3 KV cache",
        "serve with --attention-backend flashinfer (sglang_server_attention_backend, or "
        "sglang_server_extra_args), or with a bf16 KV cache",
        (SGLANG_0_5_23_SOURCE,),
    ),
    LogSignature(
        "trtllm_mha_unsupported_arch",
        re.compile(r"TRTLLM MHA backend for (?:prefill|decode) (?:requires|is only supported on)"),
        "the TRT-LLM MHA backend needs a Hopper (sm_90) or Blackwell (sm_100/sm_120) GPU",
        "serve with --attention-backend flashinfer or triton on this GPU (sglang_server_attention_backend, "
        "or sglang_server_extra_args)",
        (SGLANG_0_5_23_SOURCE,),
    ),
    LogSignature(
        "trtllm_gen_moe_no_kernel",
        re.compile(r"TrtllmGenBatchedGemmRunner.*No kernel found"),
        "FlashInfer's trtllm-gen MoE kernels (--moe-runner-backend flashinfer_trtllm) have no kernel for "
        "this GPU or shape; they exist for SM100/SM103 only, and SGLang 0.5.23's `auto` picks them for "
        "NVFP4 experts on sm_120 unless --quantization modelopt_fp4 is given",
        "on sm_120 serve NVFP4 experts with --quantization modelopt_fp4 --moe-runner-backend "
        "flashinfer_cutlass (module_utils/regen_kernel_tables.py, MoE table row sm120-nvfp4; the plan names "
        "both), or --moe-runner-backend marlin (W4A16); then re-run the serve stage",
        (
            "https://github.com/flashinfer-ai/flashinfer/issues/2045",
            "https://github.com/flashinfer-ai/flashinfer/pull/3670",
            "https://github.com/flashinfer-ai/flashinfer/issues/3310",
            "SGLang 0.5.23 (PyPI wheel): python/sglang/srt/layers/quantization/modelopt_quant.py "
            "ModelOptNvFp4FusedMoEMethod.create_moe_runner",
        ),
    ),
    LogSignature(
        "flashinfer_cutlass_moe_no_tactic",
        re.compile(r"No valid tactics available for fused moe op"),
        "FlashInfer's CUTLASS fused-MoE kernels have no tactic for this GPU and weight format (reported on "
        "sm_120 for W4 group-scaled MoE)",
        "serve the experts with --moe-runner-backend marlin (weight-only W4A16, runs on sm_80+), through "
        "model_facts_plan_overrides.serving.moe_runner_backend: marlin; then re-run the serve stage",
        ("https://github.com/sgl-project/sglang/pull/24692",),
    ),
    LogSignature(
        "ptxas_unknown_arch",
        re.compile(r"ptxas fatal\s*: Value 'sm_\d+a?' is not defined for option 'gpu-name'"),
        "Triton's ptxas is too old for this GPU generation (sm_120 needs CUDA >= 12.8's ptxas)",
        "install a Triton/CUDA toolkit that knows the GPU (CUDA 12.8+ for sm_120) into the serving venv, "
        "or point TRITON_PTXAS_PATH in sglang_server_environment at a newer ptxas",
        ("https://github.com/RLinf/RLinf/issues/92",),
    ),
    LogSignature(
        "no_kernel_image",
        re.compile(r"no kernel image is available for execution on the device"),
        "a CUDA extension (or PyTorch itself) in the serving venv was built without kernels for this GPU",
        "install builds compiled for the GPU's compute capability (for sm_120: CUDA 12.8+ wheels of torch, "
        "sgl-kernel and flashinfer) into the serving venv",
        (
            "https://github.com/bytedance/Protenix/pull/301",
            "https://github.com/Comfy-Org/ComfyUI/pull/16438",
        ),
    ),
]


def match_log(text: str) -> Cause | None:
    """The known failure the log shows (last matching line), as a diagnose.Cause; None when none does."""
    lines = (text or "").splitlines()
    for sig in LOG_SIGNATURES:
        for line in reversed(lines):
            if sig.pattern.search(line):
                return Cause(
                    sig.kind, sig.summary, f"{sig.hint} (source: {sig.sources[0]})", line.strip()[:300]
                )
    return None


@dataclass(frozen=True)
class OutputSignature:
    """A serving setup that public reports saw produce garbage while the server looked healthy."""

    id: str
    compute_capability_major: int | None
    needs_expert_parallel: bool
    quantization_pattern: re.Pattern[str] | None
    reported: str
    suggestion: str
    source: str


OUTPUT_SIGNATURES: list[OutputSignature] = [
    OutputSignature(
        "sm120-ep8-garbage",
        12,
        True,
        None,
        "8x RTX PRO 6000 (sm_120) with --ep-size 8 answered every prompt with gibberish for FP8 and INT4 "
        "models (SGLang 0.5.9); triton attention/MoE backends and --disable-cuda-graph did not help",
        "serve the same model without expert parallelism (sglang_server_ep_size: 1, TP only) or with "
        "another layout (playbooks/sweep.yml measures each with this gate) and compare",
        "https://github.com/sgl-project/sglang/issues/21132",
    ),
    OutputSignature(
        "sm120-nvfp4-garbage",
        12,
        False,
        re.compile(r"nvfp4|modelopt_fp4|fp4", re.I),
        "an NVFP4 (W4A4) MoE checkpoint on RTX PRO 6000 (sm_120) answered '++++...' with every MoE runner "
        "backend, while another NVFP4 model on the same GPUs answered coherently",
        "serve an INT4/FP8/BF16 checkpoint of the model (e.g. Kimi K2.5's INT4) or a SGLang build whose "
        "NVFP4 MoE kernels are known good on sm_120",
        "https://github.com/sgl-project/sglang/issues/24321",
    ),
    OutputSignature(
        "sm120-nvfp4-cutlass-moe-invalid",
        12,
        False,
        re.compile(r"nvfp4|modelopt_fp4|fp4", re.I),
        "NVFP4 MoE through FlashInfer's CUTLASS grouped block-scaled GEMM on RTX PRO 6000 (sm_120) produced "
        "invalid output until FlashInfer's SM120 checks were patched (FlashInfer 0.6.5); Marlin's W4A16 "
        "path answered correctly and faster there",
        "serve the experts with --moe-runner-backend marlin (model_facts_plan_overrides.serving."
        "moe_runner_backend: marlin) and compare with this gate",
        "https://github.com/flashinfer-ai/flashinfer/issues/2723",
    ),
]


def suggest_for_output(
    compute_capability: str | None = None, ep_size: int | None = None, quantization: str | None = None
) -> list[dict[str, str]]:
    """The OUTPUT_SIGNATURES rows that fit this setup; a row tied to a GPU generation needs the compute
    capability to be known, an EP row an ep_size > 1 (or unknown), a quantization row a matching (or
    unknown) quantization."""
    major = None
    if compute_capability:
        try:
            major = int(str(compute_capability).split(".")[0])
        except ValueError:
            major = None
    out = []
    for sig in OUTPUT_SIGNATURES:
        if sig.compute_capability_major is not None and major != sig.compute_capability_major:
            continue
        if sig.needs_expert_parallel and ep_size is not None and ep_size <= 1:
            continue
        if (
            sig.quantization_pattern is not None
            and quantization is not None
            and not sig.quantization_pattern.search(quantization)
        ):
            continue
        out.append(
            {"id": sig.id, "reported": sig.reported, "suggestion": sig.suggestion, "source": sig.source}
        )
    return out
