#!/usr/bin/python
"""Ansible module: tokenizer facts, through the real loader or, when it fails, the raw files."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: tokenizer_info
short_description: Tokenizer facts, with the reason when the standard loader fails
description:
  - Tries C(AutoTokenizer.from_pretrained(path, trust_remote_code=True)) first. When that fails (for example
    the venv lacks C(tiktoken)) it records C(load.error_type), C(load.missing_modules) and a one-line
    C(load.remedy) naming the venv and the package, then reads the raw files (C(tokenizer_config.json),
    C(special_tokens_map.json), C(added_tokens_decoder), C(chat_template.jinja), C(tiktoken.model) or
    C(tokenizer.json)) so the facts are still produced.
  - When no tokenizer files can be read at all (a config-only model directory, a corrupt file), returns
    C(available=false) with C(unavailable.reason) and C(unavailable.remedy) and every value unknown (null),
    unless O(require_files) (or O(mode=library)) makes that a failure.
  - Warns when the tokenizer's id count disagrees with the config's C(vocab_size) beyond padding.
  - Returns special tokens with ids, a DFlash mask-token candidate with its reason, the chat template's
    source, sha256 and thinking switch, and a rendered two-turn sample when the library loaded.
  - When the library loads, the raw files are read too and every value both paths can see is compared
    (C(agreement)).
version_added: "0.1.0"
author: regen maintainers
options:
  path:
    description: Directory with the tokenizer files (usually the model directory).
    type: path
    required: true
  mode:
    description:
      - C(auto) tries the library and falls back to the raw files; C(library) fails when the library
        cannot load; C(raw_files) never imports C(transformers).
    type: str
    choices: [auto, library, raw_files]
    default: auto
  trust_remote_code:
    description: Let the library run the tokenizer code shipped with the model (Kimi's tiktoken
      tokenizer needs it).
    type: bool
    default: true
  remedy_variable:
    description: Inventory variable named in C(load.remedy) as the place to add missing packages.
    type: str
    default: regen_serving_packages
  require_files:
    description: Fail when the tokenizer files are missing or unreadable, instead of returning
      C(available=false) with the reason and the remedy.
    type: bool
    default: false
  sample_messages:
    description: Conversation rendered through the chat template when the library loads.
    type: list
    elements: dict
attributes:
  check_mode:
    support: full
notes:
  - Set C(ansible_python_interpreter) to the python of the venv under inspection; the facts describe
    that venv.
"""

EXAMPLES = r"""
- name: Tokenizer facts as the serving venv sees them
  tokenizer_info:
    path: /root/models/Kimi-K2.6
  vars:
    ansible_python_interpreter: /root/venv_sglang/bin/python
  register: _tok

- name: Stop early when the serving venv cannot load the tokenizer
  ansible.builtin.assert:
    that: _tok.tokenizer.loaded_with == 'library'
    fail_msg: "{{ _tok.tokenizer.load.remedy }}"
"""

RETURN = r"""
tokenizer:
  description: Tokenizer facts.
  returned: success
  type: dict
  contains:
    loaded_with:
      description: C(library) or C(raw_files); null when no tokenizer files could be read.
      type: str
    available:
      description: False when no tokenizer facts could be read; every other value is then unknown (null).
      type: bool
    unavailable:
      description: C(reason) and C(remedy) when C(available) is false.
      type: dict
    load:
      description: C(ok), C(error_type), C(error), C(missing_modules), C(remedy), C(python) and C(venv).
      type: dict
      sample:
        ok: false
        error_type: ImportError
        missing_modules: [tiktoken]
        remedy: tiktoken is not installed in /root/venv_sglang; add it to regen_serving_packages
    tokenizer_class:
      description: Class the library instantiated, or the one the files declare.
      type: str
    vocab:
      description: C(base) (BPE ranks or model vocab), C(added), C(total), the config's
        C(config_vocab_size), and C(disagreement) (why they disagree beyond padding, else null).
      type: dict
    named:
      description: bos/eos/pad/unk/mask tokens with C(content) and C(id).
      type: dict
    tokens:
      description: Special tokens (reserved ones counted in C(reserved)) with ids and roles.
      type: list
      elements: dict
    end_of_turn:
      description: End-of-turn tokens.
      type: list
      elements: dict
    role_markers:
      description: Role marker tokens.
      type: list
      elements: dict
    think_tokens:
      description: Thinking delimiters.
      type: list
      elements: dict
    mask_token:
      description: C(token), C(id), C(needs_new_token) and the C(reason) for the DFlash mask token.
      type: dict
    chat_template:
      description: C(source), C(sha256), C(thinking_switch), C(variables) and C(parse_error).
      type: dict
    rendered_sample:
      description: The two-turn sample rendered by the library (null on the raw-files path).
      type: dict
    agreement:
      description: Values where library and raw files disagree (empty list when they agree; null if
        not compared).
      type: list
      elements: dict
    warnings:
      description: Problems found that did not stop the facts.
      type: list
      elements: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.regen_tokenizer import TokenizerError, gather


def main():
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "mode": {"type": "str", "default": "auto", "choices": ["auto", "library", "raw_files"]},
            "trust_remote_code": {"type": "bool", "default": True},
            "remedy_variable": {"type": "str", "default": "regen_serving_packages"},
            "sample_messages": {"type": "list", "elements": "dict"},
            "require_files": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    params = module.params
    try:
        facts = gather(
            params["path"],
            params["mode"],
            params["trust_remote_code"],
            params["remedy_variable"],
            params["sample_messages"],
            unreadable="raise" if params["require_files"] else "unknown",
        )
    except TokenizerError as exc:
        module.fail_json(msg=str(exc), path=params["path"])
    for warning in facts["warnings"]:
        module.warn(warning)
    module.exit_json(changed=False, tokenizer=facts)


if __name__ == "__main__":
    main()
