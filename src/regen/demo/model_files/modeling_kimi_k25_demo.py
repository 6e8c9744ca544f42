# Modeling code of the regen demo model. Written by the regen project (not Moonshot code); copied into
# the demo model directory by `python -m regen.demo.build` and loaded with trust_remote_code=True.
"""A thin wrapper around transformers' built-in DeepSeek-V3 that reads the Kimi K2.5 checkpoint layout.

Like the real Kimi K2.5/K2.6, the language model lives under ``language_model`` (checkpoint keys
``language_model.model.layers.N...`` and ``language_model.lm_head.weight``) and routed experts are stored
one tensor per expert (``mlp.experts.E.gate_proj.weight``). transformers' DeepSeek-V3 keeps experts fused
(``mlp.experts.gate_up_proj``), so the class registers the same expert-merging conversion transformers uses
for its own DeepSeek-V3 checkpoints; transformers skips conversions for remote code unless they are
registered explicitly.
"""

from typing import ClassVar

from transformers import GenerationMixin, PreTrainedModel
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM

from .configuration_kimi_k25_demo import ARCHITECTURE, KimiK25DemoConfig


class KimiK25DemoPreTrainedModel(PreTrainedModel):
    config_class = KimiK25DemoConfig
    config: KimiK25DemoConfig
    base_model_prefix = "language_model"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["DeepseekV3DecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["e_score_correction_bias", "gate.weight"]


class KimiK25DemoForConditionalGeneration(KimiK25DemoPreTrainedModel, GenerationMixin):
    """Text-only Kimi K2.5-style model: ``language_model`` is a DeepSeek-V3 causal LM."""

    def __init__(self, config: KimiK25DemoConfig):
        super().__init__(config)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def set_output_embeddings(self, new_embeddings):
        self.language_model.set_output_embeddings(new_embeddings)

    def get_decoder(self):
        return self.language_model.get_decoder()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        # The named arguments mirror DeepseekV3ForCausalLM.forward because generate() inspects this
        # signature (logits_to_keep, attention_mask, position_ids); the rest (output_hidden_states, ...)
        # passes through, which keeps hidden-state capture working.
        return self.language_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )


# Checkpoint keys are per expert; the built-in module wants them stacked. Registering by class name makes
# transformers apply it to this remote class (and reverse it in save_pretrained).
register_checkpoint_conversion_mapping(
    ARCHITECTURE, get_checkpoint_conversion_mapping("deepseek_v3"), overwrite=True
)

__all__ = ["KimiK25DemoForConditionalGeneration", "KimiK25DemoPreTrainedModel"]
