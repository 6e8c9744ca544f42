"""The DFlash drafter plan (module_utils/regen_drafter.py): layer spread, config from facts, disk budget.

Golden configs are checked for Kimi K2.6, Qwen3-8B and DeepSeek-V3 from their real config.json files run
through the real introspection code (module_utils/regen_config.py), and against the real DFlash configs
SpecForge ships (tests/fixtures/drafter/specforge, sources in tests/fixtures/drafter/SOURCES.md).
Regenerate the goldens after an intended change with REGEN_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]

from ansible.module_utils import regen_config
from ansible.module_utils import regen_drafter as d
from ansible.module_utils.regen_plan import dflash_target_layer_ids

FIXTURES = ROOT / "tests" / "fixtures" / "drafter"

# (name, mask token id the tokenizer facts report, keyword overrides) -> golden file
CASES = {
    # Kimi's reserved special-token slot 163838, the id SpecForge's own Kimi DFlash config uses.
    "kimi-k2.6": (163838, {}),
    # The first id past Qwen3's 151669 tokens: what SpecForge's qwen3 DFlash configs use.
    "qwen3-8b": (151669, {}),
    # The first id past DeepSeek-V3's 128815-token tokenizer (vocab is padded to 129280).
    "deepseek-v3": (128815, {}),
}


def _target(name: str) -> dict:
    return json.loads((FIXTURES / "targets" / name / "config.json").read_text())


def _facts(name: str, mask: int, plan: dict | None = None) -> dict:
    facts = {
        "architecture": regen_config.normalize_config(_target(name)),
        "tokenizer": {"mask_token": {"id": mask, "reason": "fixture"}},
    }
    if plan is not None:
        facts["plan"] = {"drafter": plan}
    return facts


def _specforge(name: str) -> dict:
    return json.loads((FIXTURES / "specforge" / name).read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_drafter_configs(name: str) -> None:
    mask, overrides = CASES[name]
    config, reasons, warnings = d.draft_config(_facts(name, mask), _target(name), **overrides)
    golden = FIXTURES / "golden" / f"{name}.json"
    if os.environ.get("REGEN_UPDATE_GOLDEN"):
        golden.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    assert config == json.loads(golden.read_text())
    assert warnings == []
    assert set(reasons) >= {
        "target_layer_ids",
        "num_hidden_layers",
        "block_size",
        "mask_token_id",
        "head_dim",
    }


def test_kimi_k26_numbers() -> None:
    config, _, _ = d.draft_config(_facts("kimi-k2.6", 163838), _target("kimi-k2.6"))
    assert (config["hidden_size"], config["vocab_size"], config["num_target_layers"]) == (7168, 163840, 61)
    # With no plan in the facts, the plan's rule: the published Kimi drafter's 6 layers and blocks of 8.
    assert config["dflash_config"] == {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838}
    assert config["block_size"] == 8 and config["num_hidden_layers"] == 6
    # Kimi nests the language model under text_config: rope comes from there, in SpecForge's classic keys.
    assert config["rope_theta"] == 50000.0 and config["rope_scaling"]["factor"] == 64.0
    assert config["max_position_embeddings"] == 262144


def test_qwen3_8b_reproduces_specforges_own_config() -> None:
    """Every value SpecForge's configs/qwen3-8b-dflash.json sets, we derive identically from Qwen3-8B."""
    ours, _, _ = d.draft_config(_facts("qwen3-8b", 151669), _target("qwen3-8b"))
    real = _specforge("qwen3-8b-dflash.json")
    differing = {k: (real[k], ours.get(k)) for k in real if k != "auto_map" and real[k] != ours.get(k)}
    assert differing == {}
    # SpecForge's qwen3-4b config spells out the layers and mask id the 8B one leaves to the trainer.
    assert ours["dflash_config"] == _specforge("qwen3-4b-dflash.json")["dflash_config"]


def test_kimi_defaults_reproduce_specforges_kimi_config() -> None:
    """Unset, Kimi K2.6's drafter is SpecForge's published Kimi K2.7 DFlash config exactly."""
    ours, reasons, _ = d.draft_config(_facts("kimi-k2.6", 163838), _target("kimi-k2.6"))
    assert all("published drafter" in reasons[key] for key in ("block_size", "num_hidden_layers"))
    real = _specforge("kimi-k2.7-code-dflash.json")
    ignored = {"transformers_version", "mask_token_id"}  # a version stamp and a duplicate of dflash_config's
    differing = {k: (real[k], ours.get(k)) for k in real if k not in ignored and real[k] != ours.get(k)}
    assert differing == {}


@pytest.mark.parametrize(
    "real",
    [
        "qwen3-8b-dflash.json",
        "qwen3-4b-dflash.json",
        "kimi-k2.7-code-dflash.json",
        "longcat-flash-dflash.json",
    ],
)
@pytest.mark.parametrize("name", sorted(CASES))
def test_shape_matches_real_specforge_configs(real: str, name: str) -> None:
    ours, _, _ = d.draft_config(_facts(name, CASES[name][0]), _target(name))
    reference = _specforge(real)
    allowed_extra_in_reference = {"transformers_version", "mask_token_id", "bos_token_id", "eos_token_id"}
    assert set(reference) - set(ours) <= allowed_extra_in_reference
    for key in set(reference) & set(ours):
        assert (
            type(ours[key]) is type(reference[key])
            or {type(ours[key]), type(reference[key])} <= {int, float}
            or None in (ours[key], reference[key])
        ), key
    assert ours["architectures"] == reference["architectures"] == ["DFlashDraftModel"]
    assert len(ours["layer_types"]) == ours["num_hidden_layers"] == ours["max_window_layers"]


@pytest.mark.parametrize(
    ("layers", "draft", "expected"),
    [
        (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-8B / 4B, SpecForge's qwen3 DFlash configs
        (61, 6, [1, 12, 24, 35, 47, 58]),  # Kimi, SpecForge's kimi-k2.7 DFlash config
        (61, 5, [1, 15, 30, 44, 58]),  # 29.5 rounds half to even: 30
        (61, 1, [30]),
        (8, 2, [1, 5]),
    ],
)
def test_target_layer_spread(layers: int, draft: int, expected: list[int]) -> None:
    assert dflash_target_layer_ids(layers, draft) == expected


@given(layers=st.integers(min_value=5, max_value=200), data=st.data())
def test_spread_is_distinct_and_spans_the_target(layers: int, data: st.DataObject) -> None:
    draft = data.draw(st.integers(min_value=2, max_value=layers - 3))
    ids = dflash_target_layer_ids(layers, draft)
    assert d.check_target_layer_ids(ids, layers) == ids
    assert ids[0] == 1 and ids[-1] == layers - 3 and len(ids) == draft


def test_too_many_draft_layers_for_a_small_target_is_a_clear_error() -> None:
    with pytest.raises(d.DrafterPlanError, match="use fewer draft layers"):
        d.check_target_layer_ids(dflash_target_layer_ids(6, 5), 6)


def test_plan_values_are_used_and_inventory_overrides_them() -> None:
    plan = {
        "num_draft_layers": {"value": 3, "reason": "r"},
        "target_layer_ids": {"value": [2, 20, 40], "reason": "r"},
        "block_size": {"value": 8, "reason": "r"},
        "mask_token_id": {"value": 163839, "reason": "r"},
    }
    facts = _facts("kimi-k2.6", 163838, plan)
    config, reasons, _ = d.draft_config(facts, _target("kimi-k2.6"))
    assert config["dflash_config"] == {"target_layer_ids": [2, 20, 40], "mask_token_id": 163839}
    assert config["block_size"] == 8 and "plan" in reasons["target_layer_ids"]
    # An inventory layer count that disagrees with the plan's ids re-derives the ids.
    config, _, _ = d.draft_config(
        facts, _target("kimi-k2.6"), num_draft_layers=6, block_size=16, mask_token_id=5
    )
    assert config["dflash_config"] == {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 5}
    assert config["block_size"] == 16
    config, _, _ = d.draft_config(facts, _target("kimi-k2.6"), target_layer_ids=[3, 4])
    assert config["dflash_config"]["target_layer_ids"] == [3, 4] and config["num_hidden_layers"] == 2


def test_facts_alone_give_a_config_with_a_warning() -> None:
    config, _, warnings = d.draft_config(_facts("qwen3-8b", 151669), None)
    assert config["hidden_size"] == 4096 and config["max_position_embeddings"] == 40960
    assert any("no target config.json" in w for w in warnings)


@pytest.mark.parametrize(
    ("facts", "kwargs", "message"),
    [
        ({}, {}, "run the introspect stage"),
        ({"architecture": {"hidden_size": 8}}, {}, "num_layers, vocab_size"),
        ("FACTS", {}, "no `architecture`"),
    ],
)
def test_unusable_facts_say_what_to_do(facts, kwargs, message) -> None:
    with pytest.raises(d.DrafterPlanError, match=message):
        d.draft_config(facts, None, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mask_token_id": 163840}, "outside the target vocabulary"),
        ({"block_size": 1}, "block_size must be an integer >= 2"),
        ({"target_layer_ids": [0, 61]}, "outside the target's 61 layers"),
        ({"target_layer_ids": [5, 5]}, "repeat or go backwards"),
        ({"num_key_value_heads": 7}, "does not divide the 64 attention heads"),
    ],
)
def test_bad_overrides_are_refused(kwargs, message) -> None:
    with pytest.raises(d.DrafterPlanError, match=message):
        d.draft_config(_facts("kimi-k2.6", 163838), _target("kimi-k2.6"), **kwargs)


def test_missing_mask_token_names_the_variable() -> None:
    facts = {"architecture": regen_config.normalize_config(_target("qwen3-8b"))}
    with pytest.raises(d.DrafterPlanError, match="drafter_training_mask_token_id"):
        d.draft_config(facts, _target("qwen3-8b"))


def test_kimi_hidden_state_bytes_per_token() -> None:
    # 5 layers x 7168 x 2 bytes (bf16) = 71680 B = 70 KiB per token.
    assert d.hidden_state_bytes_per_token(7168, 5) == 71680 == 70 * 1024
    assert d.hidden_state_bytes_per_token(4096, 5, "float32") == 81920


def test_hidden_state_mode_follows_the_disk() -> None:
    tb = 1024**4
    # 10M tokens of Kimi K2.6 features: 10e6 * (71680 + 16) B = 667.7 GiB.
    fits = d.plan_hidden_states("auto", 10_000_000, 7168, 5, free_bytes=2 * tb)
    assert fits["mode"] == "offline" and fits["required_bytes"] == 10_000_000 * 71696
    assert "71680 B/token" in fits["arithmetic"] and fits["warnings"] == []
    tight = d.plan_hidden_states("auto", 10_000_000, 7168, 5, free_bytes=1 * tb)
    assert tight["mode"] == "offline" and "of the 1.0 TiB free" in tight["warnings"][0]
    full = d.plan_hidden_states("auto", 10_000_000, 7168, 5, free_bytes=500 * 1024**3)
    assert full["mode"] == "online" and "only 500.0 GiB is free" in full["reason"]
    with pytest.raises(d.DrafterPlanError, match=r"needs 667\.7 GiB .* 500\.0 GiB free"):
        d.plan_hidden_states("offline", 10_000_000, 7168, 5, free_bytes=500 * 1024**3)
    assert d.plan_hidden_states("online", 10, 7168, 5, free_bytes=0)["mode"] == "online"
    # A cap below the free space is the budget, and its refusal names the cap.
    capped = d.plan_hidden_states("auto", 10_000_000, 7168, 5, free_bytes=2 * tb, max_bytes=100 * 1024**3)
    assert capped["mode"] == "online" and capped["budget_bytes"] == 100 * 1024**3
    assert "drafter_training_hidden_states_max_bytes allows 100.0 GiB" in capped["reason"]
    with pytest.raises(d.DrafterPlanError, match=r"max_bytes allows 100\.0 GiB.*topology: rolling"):
        d.plan_hidden_states("offline", 10_000_000, 7168, 5, free_bytes=2 * tb, max_bytes=100 * 1024**3)
    assert d.disk_budget(1000, 0.5) == 500 and d.disk_budget(1000, 0.5, 300) == 300
    assert d.disk_budget(None, 0.5) is None and d.disk_budget(None, 0.5, 300) == 300
    with pytest.raises(d.DrafterPlanError, match="choose one of auto, offline, online"):
        d.plan_hidden_states("disk", 10, 7168, 5, free_bytes=0)


def test_step_horizon_and_topology() -> None:
    assert d.total_steps(8, batch_size=2) == 4
    # 1000 samples / 8 ranks = 125 each -> 62 batches of 2 -> x2 epochs = 124 -> /4 accumulation = 31.
    assert d.total_steps(1000, batch_size=2, world_size=8, accumulation_steps=4, num_epochs=2) == 31
    assert d.total_steps(8, batch_size=2, max_steps=3) == 3
    # SpecForge pads the data to a multiple of the ranks (DistributedSampler): 3 samples on 2 ranks are 2
    # per rank, one batch of 2 each; 1001 samples on 8 ranks are 126 each, 63 batches, 126 / 4 = 31.
    assert d.total_steps(3, batch_size=2, world_size=2) == 1
    assert d.total_steps(1001, batch_size=2, world_size=8, accumulation_steps=4, num_epochs=2) == 31
    with pytest.raises(d.DrafterPlanError, match="no optimizer step"):
        d.total_steps(1, batch_size=2, world_size=1)
    topo = d.trainer_topology(["a", "b"], "b", 8)
    assert topo == {
        "nnodes": 2,
        "node_rank": 1,
        "nproc_per_node": 8,
        "master_host": "a",
        "master_port": 29500,
    }
    assert d.sglang_dflash_args("/x", 8) == [
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        "/x",
        "--speculative-num-draft-tokens",
        "8",
    ]


def test_embedding_and_head_keys_prefer_the_language_model() -> None:
    keys = [
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
        "vision_tower.encoder.blocks.0.wqkv.weight",
        "mm_projector.lm_head.weight",
    ]
    assert d.embedding_and_head_keys(keys) == (
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
    )
    assert d.embedding_and_head_keys(["model.embed_tokens.weight"]) == ("model.embed_tokens.weight", None)


def test_weight_keys_read_safetensors_headers(tmp_path: Path) -> None:
    header = json.dumps(
        {
            "model.embed_tokens.weight": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
            "__metadata__": {"format": "pt"},
        }
    ).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    assert d.weight_keys(str(tmp_path)) == ["model.embed_tokens.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "a"}})
    )
    assert d.weight_keys(str(tmp_path)) == ["lm_head.weight"]


def test_config_digest_is_stable_and_order_free() -> None:
    assert d.config_digest({"a": 1, "b": [1, 2]}) == d.config_digest({"b": [1, 2], "a": 1})
    assert d.config_digest({"a": 1}) != d.config_digest({"a": 2})
