"""Which `--attention-backend` to name on SGLang's launch line, by GPU generation and attention kind.

One table, keyed by (compute capability, attention kind, pinned SGLang version). Every row names the
public material it rests on, so that a reader can check it and a later SGLang release can be re-read
against it. Pure functions and data (standard library only): the plan (module_utils/regen_serving.py,
regen_plan.py) and the `regen facts` CLI call `choose_backend`, tests check every row and that every
name is a choice SGLang's own argument parser accepts.

Why name the backend at all: left unset, SGLang picks one at start-up from the hardware it sees, and that
choice has moved between releases. In 0.5.23 (python/sglang/srt/arg_groups/model_override_base.py,
`get_default_attn_backend`, and model_overrides/deepseek_v2.py) an MLA model gets `fa3` on Hopper,
`trtllm_mla` on sm_100 (DeepSeek-V3 family, Kimi K2.5) and falls back to `triton` everywhere else,
sm_120 included; earlier releases routed sm_120 MLA prefill into TensorRT-LLM's kernels, which refuse
the architecture ("Unsupported architecture"). Naming the backend makes the launch line say what runs,
and the reason says why.
"""

from __future__ import annotations

import re

# Public sources the rows cite (checked with the search tool; see each row's `sources`).
SGLANG_0_5_23_DEFAULTS = (
    "SGLang 0.5.23 wheel (PyPI sglang==0.5.23): python/sglang/srt/arg_groups/model_override_base.py "
    "get_default_attn_backend; model_overrides/deepseek_v2.py (trtllm_mla on sm100 for "
    "DeepseekV3ForCausalLM/KimiK25ForConditionalGeneration); model_overrides/gpt_oss.py (triton off "
    "Hopper/sm100 for attention sinks); utils/common.py is_sm100_supported "
    "(major 10), is_sm120_supported (major 12), is_hopper_with_cuda_12_3 (major 9, CUDA >= 12.3)"
)
SGLANG_ISSUE_24633 = "https://github.com/sgl-project/sglang/issues/24633"
SGLANG_ISSUE_17880 = "https://github.com/sgl-project/sglang/issues/17880"
FLASHINFER_ISSUE_3263 = "https://github.com/flashinfer-ai/flashinfer/issues/3263"
SGLANG_PR_12325 = "https://github.com/sgl-project/sglang/pull/12325"
SGLANG_PR_26557 = "https://github.com/sgl-project/sglang/pull/26557"
SGLANG_ISSUE_17411 = "https://github.com/sgl-project/sglang/issues/17411"

SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)

# Rows: the first row whose keys all match wins. `cc` is a compute-capability pattern ("12.x" = any
# minor of major 12, "*" = any); `kind` a tuple of attention kinds; `sinks` True/False restricts the
# row to models with/without attention sinks (gpt-oss), None matches both. `avoid` lists backends the
# plan refuses on that hardware, each with why and the source.
BACKEND_TABLE: list[dict] = [
    {
        "id": "sm120-mla",
        "sglang": "0.5.23",
        "cc": "12.x",
        "kind": ("mla",),
        "sinks": None,
        "value": "flashinfer",
        "sglang_default": "triton",
        "reason": (
            "MLA on sm_120 (RTX PRO 6000 / RTX 50xx Blackwell): FlashInfer's MLA wrapper runs there with its "
            "fa2 kernels (sgl-project/sglang PR 12325, gsm8k 0.955 on DeepSeek-R1 FP4, RTX PRO 6000D); "
            "trtllm_mla dies in prefill with 'Unsupported architecture' because FlashInfer's "
            "TllmGenFmhaRunner only accepts SM100/SM103 (flashinfer issue 3263, sglang issue 24633); "
            "SGLang 0.5.23 left alone would pick triton"
        ),
        "avoid": {
            "trtllm_mla": (
                "TRT-LLM MLA kernels refuse sm_120: 'TllmGenFmhaRunner ... Unsupported architecture' "
                f"({FLASHINFER_ISSUE_3263}, {SGLANG_ISSUE_24633}, {SGLANG_ISSUE_17880})"
            ),
        },
        "sources": [SGLANG_PR_12325, FLASHINFER_ISSUE_3263, SGLANG_ISSUE_24633, SGLANG_0_5_23_DEFAULTS],
    },
    {
        "id": "sm100-mla",
        "sglang": "0.5.23",
        "cc": "10.x",
        "kind": ("mla",),
        "sinks": None,
        "value": "trtllm_mla",
        "sglang_default": "trtllm_mla",
        "reason": (
            "MLA on datacenter Blackwell (sm_100/sm_103): SGLang 0.5.23 itself picks trtllm_mla for the "
            "DeepSeek-V3 family and Kimi K2.5 there; FlashInfer's MLA wrapper resolves to its fa2 kernels on "
            "SM100, ~3x slower in decode than trtllm-gen (sgl-project/sglang PR 26557)"
        ),
        "avoid": {},
        "sources": [SGLANG_0_5_23_DEFAULTS, SGLANG_PR_26557, FLASHINFER_ISSUE_3263],
    },
    {
        "id": "sm90-mla",
        "sglang": "0.5.23",
        "cc": "9.x",
        "kind": ("mla",),
        "sinks": None,
        "value": "fa3",
        "sglang_default": "fa3",
        "reason": "MLA on Hopper (sm_90, CUDA >= 12.3): SGLang 0.5.23's own choice, FlashAttention-3",
        "avoid": {},
        "sources": [SGLANG_0_5_23_DEFAULTS],
    },
    {
        "id": "other-mla",
        "sglang": "0.5.23",
        "cc": "*",
        "kind": ("mla",),
        "sinks": None,
        "value": "triton",
        "sglang_default": "triton",
        "reason": "MLA on other NVIDIA GPUs (Ampere, Ada): SGLang 0.5.23's own fallback, the Triton backend",
        "avoid": {},
        "sources": [SGLANG_0_5_23_DEFAULTS],
    },
    {
        "id": "sinks",
        "sglang": "0.5.23",
        "cc": "*",
        "kind": ("mha", "gqa", "mqa"),
        "sinks": True,
        "value": "triton",
        "sglang_default": "triton (fa3 on Hopper, trtllm_mha on sm_100)",
        "reason": (
            "attention sinks (gpt-oss): FlashInfer does not support them (SGLang 0.5.23 "
            "get_default_attn_backend), so off Hopper and sm_100 the backend is triton"
        ),
        "avoid": {"flashinfer": "FlashInfer does not support attention sinks (SGLang 0.5.23)"},
        "sources": [SGLANG_0_5_23_DEFAULTS],
        # Hopper and sm_100 keep SGLang's own choices below; this row only covers the rest.
        "cc_exclude": ("9.x", "10.x"),
    },
    {
        "id": "sm100-mha",
        "sglang": "0.5.23",
        "cc": "10.x",
        "kind": ("mha", "gqa", "mqa"),
        "sinks": None,
        "value": "trtllm_mha",
        "sglang_default": "trtllm_mha",
        "reason": (
            "MHA/GQA on datacenter Blackwell (sm_100/sm_103): SGLang 0.5.23's own choice, TRT-LLM MHA "
            "(not with speculative top-k > 1)"
        ),
        "avoid": {},
        "sources": [SGLANG_0_5_23_DEFAULTS],
    },
    {
        "id": "sm90-mha",
        "sglang": "0.5.23",
        "cc": "9.x",
        "kind": ("mha", "gqa", "mqa"),
        "sinks": None,
        "value": "fa3",
        "sglang_default": "fa3",
        "reason": (
            "MHA/GQA on Hopper (sm_90, CUDA >= 12.3): SGLang 0.5.23's own choice, FlashAttention-3 "
            "(FlashInfer 0.6.1 regressed on Hopper, sgl-project/sglang issue 17411)"
        ),
        "avoid": {},
        "sources": [SGLANG_0_5_23_DEFAULTS, SGLANG_ISSUE_17411],
    },
    {
        "id": "sm120-mha",
        "sglang": "0.5.23",
        "cc": "12.x",
        "kind": ("mha", "gqa", "mqa"),
        "sinks": None,
        "value": "flashinfer",
        "sglang_default": "flashinfer",
        "reason": (
            "MHA/GQA on sm_120: SGLang 0.5.23's own choice, FlashInfer (its docstring: trtllm_mha does not "
            "support SM120 and falls back to flashinfer)"
        ),
        "avoid": {},
        "sources": [SGLANG_0_5_23_DEFAULTS],
    },
    {
        "id": "other-mha",
        "sglang": "0.5.23",
        "cc": "*",
        "kind": ("mha", "gqa", "mqa"),
        "sinks": None,
        "value": "flashinfer",
        "sglang_default": "flashinfer",
        "reason": "MHA/GQA on other NVIDIA GPUs (Ampere, Ada): SGLang 0.5.23's own choice, FlashInfer",
        "avoid": {},
        "sources": [SGLANG_0_5_23_DEFAULTS],
    },
]

_CC = re.compile(r"^\s*(?:sm_?)?(\d+)(?:[._](\d+)|(\d))?\s*$")


def parse_compute_capability(value) -> tuple[int, int] | None:
    """'12.0', '12', 'sm_120', 'sm120', 9.0 or (12, 0) -> (major, minor); None when absent or unreadable."""
    if value is None or value == "":
        return None
    if isinstance(value, tuple | list) and len(value) == 2:
        return int(value[0]), int(value[1])
    text = str(value)
    match = _CC.match(text)
    if not match:
        return None
    digits, minor, tail = match.group(1), match.group(2), match.group(3)
    if text.strip().lower().startswith("sm") and minor is None and len(digits) >= 2:
        # sm_120 / sm90: the last digit is the minor version.
        return int(digits[:-1]), int(digits[-1])
    major = int(digits)
    return major, int(minor if minor is not None else (tail or 0))


def _cc_matches(pattern: str, cc: tuple[int, int]) -> bool:
    if pattern == "*":
        return True
    major, _, minor = pattern.partition(".")
    if int(major) != cc[0]:
        return False
    return minor in ("x", "") or int(minor) == cc[1]


def _row_matches(row: dict, cc: tuple[int, int], kind: str, sinks: bool, version: str) -> bool:
    if row["sglang"] != version or kind not in row["kind"] or not _cc_matches(row["cc"], cc):
        return False
    if any(_cc_matches(p, cc) for p in row.get("cc_exclude", ())):
        return False
    return row["sinks"] is None or bool(row["sinks"]) == bool(sinks)


def choose_backend(
    compute_capability,
    attention_kind: str | None,
    sglang_version: str = "0.5.23",
    *,
    attention_sinks: bool = False,
    override: str | None = None,
) -> dict:
    """The attention backend to name on the launch line, and why.

    Returns {value, reason, source, row, sglang_default, avoid}; `value` is None (leave the flag off,
    SGLang decides) when the GPU or the attention kind is unknown or no row covers them, and the reason
    says which. An `override` (inventory) wins, with a warning in the reason when the table advises
    against it on this hardware.
    """
    cc = parse_compute_capability(compute_capability)
    cc_text = f"{cc[0]}.{cc[1]}" if cc else None

    def answer(value, reason, row=None):
        return {
            "value": value,
            "reason": reason,
            "source": row["sources"] if row else [],
            "row": row["id"] if row else None,
            "sglang_default": row["sglang_default"] if row else None,
            "avoid": dict(row["avoid"]) if row else {},
            "compute_capability": cc_text,
        }

    row = None
    if cc is not None and attention_kind and sglang_version in SUPPORTED_SGLANG_VERSIONS:
        row = next(
            (
                r
                for r in BACKEND_TABLE
                if _row_matches(r, cc, attention_kind, attention_sinks, sglang_version)
            ),
            None,
        )
    if override:
        note = ""
        if row and override in row["avoid"]:
            note = f"; warning: the table advises against it on sm_{cc[0]}{cc[1]}: {row['avoid'][override]}"
        return answer(override, f"set in inventory (sglang_server_attention_backend){note}", row)
    if sglang_version not in SUPPORTED_SGLANG_VERSIONS:
        return answer(
            None,
            f"no backend table for SGLang {sglang_version} "
            f"(rows exist for {', '.join(SUPPORTED_SGLANG_VERSIONS)}): "
            "SGLang picks its own default; re-read its get_default_attn_backend and add rows",
        )
    if cc is None:
        return answer(None, "compute capability unknown (no GPU facts): SGLang picks its default at start-up")
    if not attention_kind:
        return answer(None, "attention kind unknown (config.json not read): SGLang picks its default")
    if row is None:
        return answer(
            None,
            f"no table row for attention kind {attention_kind!r} on compute capability {cc_text}: "
            "SGLang picks its default",
        )
    return answer(row["value"], row["reason"], row)


# Model types whose attention has learned sinks (SGLang's model_config.has_attention_sinks): gpt-oss.
ATTENTION_SINK_MODEL_TYPES = ("gpt_oss",)


def backend_for_facts(facts: dict, gpu_capability=None, override: str | None = None) -> dict:
    """`choose_backend` from a facts document ({architecture, environment}) or a bare architecture
    (regen_config.normalize_config's output); the GPU's capability from environment.gpu unless given."""
    facts = facts or {}
    arch = facts.get("architecture") if "architecture" in facts else facts
    arch = arch or {}
    attention = arch.get("attention") or {}
    if gpu_capability is None:
        gpu = (facts.get("environment") or {}).get("gpu") or {}
        caps = gpu.get("compute_capabilities") or []
        gpu_capability = gpu.get("compute_capability") or (caps[0] if caps else None)
    types = {arch.get("model_type"), arch.get("text_model_type")}
    sinks = bool(attention.get("attention_sinks")) or bool(types & set(ATTENTION_SINK_MODEL_TYPES))
    return choose_backend(gpu_capability, attention.get("kind"), attention_sinks=sinks, override=override)


def table_values() -> list[str]:
    """Every backend name the table can put on a launch line (checked against SGLang's parser)."""
    names = {r["value"] for r in BACKEND_TABLE}
    for row in BACKEND_TABLE:
        names.update(row["avoid"])
    return sorted(names)
