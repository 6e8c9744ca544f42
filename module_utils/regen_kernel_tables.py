"""Which MoE kernels, quantization flag and KV-cache dtype to name on SGLang's launch line.

Two tables in the shape of the attention-backend table (module_utils/regen_attention_backends.py): rows
keyed by compute capability, the checkpoint's quantization scheme (or the attention backend and kind) and
the SGLang release, each naming the lines of that release's source it rests on, so a later release can be
re-read against it. Pure functions and data (standard library only).

Why name them at all. SGLang 0.5.23 (the serving pin) and 0.5.14 (the capture server SpecForge pins)
resolve `--moe-runner-backend auto` late, inside the quantization method, and what they pick is not
always a kernel the GPU has:

* NVFP4 (ModelOpt `quant_algo: NVFP4`): `ModelOptNvFp4FusedMoEMethod.create_moe_runner`
  (layers/quantization/modelopt_quant.py) turns `auto` into MARLIN on 8.0 <= cc < 10.0 and into
  FLASHINFER_TRTLLM everywhere else, sm_120 included, where the trtllm-gen MoE kernels do not exist
  (they are SM100-only). The sm_120 path, `flashinfer_cutlass`, is taken only when `--quantization
  modelopt_fp4` is on the command line: 0.5.23 arg_groups/overrides.py `_moe_runner_backend_quant_constraints`
  (`moe_runner_backend == "auto" and view.quantization == "modelopt_fp4" and (is_sm120 or is_sm110)`),
  0.5.14 server_args.py `_handle_moe_kernel_config` (the same test with `is_sm120_supported()`). The
  quantization read from the checkpoint comes later (ModelConfig), too late for that test.
* The FlashInfer MLA backend (the attention table's choice on sm_120) reads the KV cache as
  `self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)` in `forward_decode` and paged
  prefill (0.5.23 layers/attention/flashinfer_mla_backend.py): with an FP8 pool every step copies the
  whole per-layer buffer to BF16. A checkpoint that declares an FP8 KV cache (ModelOpt
  `kv_cache_quant_algo: FP8`, which `--kv-cache-dtype auto` follows) therefore gets `bf16` named there.
"""

from __future__ import annotations

from .regen_attention_backends import _cc_matches, parse_compute_capability

SGLANG_0_5_23_MOE = (
    "SGLang 0.5.23 wheel (PyPI sglang==0.5.23): python/sglang/srt/layers/quantization/modelopt_quant.py "
    "ModelOptNvFp4FusedMoEMethod.create_moe_runner (auto -> MARLIN for 8.0 <= cc < 10.0, else "
    "FLASHINFER_TRTLLM); arg_groups/overrides.py _moe_runner_backend_quant_constraints (auto + "
    "--quantization modelopt_fp4 on SM110/SM120 -> flashinfer_cutlass, 'trtllm-gen MoE kernels are "
    "SM100-only') and _deepseek_moe_quant_resolution (is_sm100 only: flashinfer_trtllm for the DeepSeek "
    "family incl. Kimi K2/K2.5 INT4); utils/common.py is_sm100_supported (major 10 only)"
)
SGLANG_0_5_23_WNA16 = (
    "SGLang 0.5.23 wheel: python/sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py "
    "get_moe_scheme (_is_wNa16_group_channel: CompressedTensorsWNA16MoE, the Marlin WNA16 kernels, unless "
    "the runner is triton or auto on SM100)"
)
SGLANG_0_5_14_MOE = (
    "SGLang 0.5.14 wheel (PyPI sglang==0.5.14, SpecForge's capture server): "
    "python/sglang/srt/server_args.py _handle_moe_kernel_config (auto + quantization modelopt_fp4 + "
    "is_sm120_supported -> flashinfer_cutlass); "
    "layers/quantization/modelopt_quant.py create_moe_runner (auto -> FLASHINFER_TRTLLM off 8.0-9.x)"
)
SGLANG_0_5_23_FLASHINFER_MLA = (
    "SGLang 0.5.23 wheel: python/sglang/srt/layers/attention/flashinfer_mla_backend.py forward_decode "
    "(k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)) and paged prefill "
    "(the same cast); arg_groups/fields/model.py --kv-cache-dtype choices"
)
SGLANG_ISSUE_21132 = "https://github.com/sgl-project/sglang/issues/21132"

# Quantization schemes as the tables name them (serving_scheme maps the facts onto these).
SCHEMES = ("modelopt_fp4", "modelopt_fp8", "modelopt_mixed", "compressed_tensors_wna16",
           "compressed_tensors_mxfp4", "fp8_block", "mxfp4", "none")

# The first row whose keys all match wins. `quantization` / `moe_runner_backend`: the values to name (None
# leaves the flag off and SGLang decides, which the reason then says).
MOE_TABLE: list[dict] = [
    {
        "id": "sm120-nvfp4", "sglang": ("0.5.23", "0.5.14"), "cc": "12.x", "scheme": "modelopt_fp4",
        "quantization": "modelopt_fp4", "moe_runner_backend": "flashinfer_cutlass",
        "sglang_default": "flashinfer_trtllm (create_moe_runner's auto off Hopper and Ampere)",
        "reason": (
            "NVFP4 MoE on sm_120: SGLang's auto resolves inside ModelOptNvFp4FusedMoEMethod to "
            "flashinfer_trtllm, whose trtllm-gen MoE kernels are SM100-only; the sm_120 path "
            "(flashinfer_cutlass) is chosen only when --quantization modelopt_fp4 is given, so both are named"
        ),
        "avoid": {"flashinfer_trtllm": "trtllm-gen MoE kernels are SM100-only (no sm_120 code)",
                  "flashinfer_trtllm_routed": "trtllm-gen MoE kernels are SM100-only (no sm_120 code)"},
        "sources": [SGLANG_0_5_23_MOE, SGLANG_0_5_14_MOE],
    },
    {
        "id": "sm100-nvfp4", "sglang": ("0.5.23", "0.5.14"), "cc": "10.x", "scheme": "modelopt_fp4",
        "quantization": "modelopt_fp4", "moe_runner_backend": "flashinfer_trtllm",
        "sglang_default": "flashinfer_trtllm",
        "reason": ("NVFP4 MoE on datacenter Blackwell (sm_100/sm_103): SGLang's own choice, the trtllm-gen "
                   "kernels; named so the line says what runs"),
        "avoid": {},
        "sources": [SGLANG_0_5_23_MOE],
    },
    {
        "id": "sm90-nvfp4", "sglang": ("0.5.23", "0.5.14"), "cc": "9.x", "scheme": "modelopt_fp4",
        "quantization": "modelopt_fp4", "moe_runner_backend": "marlin",
        "sglang_default": "marlin",
        "reason": ("NVFP4 below Blackwell (sm_90): no FP4 tensor cores; SGLang runs the experts as W4A16 "
                   "through Marlin (create_moe_runner's auto for 8.0 <= cc < 10.0); named so the line "
                   "says so"),
        "avoid": {"flashinfer_trtllm": "no FP4 MoE kernels below Blackwell",
                  "flashinfer_cutlass": "no FP4 MoE kernels below Blackwell"},
        "sources": [SGLANG_0_5_23_MOE],
    },
    {
        "id": "sm100-wna16", "sglang": ("0.5.23",), "cc": "10.x", "scheme": "compressed_tensors_wna16",
        "quantization": None, "moe_runner_backend": "flashinfer_trtllm",
        "sglang_default": "flashinfer_trtllm (the DeepSeek-family resolution for Kimi K2/K2.5 INT4)",
        "reason": ("INT4 (compressed-tensors W4A16) MoE on sm_100: SGLang 0.5.23 itself sets "
                   "flashinfer_trtllm for the DeepSeek family's Kimi INT4 checkpoints; named so the line "
                   "says so; the quantization comes from the checkpoint (compressed-tensors)"),
        "avoid": {},
        "sources": [SGLANG_0_5_23_MOE, SGLANG_0_5_23_WNA16],
    },
    {
        "id": "wna16", "sglang": ("0.5.23",), "cc": "*", "scheme": "compressed_tensors_wna16",
        "quantization": None, "moe_runner_backend": "marlin",
        "sglang_default": "marlin (CompressedTensorsWNA16MoE)",
        "reason": ("INT4 (compressed-tensors W4A16) MoE off sm_100: SGLang runs the Marlin WNA16 kernels "
                   "(auto is Marlin there); named so the line says so; the quantization comes from the "
                   "checkpoint (compressed-tensors)"),
        "avoid": {"flashinfer_cutlass": "FlashInfer CUTLASS MoE takes only modelopt_fp4/fp8/mixed or bf16 "
                                        "(arg_groups/moe_hook.py)"},
        "sources": [SGLANG_0_5_23_WNA16],
    },
    {
        "id": "other", "sglang": ("0.5.23", "0.5.14"), "cc": "*", "scheme": "*",
        "quantization": None, "moe_runner_backend": None,
        "sglang_default": "SGLang's auto",
        "reason": ("no known failure of SGLang's own MoE kernel choice for this quantization on this GPU: "
                   "both flags are left to SGLang (it reads the quantization from the checkpoint)"),
        "avoid": {},
        "sources": [SGLANG_0_5_23_MOE],
    },
]

# (attention backend, attention kind) -> what to do with the declared KV-cache format.
KV_DTYPE_TABLE: list[dict] = [
    {
        "id": "flashinfer-mla-bf16", "sglang": ("0.5.23",), "backend": "flashinfer", "kind": "mla",
        "value": "bf16",
        "reason": (
            "FlashInfer's MLA backend casts the whole per-layer KV buffer to the query dtype (bf16) at every "
            "decode and prefill step (get_key_buffer(...).to(q.dtype)): an FP8 pool saves memory but pays a "
            "full bf16 copy of each layer's cache per step, and RTX PRO 6000 reports of Kimi on SGLang show "
            "throughput collapsing with an fp8 KV cache; so the pool is bf16 (named, since --kv-cache-dtype "
            "auto follows a ModelOpt kv_cache_quant_algo FP8 declaration) and the memory arithmetic "
            "counts 2 B"
        ),
        "avoid": {"fp8_e4m3": "converted to bf16 per layer at every step by FlashInfer MLA",
                  "fp8_e5m2": "converted to bf16 per layer at every step by FlashInfer MLA"},
        "sources": [SGLANG_0_5_23_FLASHINFER_MLA],
    },
]


def serving_scheme(arch):
    """The MoE/quantization table's scheme for an architecture document (regen_config's)."""
    quant = (arch or {}).get("quantization") or {}
    if not quant:
        return "none"
    method = (quant.get("method") or "").lower()
    algo = (quant.get("algo") or "").upper()
    fmt = (quant.get("format") or "").lower()
    if algo == "MIXED_PRECISION" or quant.get("mixed_precision"):
        return "modelopt_mixed"
    if algo == "NVFP4" or (method == "modelopt" and "nvfp4" in fmt):
        return "modelopt_fp4"
    if algo == "FP8" and method in ("modelopt", "fp8", ""):
        return "modelopt_fp8"
    if method == "compressed-tensors":
        if "mxfp4" in fmt:
            return "compressed_tensors_mxfp4"
        if quant.get("weight_type") == "int" and (quant.get("bits") or 16) < 8:
            return "compressed_tensors_wna16"
    if method == "mxfp4":
        return "mxfp4"
    if method == "fp8" and quant.get("weight_block_size"):
        return "fp8_block"
    return method or "none"


def _row(table, version, **keys):
    for row in table:
        if version not in row["sglang"]:
            continue
        if all(row.get(k) in ("*", v) or (k == "cc" and v and _cc_matches(row["cc"], v))
               for k, v in keys.items()):
            return row
    return None


def choose_moe(compute_capability, arch, sglang_version="0.5.23"):
    """{quantization, moe_runner_backend, reason, row, sources, avoid, scheme, sglang_default}: the MoE
    kernels and quantization flag to name for this checkpoint on this GPU, from MOE_TABLE."""
    scheme = serving_scheme(arch)
    cc = parse_compute_capability(compute_capability)
    answer = {"scheme": scheme, "quantization": None, "moe_runner_backend": None, "row": None,
              "sources": [], "avoid": {}, "sglang_default": None, "sglang": sglang_version}
    if not (arch or {}).get("moe"):
        answer["reason"] = "dense model: no MoE kernels to choose"
        return answer
    if cc is None:
        answer["reason"] = "compute capability unknown: SGLang picks the MoE kernels at start-up"
        return answer
    row = _row(MOE_TABLE, sglang_version, cc=cc, scheme=scheme)
    if row is None:
        answer["reason"] = f"no MoE table rows for SGLang {sglang_version}: SGLang decides"
        return answer
    answer.update(quantization=row["quantization"], moe_runner_backend=row["moe_runner_backend"],
                  row=row["id"], sources=list(row["sources"]), avoid=dict(row["avoid"]),
                  sglang_default=row["sglang_default"], reason=row["reason"])
    return answer


def choose_kv_dtype(attention_backend, attention_kind, declared, sglang_version="0.5.23"):
    """{value, bytes, reason, row, sources, avoid}: the --kv-cache-dtype for this (backend, KV format) pair.

    `declared`: the checkpoint's KV-cache declaration (regen_config's quantization.kv_cache) or None. Rows
    of KV_DTYPE_TABLE override it; elsewhere the declared format is named (the memory arithmetic counts
    its bytes) and without one the flag stays off (the model's dtype)."""
    row = _row(KV_DTYPE_TABLE, sglang_version, backend=attention_backend, kind=attention_kind)
    if row is not None:
        note = (f"; the checkpoint declares {declared['dtype']} ({declared['declared']}), not used"
                if declared and declared["dtype"] != row["value"] else "")
        return {"value": row["value"], "bytes": 2 if row["value"] in ("bf16", "bfloat16") else 1,
                "reason": row["reason"] + note, "row": row["id"], "sources": list(row["sources"]),
                "avoid": dict(row["avoid"]), "pair": [attention_backend, row["value"]]}
    if declared:
        reason = (f"the checkpoint declares a {declared['dtype']} KV cache ({declared['declared']}) and "
                  f"{attention_backend or 'the backend SGLang picks'} reads it natively: named so the pool "
                  f"holds {declared['bytes']:g} B per element as the memory arithmetic counts")
        return {"value": declared["dtype"], "bytes": declared["bytes"], "reason": reason, "row": None,
                "sources": [], "avoid": {}, "pair": [attention_backend, declared["dtype"]]}
    return {"value": None, "bytes": None, "row": None, "sources": [], "avoid": {},
            "reason": "no KV-cache format declared: SGLang keeps the model's dtype",
            "pair": [attention_backend, "auto"]}


def ep_risk(compute_capability, ep_size):
    """A known risk of expert parallelism on this GPU, or None (shown beside the simulator's ranking)."""
    cc = parse_compute_capability(compute_capability)
    if cc and cc[0] == 12 and (ep_size or 1) > 1:
        return (f"EP{ep_size} on sm_120: sgl-project/sglang issue 21132 (open) reports garbage output with "
                "EP8 on 8x RTX PRO 6000 (FP8 and INT4 models) while /health_generate stays green; the "
                "serve stage's quality gate and the layout sweep decide it on the host "
                f"({SGLANG_ISSUE_21132})")
    return None


def table_values():
    """Every flag value the tables can put on a launch line (checked against SGLang's parser)."""
    quant = {r["quantization"] for r in MOE_TABLE if r["quantization"]}
    runners = {r["moe_runner_backend"] for r in MOE_TABLE if r["moe_runner_backend"]}
    for row in MOE_TABLE:
        runners.update(row["avoid"])
    kv = {r["value"] for r in KV_DTYPE_TABLE}
    for row in KV_DTYPE_TABLE:
        kv.update(row["avoid"])
    return {"quantization": sorted(quant), "moe_runner_backend": sorted(runners),
            "kv_cache_dtype": sorted(kv)}
