"""The model-family registry (module_utils/regen_families.py) against every consumer that reads it.

Each model type of the registry must get an answer from the config reader, the plan's SGLang parsers, the
launch line's fallback parsers, the SpecForge template and the thinking switch; no other module may keep
a table of its own; real configs and SpecForge's published Kimi drafter agree with the rows; and the
The "Add a model family" recipe (docs/model-families.md) names every place a new row reaches (PLACES below).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from ansible.module_utils import regen_config, regen_drafter, regen_plan, regen_serving, regen_tokenizer
from ansible.module_utils.regen_families import (
    FAMILIES,
    TEXT_CONFIG_KEYS,
    THINKING_SWITCHES,
    family_of,
    text_config,
)

TYPES = sorted(FAMILIES)
CONFIGS = ROOT / "tests" / "fixtures" / "configs"

# Every place a new registry row reaches, with what it does there; the recipe in docs/model-families.md
# must name each one.
PLACES = {
    "module_utils/regen_families.py": "the row itself",
    "module_utils/regen_config.py": "the config reader knows the type and where its text config lives",
    "module_utils/regen_plan.py": "the plan's SGLang parsers and thinking-switch kwargs",
    "module_utils/regen_serving.py": "the launch line's fallback parsers",
    "module_utils/regen_drafter.py": "SpecForge's chat-template name",
    "module_utils/regen_tokenizer.py": "which template variables are a thinking switch",
    "tests/unit/test_registry.py": "every consumer answers for the row",
    "tests/unit/test_serving_argv.py": "the parser names are choices of SGLang 0.5.23",
    "tests/unit/test_drafter_specforge.py": "the template name is registered in SpecForge 0.2.0",
    "tests/fixtures/configs/": "a real config.json of the family (optional, checked when present)",
}


def _arch(model_type: str) -> dict:
    return regen_config.normalize_config(
        {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 128,
         "num_attention_heads": 4}
    )


def _plan_generation(arch: dict, tokenizer: dict) -> dict:
    return regen_plan.make_plan(arch, tokenizer)["generation"]


@pytest.mark.parametrize("model_type", TYPES)
def test_every_consumer_answers_for_every_row(model_type: str) -> None:
    row = FAMILIES[model_type]
    arch = _arch(model_type)
    # config reader: a known type, so no "not one regen knows" warning
    assert not [w for w in arch["warnings"] if "regen knows" in w], arch["warnings"]
    # the plan: the row's parsers once the tokenizer can think
    generation = _plan_generation(arch, {"think_tokens": [{"id": 1, "content": "<think>"}]})
    assert generation["reasoning_parser"]["value"] == row.reasoning_parser
    assert generation["tool_call_parser"]["value"] == row.tool_call_parser
    assert model_type in generation["tool_call_parser"]["reason"]
    # the launch line without a plan falls back to the same parsers
    launch = regen_serving.plan_server(
        {"model_path": "/models/m", "python": "/venv/bin/python", "facts": {"architecture": arch},
         "gpu_count": 1}
    )
    assert launch["settings"]["reasoning_parser"]["value"] == row.reasoning_parser
    assert launch["settings"]["tool_call_parser"]["value"] == row.tool_call_parser
    # SpecForge's template: the row's, or SpecForge's default where the row has none
    expected = row.specforge_chat_template or regen_drafter.DEFAULT_SPECFORGE_CHAT_TEMPLATE
    assert regen_drafter.specforge_chat_template(arch) == expected


def test_an_unknown_type_is_known_to_no_consumer() -> None:
    # The counterpart of the test above: without a row, every consumer says it does not know the type.
    arch = _arch("no_such_family")
    assert any("regen knows" in w for w in arch["warnings"])
    generation = _plan_generation(arch, {"think_tokens": [{"id": 1, "content": "<think>"}]})
    assert generation["reasoning_parser"]["value"] is None and generation["tool_call_parser"]["value"] is None
    assert regen_drafter.specforge_chat_template(arch) == regen_drafter.DEFAULT_SPECFORGE_CHAT_TEMPLATE
    assert family_of(arch) is None


@pytest.mark.parametrize("switch", list(THINKING_SWITCHES))
def test_every_thinking_switch_is_detected_and_planned(switch: str) -> None:
    template = regen_tokenizer.analyze_chat_template(
        "{% if " + switch + " %}<think>{% endif %}{{ messages }}", "chat_template.jinja"
    )
    assert template["thinking_switch"] == switch
    generation = _plan_generation(_arch("qwen3"), {"chat_template": template})
    assert generation["chat_template_kwargs"]["value"] == {switch: THINKING_SWITCHES[switch]}


def test_rows_name_only_switches_the_consumers_know() -> None:
    unknown = {t: row.thinking_switch for t, row in FAMILIES.items()
               if row.thinking_switch is not None and row.thinking_switch not in THINKING_SWITCHES}
    assert unknown == {}


@pytest.mark.parametrize("model_type", [t for t in TYPES if FAMILIES[t].text_config_key])
def test_wrapper_rows_nest_a_known_language_model(model_type: str) -> None:
    row = FAMILIES[model_type]
    assert row.text_config_key in TEXT_CONFIG_KEYS
    assert row.text_model_type in FAMILIES, "the nested language model needs a row of its own"
    config = {"model_type": model_type,
              row.text_config_key: {"model_type": row.text_model_type, "hidden_size": 32}}
    arch = regen_config.normalize_config(config)
    assert (arch["text_config_key"], arch["text_model_type"]) == (row.text_config_key, row.text_model_type)
    assert arch["hidden_size"] == 32 and text_config(config) == config[row.text_config_key]


@pytest.mark.parametrize("directory", sorted(p.name for p in CONFIGS.iterdir() if p.is_dir()))
def test_real_configs_agree_with_their_row(directory: str) -> None:
    config = json.loads((CONFIGS / directory / "config.json").read_text())
    row = FAMILIES.get(config["model_type"])
    assert row is not None, f"{directory}: model_type {config['model_type']} has no registry row"
    nested = [key for key in TEXT_CONFIG_KEYS if isinstance(config.get(key), dict)]
    assert nested == ([row.text_config_key] if row.text_config_key else [])
    if row.text_config_key:
        assert config[row.text_config_key]["model_type"] == row.text_model_type
    tokenizer_config = CONFIGS / directory / "tokenizer_config.json"
    if tokenizer_config.is_file():
        text, source = regen_tokenizer.find_chat_template(
            str(CONFIGS / directory), json.loads(tokenizer_config.read_text())
        )
        detected = regen_tokenizer.analyze_chat_template(text, source)["thinking_switch"]
        # an older template of the family may have no switch; never a different one
        assert detected in (None, row.thinking_switch)


def test_published_kimi_drafter_matches_specforges_config_and_our_layer_choice() -> None:
    recipes = {t: row.drafter_recipe for t, row in FAMILIES.items() if row.drafter_recipe}
    assert "kimi_k25" in recipes
    published = json.loads(
        (ROOT / "tests" / "fixtures" / "drafter" / "specforge" / "kimi-k2.7-code-dflash.json").read_text()
    )
    kimi = recipes["kimi_k25"]
    assert (kimi.num_draft_layers, kimi.block_size, kimi.target_num_layers) == (
        published["num_hidden_layers"], published["block_size"], published["num_target_layers"]
    )
    assert kimi.mask_token_id == published["dflash_config"]["mask_token_id"]
    assert list(kimi.target_layer_ids) == published["dflash_config"]["target_layer_ids"]
    kimi_config = json.loads((CONFIGS / "kimi-k2.5" / "config.json").read_text())
    assert kimi_config["text_config"]["num_hidden_layers"] == kimi.target_num_layers
    for model_type, recipe in recipes.items():
        # the one target-layer function reproduces every published choice
        assert list(recipe.target_layer_ids) == regen_plan.dflash_target_layer_ids(
            recipe.target_num_layers, recipe.num_draft_layers
        ), model_type


def _string_constants(path: Path) -> set[str]:
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


# Model-type strings that are not a family table: the DFlash draft model is a Qwen3-architecture model.
NOT_A_TABLE = {
    ("module_utils/regen_drafter.py", regen_drafter.DRAFT_MODEL_TYPE),
    # a backend-table row keyed on an attention trait (sinks) that only gpt-oss has; not a family table
    ("module_utils/regen_attention_backends.py", "gpt_oss"),
}


def test_no_other_module_keeps_a_table_of_model_types() -> None:
    # A model_type spelled out anywhere but the registry is a second table in the making.
    sources = [*(ROOT / "module_utils").glob("*.py"), *(ROOT / "library").glob("*.py")]
    found = {
        (str(path.relative_to(ROOT)), name)
        for path in sources
        if path.name != "regen_families.py"
        for name in _string_constants(path) & set(FAMILIES)
    }
    assert found - NOT_A_TABLE == set()


def test_every_registry_consumer_is_a_listed_place() -> None:
    # A module that starts reading the registry must join PLACES (and so docs/model-families.md's recipe).
    importers = {
        f"module_utils/{path.name}"
        for path in (ROOT / "module_utils").glob("*.py")
        if re.search(r"^\s*from (ansible\.module_utils\.|\.)?regen_families import", path.read_text(), re.M)
    }
    assert importers
    assert importers <= set(PLACES)


def test_readme_recipe_names_every_place_a_row_reaches() -> None:
    readme = (ROOT / "docs" / "model-families.md").read_text()
    match = re.search(r"^## Add a model family\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert match, "docs/model-families.md has no '## Add a model family' section"
    for place in PLACES:
        assert (ROOT / place).exists(), place
        assert f"`{place}`" in match.group(1), f"the recipe does not name {place}"
