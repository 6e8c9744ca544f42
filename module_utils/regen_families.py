"""The model-family registry: one row per Hugging Face `model_type` regen knows, read by every consumer.

Standard library only and free of I/O (it ships inside modules that run on target hosts). A row says
where the family's language-model config lives, which SGLang parsers read its output, which SpecForge
chat template renders its conversations, which chat-template variable switches its thinking on, and the
DFlash drafter recipe published for it. The consumers:

- the config reader (regen_config): which types it knows, and where the text config is nested;
- the plan (regen_plan): SGLang reasoning / tool-call parsers, the thinking switch's kwargs;
- the launch line (regen_serving): the parsers again, when the facts carry no plan;
- the drafter (regen_drafter): SpecForge's chat-template name;
- the tokenizer reader (regen_tokenizer): which template variables count as a thinking switch.

tests/unit/test_registry.py fails when a type is known to one consumer and missing from another; the
The "Add a model family" recipe (docs/model-families.md) lists every place a new row reaches.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterRecipe:
    """A DFlash drafter someone published for this family (what SpecForge's own config file says)."""

    source: str
    target_num_layers: int
    num_draft_layers: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple


@dataclass(frozen=True)
class Family:
    """One model type. None in a column is a decision ("no such parser"), not a gap."""

    model_type: str
    # Key under which a multimodal wrapper nests the language model's config; None: the top level.
    text_config_key: str | None
    # The model_type found under text_config_key (None for top-level families).
    text_model_type: str | None
    # SGLang 0.5.23 parser names (--reasoning-parser, --tool-call-parser); checked against that release
    # by tests/unit/test_serving_argv.py.
    reasoning_parser: str | None
    tool_call_parser: str | None
    # SpecForge 0.2.0 template name (data/template.py); checked by tests/unit/test_drafter_specforge.py.
    specforge_chat_template: str | None
    # The chat-template variable of the family's newest template that switches thinking (a key of
    # THINKING_SWITCHES), None when its templates have none.
    thinking_switch: str | None
    # True when the model reasons on every turn without think tokens (gpt-oss's analysis channel), so a
    # reasoning parser is planned even when the tokenizer shows no sign of thinking.
    always_reasons: bool = False
    drafter_recipe: DrafterRecipe | None = None


# Chat-template variables that switch thinking, in the order a template is searched for them, with the
# value that turns thinking on (what the plan sends as chat_template_kwargs).
THINKING_SWITCHES = {"thinking": True, "enable_thinking": True, "reasoning_effort": "high"}

# SpecForge's configs/kimi-k2.7-code-dflash.json: a drafter for the 61-layer, 7168-wide Kimi target.
# The plan follows it (regen_plan.drafter_depth_and_block); tests/fixtures/drafter/specforge/ keeps the file
# (SOURCES.md names the commit), since SpecForge's main branch no longer carries it.
KIMI_DFLASH = DrafterRecipe(
    source="SpecForge configs/kimi-k2.7-code-dflash.json",
    target_num_layers=61,
    num_draft_layers=6,
    block_size=8,
    mask_token_id=163838,
    target_layer_ids=(1, 12, 24, 35, 47, 58),
)

# Columns: model_type, text_config_key, text_model_type, reasoning_parser, tool_call_parser,
# specforge_chat_template, thinking_switch (then keywords).
_ROWS = (
    # Kimi K2 (Instruct / Thinking): DeepSeek-V3 layout at the top level; K2-Thinking always thinks.
    Family("kimi_k2", None, None, "kimi_k2", "kimi_k2", "kimi-k2-instruct", None),
    # Kimi K2.5 / K2.6: a multimodal wrapper, the DeepSeek-V3 language model under text_config.
    Family("kimi_k25", "text_config", "deepseek_v3", "kimi_k2", "kimi_k2", "kimi-k2-thinking", "thinking",
           drafter_recipe=KIMI_DFLASH),
    # Kimi K3: a `kimi_k3` wrapper over the hybrid `kimi_linear` language model (MLA on the layers of
    # linear_attn_config.full_attn_layers, Kimi Delta Attention elsewhere, latent MoE); SGLang 0.5.23 ships
    # `kimi_k3` reasoning and tool-call parsers (parser/reasoning_parser.py, function_call_parser.py). No
    # SpecForge template and no published drafter yet; its template's thinking switch is not known here.
    Family("kimi_k3", "text_config", "kimi_linear", "kimi_k3", "kimi_k3", None, None),
    # The language model K3 nests (Kimi Linear's schema); a bare Kimi Linear checkpoint gets no parser
    # until one is known to fit it.
    Family("kimi_linear", None, None, None, None, None, None),
    # A reasoning parser is only planned when the tokenizer can think, so DeepSeek-V3 without R1's
    # tokens gets none; V3.1's template reads `thinking`.
    Family("deepseek_v3", None, None, "deepseek-r1", "deepseekv3", "deepseek-v3", "thinking"),
    # DeepSeek-V3.2: the V3 schema plus a sparse-attention indexer (index_* keys); thinking toggled by
    # the template like V3.1 (SGLang's deepseek-v3 reasoning parser), its own tool-call format.
    Family("deepseek_v32", None, None, "deepseek-v3", "deepseekv32", "deepseek-v32", "thinking"),
    Family("deepseek_v2", None, None, None, None, "deepseek-v2", None),
    Family("qwen3", None, None, "qwen3", "qwen25", "qwen", "enable_thinking"),
    Family("qwen3_moe", None, None, "qwen3", "qwen25", "qwen", "enable_thinking"),
    # Qwen3-Next ships separate Instruct and Thinking models: no switch in either template.
    Family("qwen3_next", None, None, "qwen3", "qwen25", "qwen3-next-thinking", None),
    # Qwen3.5: multimodal wrappers around the *_text language models (rows of their own, so a text-only
    # checkpoint is known too).
    Family("qwen3_5", "text_config", "qwen3_5_text", "qwen3", "qwen25", "qwen3.5", "enable_thinking"),
    Family("qwen3_5_text", None, None, "qwen3", "qwen25", "qwen3.5", "enable_thinking"),
    Family("qwen3_5_moe", "text_config", "qwen3_5_moe_text", "qwen3", "qwen25", "qwen3.5",
           "enable_thinking"),
    Family("qwen3_5_moe_text", None, None, "qwen3", "qwen25", "qwen3.5", "enable_thinking"),
    Family("gpt_oss", None, None, "gpt-oss", "gpt-oss", "gpt-oss", "reasoning_effort", always_reasons=True),
    Family("llama", None, None, None, "llama3", "llama3", None),
    Family("mixtral", None, None, None, "mistral", None, None),
    Family("mistral", None, None, None, "mistral", None, None),
    # GLM-4.5 / 4.6 (SpecForge 0.2.0's only GLM template is glm-5.2, which renders the same format).
    Family("glm4_moe", None, None, "glm45", "glm45", "glm-5.2", "enable_thinking"),
    # GLM-4.7-Flash: GLM MoE with DeepSeek-style MLA (q/kv_lora_rank) and n_routed/n_shared experts;
    # GLM-4.5's reasoning format, the GLM-4.7 tool-call format.
    Family("glm4_moe_lite", None, None, "glm45", "glm47", None, "enable_thinking"),
    Family("qwen2", None, None, None, None, None, None),
    Family("qwen2_moe", None, None, None, None, None, None),
)
FAMILIES = {row.model_type: row for row in _ROWS}

# Where multimodal wrappers nest the language model's config: the keys the rows name, then the ones of
# wrappers regen has no row for (DeepSeek-VL2's language_config, InternVL's llm_config).
TEXT_CONFIG_KEYS = tuple(
    dict.fromkeys(
        [row.text_config_key for row in _ROWS if row.text_config_key] + ["language_config", "llm_config"]
    )
)


def family(model_type):
    """The row for one model_type, or None."""
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def family_of(architecture):
    """The row for an architecture document (model_config_info's): the top-level type first (Kimi K2.6 is
    `kimi_k25`), else the nested language model's (the demo's `kimi_k25_demo` wraps `kimi_k2`)."""
    architecture = architecture if isinstance(architecture, dict) else {}
    for key in ("model_type", "text_model_type"):
        row = family(architecture.get(key))
        if row is not None:
            return row
    return None


def text_config(config):
    """The language model's part of a parsed config.json: the first object under TEXT_CONFIG_KEYS, else
    the config itself."""
    if not isinstance(config, dict):
        return {}
    for key in TEXT_CONFIG_KEYS:
        if isinstance(config.get(key), dict):
            return config[key]
    return config
