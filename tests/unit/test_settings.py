"""The one table of plan-backed settings (module_utils/regen_settings.py), its resolver and its recipe.

The resolver is called as the roles call it (plan entries {value, reason}, every override variable passed);
the recipe test reads the roles and docs/settings.md so that "one table row plus one role variable" stays
true: every row's variable is a declared, documented, defaulted variable of its role, and the role's one
stage_settings_info call passes exactly its stage's variables.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from ansible.module_utils.regen_disagg import CAPTURE_CONTEXT_HEADROOM
from ansible.module_utils.regen_settings import SETTINGS, STAGES, SettingsError, resolve, rows

from tests.helpers.modules import run_module

ROOT = Path(__file__).resolve().parents[2]
ROLE_OF_STAGE = {
    "generate": "completions",
    "tokenize": "tokenized_data",
    "train": "drafter_training",
    "capture": "capture_server",
    "evaluate": "drafter_evaluation",
}
PLAN = {
    "length": {
        "max_tokens": {"value": 48, "reason": "the inventory's max_tokens"},
        "budget": {"value": 96, "reason": "longest conversation: 40 + 48 + 8 = 96"},
    },
    "generation": {
        "concurrency": {"value": 4, "reason": "a host without GPUs"},
        "chat_template_kwargs": {"value": {"thinking": True}, "reason": "Kimi's switch"},
    },
    "drafter": {"mask_token_id": {"value": 4000, "reason": "a reserved token"}},
}


def unset(stage: str) -> dict[str, None]:
    return {row.variable: None for row in rows(stage)}


def test_the_plan_gives_each_value_with_its_reason() -> None:
    resolved, notes, unresolved = resolve("generate", PLAN, unset("generate"))
    assert {name: entry["value"] for name, entry in resolved.items()} == {
        "max_tokens": 48, "concurrency": 4, "chat_template_kwargs": {"thinking": True},
    }
    assert resolved["max_tokens"] == {
        "value": 48, "source": "plan", "variable": "completions_max_tokens", "plan_path": "length.max_tokens",
        "reason": "the inventory's max_tokens",
    }
    assert notes == [] and unresolved == []


def test_an_override_wins_and_says_what_it_overrides() -> None:
    overrides = dict(unset("generate"), completions_max_tokens=64, completions_concurrency=4)
    resolved, notes, _ = resolve("generate", PLAN, overrides)
    assert resolved["max_tokens"]["value"] == 64 and resolved["max_tokens"]["source"] == "override"
    assert resolved["concurrency"]["source"] == "override"
    # only the one that differs from the plan is reported
    assert len(notes) == 1 and "completions_max_tokens=64 overrides the plan's length budget" in notes[0]


def test_a_value_from_extra_vars_is_read_as_a_number() -> None:
    overrides = dict(unset("tokenize"), tokenized_data_max_length="64")
    resolved, notes, _ = resolve("tokenize", PLAN, overrides, {"truncation": "drop"})
    assert resolved["max_length"]["value"] == 64
    assert "(regen_max_length) = 64 overrides the plan's length budget of 96 tokens" in notes[0]
    with pytest.raises(SettingsError, match="tokenized_data_max_length: the variable gives 'x'"):
        resolve("tokenize", PLAN, dict(overrides, tokenized_data_max_length="x"), {"truncation": "drop"})


@pytest.mark.parametrize("stage", STAGES)
def test_without_a_plan_each_setting_fails_naming_its_variable_or_takes_its_documented_default(stage) -> None:
    inputs = {"max_new_tokens": 16, "truncation": "drop"}
    for row in rows(stage):
        if row.missing is not None:
            continue
        with pytest.raises(SettingsError, match=re.escape(row.variable)):
            resolve(stage, {}, unset(stage), inputs)
    defaulted = [row for row in rows(stage) if row.missing is not None]
    if defaulted and len(defaulted) == len(rows(stage)):
        resolved, _, _ = resolve(stage, {}, unset(stage), inputs)
        assert all(resolved[row.name]["source"] == "default" for row in defaulted)


def test_a_documented_default_says_why() -> None:
    overrides = dict(unset("tokenize"), tokenized_data_max_length=64, tokenized_data_chat_template_kwargs={})
    resolved, _, _ = resolve("tokenize", {}, overrides, {"truncation": "drop"})
    assert resolved["mask_token_id"]["value"] is None and resolved["mask_token_id"]["source"] == "default"
    assert "checks none" in resolved["mask_token_id"]["reason"]


def test_an_unknown_plan_entry_fails_with_its_reason_and_remedy() -> None:
    plan = {"generation": {"chat_template_kwargs": {
        "value": None, "unknown": True, "reason": "the tokenizer did not load", "remedy": "install tiktoken",
    }}}
    overrides = dict(unset("generate"), completions_max_tokens=8, completions_concurrency=1)
    with pytest.raises(SettingsError) as caught:
        resolve("generate", plan, overrides)
    assert "unknown" in str(caught.value) and "completions_chat_template_kwargs" in str(caught.value)


def test_partial_resolution_lists_what_is_missing_instead_of_failing() -> None:
    resolved, _, unresolved = resolve("train", {}, unset("train"), partial=True)
    assert resolved["max_length"]["value"] is None and resolved["max_length"]["source"] == "unresolved"
    assert len(unresolved) == 1 and "drafter_training_max_length" in unresolved[0]


def test_the_capture_context_is_the_max_length_plus_the_named_headroom() -> None:
    resolved, _, _ = resolve("capture", PLAN, unset("capture"))
    assert resolved["max_length"]["value"] == 96
    assert resolved["context_length"]["value"] == 96 + CAPTURE_CONTEXT_HEADROOM
    assert resolved["context_length"]["source"] == "derived"


def test_the_evaluation_keeps_what_the_budget_leaves_after_the_new_tokens() -> None:
    resolved, _, _ = resolve("evaluate", PLAN, unset("evaluate"), {"max_new_tokens": 16})
    assert resolved["prompt_max_tokens"]["value"] == 96 - 16
    resolved, _, _ = resolve("evaluate", PLAN, unset("evaluate"), {"max_new_tokens": 500})
    assert resolved["prompt_max_tokens"]["value"] == 1


def test_the_sweeps_measured_concurrency_wins_over_the_planned_one() -> None:
    sweep = {"value": {"applied": True, "concurrency": 12}, "reason": "measured"}
    plan = dict(PLAN, serving={"sweep": sweep})
    resolved, _, _ = resolve("generate", plan, unset("generate"))
    assert resolved["concurrency"]["value"] == 12
    assert resolved["concurrency"]["plan_path"] == "serving.sweep.concurrency"


def test_a_call_must_pass_exactly_the_stages_variables() -> None:
    with pytest.raises(SettingsError, match=r"missing \['completions_concurrency'\]"):
        resolve("generate", PLAN, {"completions_max_tokens": None, "completions_chat_template_kwargs": None})


def test_the_module_fails_naming_the_variable(capsys) -> None:
    result = run_module("stage_settings_info", {"stage": "train", "overrides": unset("train")}, capsys)
    assert result["failed"] and "drafter_training_max_length" in result["msg"]


# -- the recipe "add a plan-backed setting" (docs/settings.md) ---------------------------------------------


def _settings_calls(role: str) -> list[dict]:
    calls = []
    for path in sorted((ROOT / "roles" / role / "tasks").glob("*.yml")):
        for task in yaml.safe_load(path.read_text()) or []:
            if isinstance(task, dict) and "stage_settings_info" in task:
                calls.append(task["stage_settings_info"])
    return calls


@pytest.mark.parametrize("row", SETTINGS, ids=lambda row: f"{row.stage}.{row.name}")
def test_each_row_has_its_role_variable_declared_defaulted_and_documented(row) -> None:
    role = ROLE_OF_STAGE[row.stage]
    assert row.variable.startswith(role + "_"), f"{row.variable} is not a variable of role {role}"
    specs = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
    option = specs["argument_specs"]["main"]["options"].get(row.variable)
    assert option and option.get("description"), f"{row.variable} is not declared in {role}'s argument_specs"
    defaults = yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text())
    assert row.variable in defaults, f"{row.variable} has no default in roles/{role}/defaults/main.yml"
    docs = (ROOT / "docs" / "settings.md").read_text()
    assert f"`{row.variable}`" in docs, f"docs/settings.md omits {row.variable}"
    assert f"`{row.plan[0]}`" in docs, f"docs/settings.md omits {row.plan[0]}"


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_role_makes_one_call_passing_exactly_its_variables(stage) -> None:
    calls = [call for call in _settings_calls(ROLE_OF_STAGE[stage]) if call.get("stage") == stage]
    role = ROLE_OF_STAGE[stage]
    assert len(calls) == 1, f"roles/{role} calls stage_settings_info for {stage} {len(calls)} times"
    assert set(calls[0]["overrides"]) == {row.variable for row in rows(stage)}


def test_no_role_falls_back_to_a_number_for_a_plan_backed_setting() -> None:
    """The `| default(4096, true)` shape next to a plan value, anywhere under roles/."""
    fallback = re.compile(r"regen_plan_values[^\n]*default\(\s*\d+")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "roles").rglob("*.yml"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if fallback.search(line)
    ]
    assert found == []
