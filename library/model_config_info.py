#!/usr/bin/python
"""Ansible module: normalized architecture facts from a Hugging Face model directory."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: model_config_info
short_description: Read a model directory's config.json into normalized architecture facts
description:
  - Reads C(config.json), and when present C(generation_config.json), C(hf_quant_config.json) and the
    safetensors index or shard headers, and returns one normalized architecture document.
  - Understands wrapper configs that nest the language model under C(text_config) (Kimi K2.5/K2.6,
    Qwen3.5/3.6) as well as flat ones (DeepSeek-V3, Qwen3, gpt-oss, Llama 3, Mixtral, GLM MoE).
  - Unknown architectures still return every value that can be read, with C(warnings).
  - Needs only the Python standard library on the target.
version_added: "0.1.0"
author: regen maintainers
options:
  path:
    description: Model directory holding C(config.json).
    type: path
    required: true
  read_safetensors_headers:
    description:
      - Sum tensor sizes from the C(.safetensors) headers when the index has no C(total_size).
      - Only the small JSON header of each shard is read, never the weights.
    type: bool
    default: true
attributes:
  check_mode:
    support: full
notes:
  - Runs with the interpreter of the task; it imports nothing outside the standard library.
"""

EXAMPLES = r"""
- name: Read the architecture of the target model
  model_config_info:
    path: /root/models/Kimi-K2.6
  register: _arch

- name: Show the MoE layout
  ansible.builtin.debug:
    msg: "{{ _arch.architecture.moe }}"
"""

RETURN = r"""
architecture:
  description: Normalized architecture facts.
  returned: success
  type: dict
  contains:
    model_type:
      description: Top-level C(model_type) (the wrapper type for multimodal configs, e.g. C(kimi_k25)).
      type: str
      sample: kimi_k25
    text_model_type:
      description: C(model_type) of the language model (nested C(text_config) when present).
      type: str
      sample: deepseek_v3
    architectures:
      description: C(architectures) list of the config.
      type: list
      elements: str
    hidden_size:
      description: Hidden size of the language model.
      type: int
      sample: 7168
    num_layers:
      description: Number of decoder layers (MTP layers excluded; see C(mtp_layers)).
      type: int
      sample: 61
    vocab_size:
      description: Embedding table size from the config.
      type: int
      sample: 163840
    max_position_embeddings:
      description: Context length the config declares.
      type: int
    attention:
      description: C(kind) (mla, gqa or mha), C(heads), C(kv_heads), C(head_dim), C(kv_lora_rank),
        C(q_lora_rank) and the MLA head dims; C(layer_types) counts for hybrid models.
      type: dict
    moe:
      description: Null for dense models; else C(routed_experts), C(shared_experts), C(experts_per_token),
        C(expert_intermediate_size), C(dense_prefix_layers), C(n_group), C(topk_group) and routing details.
      type: dict
    quantization:
      description: Null when unquantized; else C(method), C(bits), C(format), C(group_size), C(ignores),
        C(source) and C(kv_cache) (the declared KV-cache format, or null).
      type: dict
    dtype:
      description: Declared parameter dtype.
      type: str
      sample: bfloat16
    special_token_ids:
      description: C(bos), C(eos) (a list, config plus generation config) and C(pad) ids.
      type: dict
    parameters:
      description: C(total) and C(active) (per token) parameter estimates from the shapes.
      type: dict
    weight_bytes:
      description: Checkpoint bytes from the safetensors index or headers, else an estimate.
      type: int
    weight_bytes_source:
      description: C(safetensors_index), C(safetensors_headers) or C(estimate).
      type: str
    kv_cache_bytes_per_token:
      description: KV-cache bytes one token needs across all layers, at the size of C(kv_cache_dtype).
      type: int
    kv_cache_dtype:
      description:
        - The KV cache's element format, C(dtype) (SGLang's name), C(bytes) per element and C(source).
        - The format the checkpoint declares (C(quantization_config.kv_cache_scheme), ModelOpt's
          C(kv_cache_quant_algo)), else the model's dtype.
      type: dict
    warnings:
      description: What could not be read, and why.
      type: list
      elements: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_config import ModelDirError, read_model_dir


def main():
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "read_safetensors_headers": {"type": "bool", "default": True},
        },
        supports_check_mode=True,
    )
    try:
        arch = read_model_dir(module.params["path"], module.params["read_safetensors_headers"])
    except ModelDirError as exc:
        module.fail_json(msg=str(exc), path=module.params["path"])
    for warning in arch["warnings"]:
        module.warn(warning)
    module.exit_json(changed=False, architecture=arch)


if __name__ == "__main__":
    main()
