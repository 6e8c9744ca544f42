# Configuration of the regen demo model: a tiny stand-in with the layout of Kimi K2.5/K2.6.
# Written by the regen project (not Moonshot code); copied into the demo model directory by
# `python -m regen.demo.build` and loaded from there with trust_remote_code=True.
"""Configuration classes of the regen demo model (Kimi K2.5/K2.6 layout at tiny scale).

The real checkpoint wraps a DeepSeek-V3 language model (MLA attention + MoE) in a multimodal config:
``config.json`` has ``model_type: kimi_k25`` at the top, the language model under ``text_config``
(``model_type: kimi_k2``) and a ``vision_config``. This module mirrors that nesting.

Why ``kimi_k25_demo`` and not ``kimi_k25`` at the top: transformers 5.x ships a built-in ``kimi_k25`` in
its CONFIG_MAPPING. With that name, loading without ``trust_remote_code`` would silently pick the built-in
multimodal classes (which expect a vision tower this demo does not have) instead of failing, and
``transformers serve`` would route the model through ``AutoModelForMultimodalLM``. A distinct name keeps
the demo on its own code. ``kimi_k2`` (the real text model type) is not a built-in, so it is kept.
"""

import sys
import types
from typing import ClassVar

from transformers.configuration_utils import PreTrainedConfig
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

ARCHITECTURE = "KimiK25DemoForConditionalGeneration"


class KimiK2DemoTextConfig(DeepseekV3Config):
    """The language model's config: DeepSeek-V3 fields (MLA ranks, MoE routing) under Kimi's text type."""

    model_type = "kimi_k2"


class KimiK25DemoConfig(PreTrainedConfig):
    """Top-level wrapper: the text model under ``text_config``, vision metadata under ``vision_config``.

    ``vision_config`` is carried for layout fidelity only: the demo has no vision tower, so stages meet a
    multimodal-looking config.json and must still find and use the text model inside it.
    """

    model_type = "kimi_k25_demo"
    sub_configs_defaults: ClassVar[dict] = {"text_config": KimiK2DemoTextConfig}

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | None = None
    ignore_index: int = -100
    media_placeholder_token_id: int | None = None
    use_unified_vision_chunk: bool = True
    video_placeholder: str = "<|kimi_k25_video_placeholder|>"
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False


def _transformers_namespaces() -> list[types.ModuleType]:
    """Every live ``transformers`` module object: the one in sys.modules and any older one still held.

    transformers 5.x can swap the object in ``sys.modules["transformers"]`` while importing its own
    submodules (seen when AutoProcessor is imported), so modules imported earlier, such as serve's model
    manager, keep a different object than ``import transformers`` returns later. ``vars()`` is used so that
    no lazy attribute is triggered while looking.
    """
    found: dict[int, types.ModuleType] = {}
    candidates = [sys.modules.get("transformers")]
    for module in list(sys.modules.values()):
        try:
            candidates.append(vars(module).get("transformers"))
        except TypeError:
            continue
    for candidate in candidates:
        if isinstance(candidate, types.ModuleType) and candidate.__name__ == "transformers":
            found[id(candidate)] = candidate
    return list(found.values())


def _publish_architecture_for_transformers_serve() -> None:
    """Make ``getattr(transformers, ARCHITECTURE)`` resolve, so ``transformers serve`` can load the demo.

    transformers 5.x ``serve`` (cli/serving/model_manager.py, ``ModelManager._load_model``) picks the class
    of a non-multimodal checkpoint with ``getattr(transformers, config.architectures[0])``. That only finds
    classes shipped inside transformers, so every remote-code architecture fails there with an
    AttributeError even with ``--trust-remote-code``. serve imports this module (through AutoProcessor and
    AutoConfig) before that lookup, so this module publishes a small loader under the architecture's name
    that goes back through ``AutoModelForCausalLM``, which honours ``auto_map`` and ``trust_remote_code``.
    Nothing that already exists in transformers is replaced.
    """

    class _AutoMapLoader:
        """Stand-in found by ``getattr(transformers, "KimiK25DemoForConditionalGeneration")``."""

        __name__ = ARCHITECTURE

        @staticmethod
        def from_pretrained(pretrained_model_name_or_path, *args, **kwargs):
            from transformers import AutoModelForCausalLM

            kwargs.setdefault("trust_remote_code", True)
            return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    for namespace in _transformers_namespaces():
        if ARCHITECTURE not in vars(namespace):
            setattr(namespace, ARCHITECTURE, _AutoMapLoader)


_publish_architecture_for_transformers_serve()

__all__ = ["KimiK2DemoTextConfig", "KimiK25DemoConfig"]
