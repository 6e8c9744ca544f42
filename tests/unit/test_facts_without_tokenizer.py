"""Facts from the config alone: a model directory without (readable) tokenizer files still gets its
architecture and every plan part the config decides; the tokenizer-dependent parts are unknown with the
reason and the remedy, and the readers that need them stop with that reason instead of taking null for
"none". Also `regen facts --model-path`, the summary's warnings and the offline plan's inventory scope.

The Kimi directory is a config-only copy of the real Kimi K2.5 `config.json` in tests/fixtures/configs
(no real Kimi K2.6 `config.json` is in the stored public sources; K2.6 ships the K2.5 architecture).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
SERVING = ROOT / "tests" / "fixtures" / "serving"

from ansible.module_utils import regen_drafter, regen_serving
from ansible.module_utils.regen_config import read_model_dir
from ansible.module_utils.regen_gpu import described
from ansible.module_utils.regen_plan import dflash_target_layer_ids, make_plan, plan_values, unknown_entries
from ansible.module_utils.regen_tokenizer import gather

from regen import summary
from regen.cli import main
from regen.runner.api import RunResult
from regen.runner.planning import facts_belong, same_inventory

TOKENIZER_PARTS = {
    "generation.thinking_switch",
    "generation.chat_template_kwargs",
    "generation.stop_token_ids",
    "generation.stop",
    "generation.reasoning_parser",
    "drafter.mask_token_id",
    "drafter.mask_token",
}
GIB = 1024**3


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture
def kimi_config_only(tmp_path: Path) -> Path:
    model = tmp_path / "Kimi-config-only"
    model.mkdir()
    shutil.copy(CONFIGS / "kimi-k2.5" / "config.json", model / "config.json")
    return model


def _blackwell(count: int = 8) -> dict:
    return described(count, 96 * GIB, "12.0")


# --- the plan -----------------------------------------------------------------------------------------


def test_without_tokenizer_facts_the_tokenizer_parts_are_unknown_not_none() -> None:
    """make_plan(tokenizer=None) used to say "the chat template has no thinking switch" and plan no
    reasoning parser: a guess presented as a fact."""
    plan = make_plan(read_model_dir(str(CONFIGS / "kimi-k2.5")), None, _blackwell())
    assert set(unknown_entries(plan)) == TOKENIZER_PARTS
    for name in TOKENIZER_PARTS:
        section, key = name.split(".")
        entry = plan[section][key]
        assert entry["value"] is None and entry["unknown"] is True, name
        assert entry["reason"].startswith("unknown: ") and entry["remedy"], name
    assert "has no thinking switch" not in json.dumps(plan)
    # The model family alone decides the tool-call parser; the config decides the layout and the drafter.
    assert plan["generation"]["tool_call_parser"]["value"] == "kimi_k2"
    assert plan["serving"]["tp_size"]["value"] == 8 and plan["serving"]["fits"]["value"] is True
    assert plan["serving"]["attention_backend"]["value"] == "flashinfer"
    depth = plan["drafter"]["num_draft_layers"]["value"]
    assert plan["drafter"]["target_layer_ids"]["value"] == dflash_target_layer_ids(61, depth)


def test_unreadable_tokenizer_facts_carry_their_reason_and_remedy_into_the_plan(
    kimi_config_only: Path,
) -> None:
    tokenizer = gather(str(kimi_config_only), unreadable="unknown")
    plan = make_plan(read_model_dir(str(kimi_config_only)), tokenizer, _blackwell())
    entry = plan["drafter"]["mask_token_id"]
    assert "holds no tokenizer files" in entry["reason"] and str(kimi_config_only) in entry["remedy"]
    assert any(
        w.startswith("tokenizer facts unknown") and "generation.reasoning_parser" in w
        for w in plan["warnings"]
    )
    assert plan_values(plan)["generation"]["chat_template_kwargs"] is None


@pytest.mark.parametrize(
    ("fixture", "reasoning"),
    [("gpt-oss-120b", "gpt-oss"), ("llama-3.1-8b-instruct", None)],
)
def test_what_the_family_alone_decides_stays_planned(fixture: str, reasoning: str | None) -> None:
    """gpt-oss always reasons and Llama has no reasoning parser: neither needs the tokenizer to say so."""
    plan = make_plan(read_model_dir(str(CONFIGS / fixture)), None, None)
    entry = plan["generation"]["reasoning_parser"]
    assert entry["value"] == reasoning and "unknown" not in entry
    assert "generation.reasoning_parser" not in unknown_entries(plan)


def test_an_inventory_override_fills_an_unknown_entry() -> None:
    overrides = {"generation": {"reasoning_parser": "kimi_k2"}, "drafter": {"mask_token_id": 163838}}
    plan = make_plan(read_model_dir(str(CONFIGS / "kimi-k2.5")), None, None, overrides)
    assert plan["generation"]["reasoning_parser"]["value"] == "kimi_k2"
    assert plan["drafter"]["mask_token_id"]["value"] == 163838
    assert "set in inventory" in plan["drafter"]["mask_token_id"]["reason"]
    assert set(unknown_entries(plan)) == TOKENIZER_PARTS - {
        "generation.reasoning_parser",
        "drafter.mask_token_id",
    }


def test_a_planned_mask_id_outside_the_embedding_table_is_a_warning() -> None:
    arch = read_model_dir(str(CONFIGS / "kimi-k2.5"))
    plan = make_plan(arch, None, None, {"drafter": {"mask_token_id": arch["vocab_size"]}})
    assert any(
        "drafter.mask_token_id" in w and "outside the embedding table [0, 163840)" in w
        for w in plan["warnings"]
    )
    assert "warning:" in plan["drafter"]["mask_token_id"]["reason"]
    inside = make_plan(arch, None, None, {"drafter": {"mask_token_id": 163838}})
    assert not any("outside the embedding table" in w for w in inside["warnings"])


def test_with_tokenizer_facts_nothing_is_unknown(demo_model_dir: Path) -> None:
    plan = make_plan(read_model_dir(str(demo_model_dir)), gather(str(demo_model_dir), mode="raw_files"))
    assert unknown_entries(plan) == {}
    assert plan["generation"]["chat_template_kwargs"]["value"] == {"thinking": True}


# --- the readers that need the unknown parts -------------------------------------------------------------


def _kimi_facts_without_tokenizer() -> dict:
    facts = json.loads((SERVING / "facts-kimi-k2.6.json").read_text())
    facts["plan"] = make_plan(facts["architecture"], None, _blackwell())
    return facts


def test_serving_refuses_an_unknown_reasoning_parser_and_names_the_fix() -> None:
    spec = {
        "backend": "sglang",
        "model_path": "/models/Kimi-K2.6",
        "python": "/venv/bin/python",
        "facts": _kimi_facts_without_tokenizer(),
        "gpu_count": 8,
    }
    with pytest.raises(regen_serving.ServingPlanError) as err:
        regen_serving.plan_server(spec)
    assert "reasoning_parser is unknown" in str(err.value) and "sglang_server_reasoning_parser" in str(
        err.value
    )
    spec["overrides"] = {"reasoning_parser": "kimi_k2"}
    argv = regen_serving.plan_server(spec)["argv"]
    assert argv[argv.index("--reasoning-parser") + 1] == "kimi_k2"


def test_the_drafter_plan_says_the_mask_token_is_unknown_and_why(kimi_config_only: Path) -> None:
    arch = read_model_dir(str(kimi_config_only))
    tokenizer = gather(str(kimi_config_only), unreadable="unknown")
    facts = {"architecture": arch, "tokenizer": tokenizer, "plan": make_plan(arch, tokenizer, _blackwell())}
    with pytest.raises(regen_drafter.DrafterPlanError) as err:
        regen_drafter.draft_config(facts)
    assert "mask_token_id is unknown" in str(err.value) and "drafter_training_mask_token_id" in str(err.value)


# --- the summary ---------------------------------------------------------------------------------------


def test_the_summary_shows_unknown_parts_and_the_vocabulary_and_mask_warnings(
    tmp_path: Path, kimi_config_only: Path
) -> None:
    arch = read_model_dir(str(kimi_config_only))
    tokenizer = gather(str(kimi_config_only), unreadable="unknown")
    tokenizer["vocab"]["disagreement"] = (
        "the tokenizer has 163842 token ids but config.json's vocab_size is 163840"
    )
    plan = make_plan(arch, tokenizer, _blackwell(), {"drafter": {"mask_token_id": 200000}})
    facts = {"architecture": arch, "tokenizer": tokenizer, "plan": plan, "plan_values": plan_values(plan)}
    (tmp_path / "model_facts.json").write_text(json.dumps(facts))
    rows = summary.collect(tmp_path)
    text = dict(rows)
    assert text["tokenizer"].startswith("unknown (") and "thinking switch unknown" in text["tokenizer"]
    assert "mask id 200000" in text["plan"]
    warnings = [line for stage, line in rows if stage == "warning"]
    assert any(w.startswith("vocabulary: the tokenizer has 163842") for w in warnings)
    assert any("outside the embedding table" in w for w in warnings)
    assert any(w.startswith("tokenizer facts unknown") for w in warnings)


# --- regen facts --model-path ----------------------------------------------------------------------------


def test_regen_facts_model_path_on_a_config_only_kimi(
    kimi_config_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "facts",
        "--model-path",
        str(kimi_config_only),
        "--gpus",
        "8",
        "--gpu-memory-gib",
        "96",
        "--compute-capability",
        "12.0",
        "--project",
        str(ROOT),
    ]
    assert main([*argv, "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    plan = facts["plan"]
    assert facts["architecture"]["model_type"] == "kimi_k25" and facts["tokenizer"]["available"] is False
    assert facts["environment"]["gpu"]["count"] == 8
    assert facts["environment"]["gpu"]["memory_per_gpu_bytes"] == 96 * GIB
    assert plan["serving"]["attention_backend"]["value"] == "flashinfer"
    assert set(facts["plan_unknown"]) == TOKENIZER_PARTS

    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines at spaces
    assert "attention backend: flashinfer" in out
    assert "unknown without the tokenizer: " + ", ".join(sorted(TOKENIZER_PARTS)) in out
    assert "fix: put the model's tokenizer files" in out and str(kimi_config_only) in out
    # The context length is the plan's (its length budget) when it has one; the line is always there.
    context = plan["serving"].get("context_length")
    if context is not None:
        assert f"context length: {json.dumps(context['value'])} (plan.serving.context_length" in out
    else:
        assert "context length: not planned" in out and "262144" in out


def test_regen_facts_model_path_without_gpus_plans_for_the_cpu(
    kimi_config_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["facts", "--model-path", str(kimi_config_only), "--json", "--project", str(ROOT)]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert (
        plan["serving"]["device"]["value"] == "cpu" and plan["serving"]["attention_backend"]["value"] is None
    )


def test_regen_facts_model_path_and_model_plan_info_build_the_same_plan(
    kimi_config_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One plan builder (regen_plan.build_plan): the CLI's plan is the module's for the same inputs."""
    from tests.helpers.modules import run_module

    gpu = ["--gpus", "8", "--gpu-memory-gib", "96", "--compute-capability", "12.0"]
    assert main(["facts", "--model-path", str(kimi_config_only), *gpu, "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    args = {key: facts[key] for key in ("architecture", "tokenizer")} | {"gpu": facts["environment"]["gpu"]}
    module = run_module("model_plan_info", args, capsys)
    assert module["plan"] == facts["plan"] and module["plan_unknown"] == facts["plan_unknown"]
    assert module["plan_values"] == facts["plan_values"]
    # and the CLI loads that code as the package's own module_utils, without touching Ansible's path
    source = (ROOT / "src" / "regen" / "cli" / "local_facts.py").read_text()
    assert "__path__" not in source and "from regen.module_utils import" in source


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--gpus", "8"], "needs --gpu-memory-gib"),
        (["--gpus", "-1", "--gpu-memory-gib", "96"], "--gpus -1"),
        (["--gpus", "8", "--gpu-memory-gib", "0"], "--gpu-memory-gib 0"),
        (["--gpus", "8", "--gpu-memory-gib", "96", "--compute-capability", "sm120"], "MAJOR.MINOR"),
        (["--compute-capability", "12.0"], "give --gpus N too"),
        (["-i", "inventory/local"], "-i would be ignored"),
    ],
)
def test_bad_gpu_descriptions_exit_4_with_the_flag_named(
    kimi_config_only: Path, capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    assert main(["facts", "--model-path", str(kimi_config_only), *extra, "--project", str(ROOT)]) == 4
    assert needle in " ".join(capsys.readouterr().err.split())


def test_a_directory_without_config_exits_4(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["facts", "--model-path", str(tmp_path), "--project", str(ROOT)]) == 4
    assert "config.json not found" in " ".join(capsys.readouterr().err.split())


def test_gpu_flags_without_model_path_exit_4(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["facts", "--gpus", "8", "--project", str(ROOT)]) == 4
    assert "only apply with --model-path" in " ".join(capsys.readouterr().err.split())


# --- regen plan --offline: only this inventory's runs ----------------------------------------------------


def test_runs_count_for_an_inventory_only_when_they_ran_on_it_alone(tmp_path: Path) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    assert same_inventory([str(mine)], mine)
    assert same_inventory([str(tmp_path / "." / "mine")], mine)
    assert not same_inventory([str(other)], mine)
    assert not same_inventory([str(mine), str(other)], mine)
    assert not same_inventory([], mine)


def test_a_facts_file_counts_only_when_it_describes_this_inventory() -> None:
    hostvars = {"ct200": {"regen_model_path": "/root/models/Kimi-K2.6"}}
    assert facts_belong({"host": "ct200", "model_path": "/root/models/Kimi-K2.6"}, hostvars, [])
    assert not facts_belong({"host": "localhost", "model_path": "/x/demo"}, hostvars, [])
    assert not facts_belong({"host": "ct200", "model_path": "/root/models/other"}, hostvars, [])
    # Without a host, only a recorded run of this inventory that produced exactly these facts vouches.
    facts = {"architecture": {"num_layers": 4}}
    run = RunResult(ident="r1", status="successful", rc=0, facts=dict(facts))
    assert facts_belong(facts, hostvars, [run]) and not facts_belong(facts, hostvars, [])
