"""The plan: parallelism, generation kwargs, drafter layout, reasons and inventory overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "configs"

from ansible.module_utils.regen_config import read_model_dir
from ansible.module_utils.regen_gpu import _gpu_record, summarize
from ansible.module_utils.regen_plan import (
    dflash_target_layer_ids,
    make_plan,
    nested,
    plan_entry,
    plan_value,
    plan_values,
)
from ansible.module_utils.regen_tokenizer import gather as tokenizer_facts

from tests.helpers.modules import run_module

RTX_PRO_6000_MIB = 97887  # memory.total of an RTX PRO 6000 Blackwell (96 GB class)


def _gpus(
    count: int, name: str = "NVIDIA RTX PRO 6000 Blackwell Server Edition", mib: int = RTX_PRO_6000_MIB
):
    return summarize(
        [_gpu_record({"index": str(i), "name": name, "memory.total": str(mib)}) for i in range(count)]
    )


def _values(section: dict) -> dict:
    return {key: entry["value"] for key, entry in section.items()}


def test_every_value_has_a_one_line_reason() -> None:
    plan = make_plan(read_model_dir(str(FIXTURES / "kimi-k2.5")), None, _gpus(8))
    for section in ("serving", "generation", "drafter"):
        for key, entry in plan[section].items():
            assert set(entry) >= {"value", "reason"}, (section, key)
            assert entry["reason"] and "\n" not in entry["reason"], (section, key)


def test_kimi_on_eight_blackwell_gpus_is_tp8_ep8() -> None:
    plan = make_plan(read_model_dir(str(FIXTURES / "kimi-k2.5")), None, _gpus(8))
    serving = _values(plan["serving"])
    assert (serving["device"], serving["tp_size"], serving["ep_size"], serving["dp_size"]) == (
        "cuda",
        8,
        8,
        1,
    )
    assert serving["fits"] is True
    assert serving["sglang_args"][:4] == ["--tp-size", "8", "--ep-size", "8"]
    assert "384 routed experts" in plan["serving"]["ep_size"]["reason"]
    assert "48 whole experts per GPU" in plan["serving"]["ep_size"]["reason"]


def test_kimi_on_four_gpus_does_not_fit_and_says_what_would() -> None:
    plan = make_plan(read_model_dir(str(FIXTURES / "kimi-k2.5")), None, _gpus(4))
    fits = plan["serving"]["fits"]
    assert fits["value"] is False
    assert (
        "does not fit" in fits["reason"] and "TP8" in fits["reason"] and "this host has 4" in fits["reason"]
    )


def test_small_dense_model_replicates() -> None:
    plan = make_plan(read_model_dir(str(FIXTURES / "qwen3-8b")), None, _gpus(8))
    serving = _values(plan["serving"])
    assert (serving["tp_size"], serving["ep_size"], serving["dp_size"]) == (1, 1, 8)
    assert plan["serving"]["ep_size"]["reason"].startswith("dense model")


def test_tp_divides_the_attention_heads() -> None:
    arch = read_model_dir(str(FIXTURES / "qwen3.5-27b"))  # 24 heads: TP8 would split heads unevenly
    arch["weight_bytes"] = 400 * 2**30
    plan = make_plan(arch, None, _gpus(8))
    assert 24 % plan["serving"]["tp_size"]["value"] == 0


def test_no_gpu_serves_on_cpu() -> None:
    plan = make_plan(
        read_model_dir(str(FIXTURES / "kimi-k2.5")), None, summarize([], reason="nvidia-smi not found")
    )
    serving = _values(plan["serving"])
    assert (serving["device"], serving["tp_size"], serving["ep_size"]) == ("cpu", 1, 1)
    assert "--device" in serving["sglang_args"]


@pytest.mark.parametrize(("layers", "n"), [(61, 5), (36, 5), (48, 3), (4, 1), (32, 8), (10, 2)])
def test_target_layer_ids_formula(layers: int, n: int) -> None:
    ids = dflash_target_layer_ids(layers, n)
    if n == 1:
        assert ids == [layers // 2]
    else:
        assert ids == [round(1 + i * (layers - 4) / (n - 1)) for i in range(n)]
        assert ids[0] == 1 and ids[-1] == layers - 3
    assert len(ids) == n and ids == sorted(ids) and all(0 <= i < layers for i in ids)


def test_target_layer_ids_known_values() -> None:
    # Worked by hand from round(1 + i*(L-4)/(n-1)) (Python rounds 29.5 to 30, as SpecForge does).
    assert dflash_target_layer_ids(61, 5) == [1, 15, 30, 44, 58]
    assert dflash_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]


def test_drafter_plan_for_kimi_follows_the_published_drafter() -> None:
    # SpecForge's own DFlash config for the 61-layer Kimi target, kept as a fixture (SOURCES.md).
    published = json.loads(
        (FIXTURES.parent / "drafter" / "specforge" / "kimi-k2.7-code-dflash.json").read_text()
    )
    arch = read_model_dir(str(FIXTURES / "kimi-k2.5"))
    plan = make_plan(arch, None, _gpus(8))["drafter"]
    drafter = _values(plan)
    assert drafter["num_draft_layers"] == published["num_hidden_layers"]
    assert drafter["block_size"] == published["block_size"]
    assert drafter["target_layer_ids"] == published["dflash_config"]["target_layer_ids"]
    assert (drafter["hidden_size"], drafter["vocab_size"]) == (published["hidden_size"], 163840)
    for key in ("num_draft_layers", "block_size"):
        assert "published drafter" in plan[key]["reason"] and "kimi-k2.7-code-dflash" in plan[key]["reason"]


def test_drafter_plan_without_a_published_recipe_uses_specforge_defaults() -> None:
    arch = read_model_dir(str(FIXTURES / "qwen3-8b"))
    plan = make_plan(arch, None, _gpus(8))["drafter"]
    assert (plan["num_draft_layers"]["value"], plan["block_size"]["value"]) == (5, 16)
    assert "no published drafter" in plan["block_size"]["reason"]
    assert plan["target_layer_ids"]["value"] == dflash_target_layer_ids(36, 5)


def test_published_mask_id_is_named_when_the_tokenizer_picks_another() -> None:
    arch = read_model_dir(str(FIXTURES / "kimi-k2.5"))
    tokenizer = {"mask_token": {"id": 163837, "token": "<|reserved|>", "reason": "reserved special token"}}
    plan = make_plan(arch, tokenizer, _gpus(8))["drafter"]
    assert plan["mask_token_id"]["value"] == 163837
    assert "published drafter uses id 163838" in plan["mask_token_id"]["reason"]
    same = make_plan(arch, {"mask_token": dict(tokenizer["mask_token"], id=163838)}, _gpus(8))["drafter"]
    assert "published" not in same["mask_token_id"]["reason"]


def test_overrides_replace_values_and_feed_dependent_ones() -> None:
    arch = read_model_dir(str(FIXTURES / "kimi-k2.5"))
    overrides = {"serving": {"tp_size": 4}, "drafter": {"num_draft_layers": 3, "block_size": 8}}
    plan = make_plan(arch, None, _gpus(8), overrides)
    assert plan["serving"]["tp_size"] == {
        "value": 4,
        "derived": 8,
        "reason": "set in inventory (model_facts_plan_overrides.serving.tp_size)",
    }
    assert plan["serving"]["ep_size"]["value"] == 4  # follows the overridden TP
    assert plan["drafter"]["target_layer_ids"]["value"] == dflash_target_layer_ids(61, 3)
    assert plan["drafter"]["block_size"]["value"] == 8
    assert plan["warnings"] == []


def test_unknown_override_is_reported() -> None:
    plan = make_plan(
        read_model_dir(str(FIXTURES / "qwen3-8b")), None, None, {"serving": {"tpsize": 2}, "drafterr": {}}
    )
    assert any("serving.tpsize is not a plan value" in w for w in plan["warnings"])
    assert any("drafterr is not a plan section" in w for w in plan["warnings"])


@pytest.mark.parametrize(
    ("fixture", "reasoning", "tool"),
    [
        ("gpt-oss-120b", "gpt-oss", "gpt-oss"),
        ("llama-3.1-8b-instruct", None, "llama3"),
        ("qwen3-8b", None, "qwen25"),  # no tokenizer facts: no think tokens known, so no reasoning parser
        ("qwen3-next-80b-a3b-instruct", None, "qwen25"),
        ("kimi-k2-instruct", None, "kimi_k2"),
        ("deepseek-v3.2", None, "deepseekv32"),
        ("glm-4.5-air", None, "glm45"),
        ("glm-4.7-flash", None, "glm47"),
        ("mixtral-8x7b-v0.1", None, "mistral"),
    ],
)
def test_sglang_parsers_by_family(fixture: str, reasoning: str | None, tool: str) -> None:
    plan = make_plan(read_model_dir(str(FIXTURES / fixture)))
    assert plan["generation"]["reasoning_parser"]["value"] == reasoning
    assert plan["generation"]["tool_call_parser"]["value"] == tool


def test_qwen3_with_enable_thinking_template() -> None:
    arch = read_model_dir(str(FIXTURES / "qwen3-8b"))
    tokenizer = {
        "chat_template": {"thinking_switch": "enable_thinking", "source": "tokenizer_config.json"},
        "end_of_turn": [{"id": 151645, "content": "<|im_end|>"}],
        "think_tokens": [{"id": 151667, "content": "<think>"}],
    }
    generation = _values(make_plan(arch, tokenizer)["generation"])
    assert generation["chat_template_kwargs"] == {"enable_thinking": True}
    assert generation["reasoning_parser"] == "qwen3"
    assert generation["stop_token_ids"] == [151645]


def _demo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return request.getfixturevalue("demo_model_dir")
    except pytest.FixtureLookupError:
        from regen.demo.build import build

        out = tmp_path_factory.mktemp("demo") / "regen-demo-kimi"
        build(out)
        return out


def test_demo_model_on_cpu(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    demo = _demo(request, tmp_path_factory)
    arch = read_model_dir(str(demo))
    tok = tokenizer_facts(str(demo), mode="raw_files")
    plan = make_plan(arch, tok, summarize([], reason="no GPU"))
    serving, generation, drafter = (_values(plan[s]) for s in ("serving", "generation", "drafter"))
    assert (serving["tp_size"], serving["ep_size"]) == (1, 1)
    assert generation["chat_template_kwargs"] == {"thinking": True}
    assert (generation["reasoning_parser"], generation["tool_call_parser"]) == ("kimi_k2", "kimi_k2")
    im_end = next(t["id"] for t in tok["end_of_turn"] if t["content"] == "<|im_end|>")
    assert (
        im_end in generation["stop_token_ids"] and tok["named"]["eos"]["id"] in generation["stop_token_ids"]
    )
    layers = arch["num_layers"]
    assert drafter["num_draft_layers"] == max(1, min(5, layers - 3))
    assert drafter["target_layer_ids"] == dflash_target_layer_ids(layers, drafter["num_draft_layers"])
    assert drafter["mask_token_id"] == tok["mask_token"]["id"] is not None


def test_plan_entries_read_back_one_way() -> None:
    plan = make_plan(read_model_dir(str(FIXTURES / "kimi-k2.5")), None, _gpus(8), {"serving": {"tp_size": 4}})
    values = plan_values(plan)
    assert set(values) == {"serving", "generation", "drafter", "length", "nccl", "estimate", "warnings"}
    for section in ("serving", "generation", "drafter", "length"):
        assert values[section] == {key: entry["value"] for key, entry in plan[section].items()}
    assert values["serving"]["tp_size"] == 4 and values["warnings"] == plan["warnings"]
    # a bare value (an inventory override) is its own value; a planned null is present, an absent key not
    assert plan_value(7) == 7 and plan_value({"value": None, "reason": "r"}) is None
    assert plan_entry({"p": {"value": None, "reason": "none known"}}, "p") == (True, None, "none known")
    assert plan_entry({"p": 3, "reasons": {"p": "legacy"}}, "p") == (True, 3, "legacy")
    assert plan_entry({}, "p") == (False, None, None) and plan_values(None) == {}
    assert nested(plan, "serving", "tp_size", "value") == 4
    assert nested(plan, "serving", "nope", "value") is None


def test_target_layers_refuse_what_specforge_cannot_spread() -> None:
    with pytest.raises(ValueError, match="drafter_training_num_draft_layers"):
        dflash_target_layer_ids(61, 0)
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        dflash_target_layer_ids(True, 1)


def test_plan_module_returns_the_planner_s_plan(capsys: pytest.CaptureFixture[str]) -> None:
    arch = read_model_dir(str(FIXTURES / "kimi-k2.5"))
    args = {"architecture": arch, "gpu": _gpus(8), "overrides": {}, "_ansible_check_mode": True}
    result = run_module("model_plan_info", args, capsys)
    assert result["changed"] is False
    assert result["plan"] == make_plan(arch, None, _gpus(8), {})
    assert result["plan_values"]["serving"]["ep_size"] == result["plan"]["serving"]["ep_size"]["value"] == 8


def test_plan_module_fails_on_unknown_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_module("model_plan_info", {"overrides": {"serving": {"tp": 2}, "sevring": {}}}, capsys)
    assert result["failed"] is True
    assert "model_facts_plan_overrides.serving.tp is not a plan value" in result["msg"]
    assert "model_facts_plan_overrides.sevring is not a plan section" in result["msg"]


def test_plan_module_without_architecture_only_checks_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_module("model_plan_info", {"overrides": {"serving": {"tp_size": 2}}}, capsys)
    assert result["plan"] is None and result["plan_values"] is None and not result.get("failed")




# --- attention backend: named by the plan from the backend table (module_utils/regen_attention_backends.py)


RTX_PRO = "NVIDIA RTX PRO 6000 Blackwell Server Edition"


def _gpus_cc(count: int, name: str, mib: int) -> dict:
    # Compute capability from the product name, as gpu_info does when nvidia-smi's table gives no column.
    return _gpus(count, name=name, mib=mib)


@pytest.mark.parametrize(
    ("model", "gpu_name", "mib", "backend", "row"),
    [
        ("kimi-k2.5", RTX_PRO, RTX_PRO_6000_MIB, "flashinfer", "sm120-mla"),
        ("kimi-k2.5", "NVIDIA B200", 183359, "trtllm_mla", "sm100-mla"),
        ("qwen3-8b", RTX_PRO, RTX_PRO_6000_MIB, "flashinfer", "sm120-mha"),
    ],
)
def test_the_plan_names_the_attention_backend_for_the_gpu_and_the_attention_kind(
    model, gpu_name, mib, backend, row
) -> None:
    plan = make_plan(read_model_dir(str(FIXTURES / model)), None, _gpus_cc(8, gpu_name, mib))
    entry = plan["serving"]["attention_backend"]
    assert entry["value"] == backend
    assert f"row {row}" in entry["reason"] and "sources:" in entry["reason"]
    args = plan["serving"]["sglang_args"]["value"]
    assert args[args.index("--attention-backend") + 1] == backend


def test_hopper_from_a_recorded_nvidia_smi_query_gets_fa3() -> None:
    # The real H100 NVL query (name and PCI id only, no memory column): the backend needs only the
    # compute capability, which gpu_info derives from the product name.
    from ansible.module_utils.regen_gpu import parse_query_csv

    smi = ROOT / "tests" / "fixtures" / "nvidia-smi" / "h100nvl-query-noheader.csv"
    gpus = summarize(parse_query_csv(smi.read_text(), fields=("name", "pci.device_id")))
    assert gpus["compute_capabilities"] == ["9.0"]
    plan = make_plan(read_model_dir(str(FIXTURES / "deepseek-v3")), None, gpus)
    entry = plan["serving"]["attention_backend"]
    assert entry["value"] == "fa3" and "row sm90-mla" in entry["reason"]


def test_sm120_mla_reason_says_why_not_trtllm_mla() -> None:
    plan = make_plan(read_model_dir(str(FIXTURES / "kimi-k2.5")), None, _gpus(8))
    reason = plan["serving"]["attention_backend"]["reason"]
    assert "Unsupported architecture" in reason
    assert "https://github.com/flashinfer-ai/flashinfer/issues/3263" in reason


def test_no_attention_backend_on_cpu_and_the_reason_says_so() -> None:
    plan = make_plan(read_model_dir(str(FIXTURES / "kimi-k2.5")), None, summarize([], reason="no GPU"))
    entry = plan["serving"]["attention_backend"]
    assert entry["value"] is None and "no GPU" in entry["reason"]
    assert "--attention-backend" not in plan["serving"]["sglang_args"]["value"]


def test_mixed_gpu_generations_name_no_backend() -> None:
    from ansible.module_utils.regen_gpu import parse_query_csv

    # A real host with a TITAN V (7.0) beside an RTX 5880 Ada (8.9).
    smi = ROOT / "tests" / "fixtures" / "nvidia-smi" / "titanv-rtx5880-query.csv"
    gpus = summarize(parse_query_csv(smi.read_text()))
    assert gpus["compute_capabilities"] == ["7.0", "8.9"]
    entry = make_plan(read_model_dir(str(FIXTURES / "qwen3-8b")), None, gpus)["serving"]["attention_backend"]
    assert entry["value"] is None and "several compute capabilities" in entry["reason"]


def test_attention_backend_override_wins_and_warns_against_an_avoided_backend() -> None:
    arch = read_model_dir(str(FIXTURES / "kimi-k2.5"))
    plan = make_plan(arch, None, _gpus(8), {"serving": {"attention_backend": "trtllm_mla"}})
    entry = plan["serving"]["attention_backend"]
    assert entry["value"] == "trtllm_mla" and entry["derived"] == "flashinfer"
    assert "model_facts_plan_overrides.serving.attention_backend" in entry["reason"]
    assert any("advises against" in w and "Unsupported architecture" in w for w in plan["warnings"])
    quiet = make_plan(arch, None, _gpus(8), {"serving": {"attention_backend": "triton"}})
    assert quiet["serving"]["attention_backend"]["value"] == "triton" and not quiet["warnings"]


# --- DP attention for MLA: the KV-capacity arithmetic both ways


def _deepseek_on(name: str, mib: int, count: int = 8) -> dict:
    return make_plan(read_model_dir(str(FIXTURES / "deepseek-v3")), None, _gpus(count, name=name, mib=mib))


def test_dp_attention_is_planned_where_it_multiplies_the_mla_kv_capacity() -> None:
    serving = _deepseek_on("NVIDIA B200", 183359)["serving"]  # B200's memory.total (nvidia-smi table)
    capacity = serving["kv_capacity"]["value"]
    plain, dp = capacity["without_attn_dp"], capacity["with_attn_dp"]
    # Without DP attention the server holds one GPU's pool (the MLA latent is on every rank) ...
    assert plain["tokens"] == plain["kv_pool_bytes_per_gpu"] // capacity["kv_bytes_per_token"]
    # ... with it each rank holds its own requests, less the replicated attention weights.
    assert dp["tokens"] == dp["tokens_per_rank"] * 8 and dp["attn_dp_size"] == 8
    assert plain["kv_pool_bytes_per_gpu"] - dp["kv_pool_bytes_per_gpu"] == pytest.approx(
        capacity["attention_weight_bytes"] * 7 / 8, rel=1e-6
    )
    assert dp["tokens"] >= 2 * plain["tokens"]
    assert serving["attn_dp_size"]["value"] == 8
    reason = serving["kv_capacity"]["reason"]
    assert "without attention DP" in reason and "with --attn-dp-size 8" in reason
    assert f"{plain['tokens']:,} tokens for the server" in reason and f"{dp['tokens']:,} in all" in reason
    args = serving["sglang_args"]["value"]
    assert args[args.index("--attn-dp-size") + 1] == "8" and "--dp-size" not in args


def test_dp_attention_stays_off_where_replicated_attention_eats_the_pool() -> None:
    # Kimi K2.5 INT4 on 8x RTX PRO 6000: ~11.5 GiB of bf16 attention weights on every rank would leave
    # ~1.7k tokens per rank (at the 0.83 share the memory margin allows), under the 65,536 in flight the
    # plan sizes for.
    serving = make_plan(read_model_dir(str(FIXTURES / "kimi-k2.5")), None, _gpus(8))["serving"]
    assert serving["attn_dp_size"]["value"] == 1
    assert "each rank's pool would hold" in serving["attn_dp_size"]["reason"]
    capacity = serving["kv_capacity"]["value"]
    assert capacity["with_attn_dp"]["tokens_per_rank"] < 65536 < capacity["without_attn_dp"]["tokens"]
    assert "--attn-dp-size" not in serving["sglang_args"]["value"]


def test_dp_attention_is_off_on_cpu_and_for_dense_gqa_models() -> None:
    cpu = make_plan(read_model_dir(str(FIXTURES / "deepseek-v3")), None, summarize([], reason="no GPU"))
    attn_dp = cpu["serving"]["attn_dp_size"]
    assert attn_dp["value"] == 1 and "no GPU" in attn_dp["reason"]
    assert cpu["serving"]["kv_capacity"]["value"] is None
    dense = make_plan(read_model_dir(str(FIXTURES / "llama-3.1-8b-instruct")), None, _gpus(8))["serving"]
    assert dense["attn_dp_size"]["value"] == 1 and "not an MLA model" in dense["attn_dp_size"]["reason"]


def test_dp_attention_override_reaches_the_plan() -> None:
    arch = read_model_dir(str(FIXTURES / "kimi-k2.5"))
    plan = make_plan(arch, None, _gpus(8), {"serving": {"attn_dp_size": 8}})
    assert plan["serving"]["attn_dp_size"]["value"] == 8
    assert "model_facts_plan_overrides.serving.attn_dp_size" in plan["serving"]["attn_dp_size"]["reason"]
    assert "--attn-dp-size" in plan["serving"]["sglang_args"]["value"]
