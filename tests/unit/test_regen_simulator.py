"""aiconfigurator's side of the plan: coverage, its command line, and its real recorded answers parsed.

The fixtures are real aiconfigurator 0.12.0 runs (tests/fixtures/aiconfigurator/README.md): the Kimi K2.5
config of tests/fixtures/configs on rtx_pro_6000_server, and its refusals of the demo model and of a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ansible.module_utils.regen_config import normalize_config
from ansible.module_utils.regen_simulator import (
    command,
    coverage,
    failure_reason,
    match_estimate,
    parse_best_configs,
    plan_entry,
    sglang_layout,
    system_for_gpu,
)

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "aiconfigurator"
RTX = {"count": 8, "names": ["NVIDIA RTX PRO 6000 Blackwell Server Edition"]}
AGG = FIXTURES / "kimi-k2.5_rtx_pro_6000_server_agg_isl1024_osl4096.best_config_topn.csv"


def _kimi_arch() -> dict:
    return normalize_config(json.loads((ROOT / "tests/fixtures/configs/kimi-k2.5/config.json").read_text()))


def test_the_recorded_kimi_k25_ranking_parses_into_sglang_layouts() -> None:
    rows = parse_best_configs(AGG.read_text())
    assert len(rows) == 10 and [r["rank"] for r in rows] == list(range(1, 11))
    best = rows[0]
    assert best["parallel"] == "tp4pp1dp2etp8ep1"
    # attention TP 4 x attention DP 2 = SGLang's TP group of 8, DP attention 2, experts tensor-parallel.
    assert best["settings"] == {"tp_size": 8, "ep_size": 1, "attn_dp_size": 2}
    assert best["name"] == "tp8-ep1-adp2"
    assert best["output_tokens_per_s"] == pytest.approx(466.468)
    assert best["concurrency"] == 14 and best["ttft_ms"] == pytest.approx(785.796)
    assert best["perf_db_version"] == "0.5.14" and best["system"] == "rtx_pro_6000_server"
    # regen's plan for K2.5 on 8 GPUs (TP8 EP8) is in the ranking too, lower down.
    ep8 = match_estimate(rows, {"tp_size": 8, "ep_size": 8})
    assert ep8["rank"] == 9 and ep8["output_tokens_per_s"] == pytest.approx(369.496)


def test_the_issues_own_command_answer_parses_too() -> None:
    rows = parse_best_configs(
        (FIXTURES / "kimi-k2.5_rtx_pro_6000_server_issue_command.best_config_topn.csv").read_text()
    )
    assert [r["parallel"] for r in rows] == [
        "tp8pp1dp1etp8ep1",
        "tp8pp1dp1etp4ep2",
        "tp8pp1dp1etp2ep4",
        "tp8pp1dp1etp1ep8",
    ]
    assert rows[0]["isl"] == 4000 and rows[0]["osl"] == 1000


def test_parallel_notation_mapping_and_bad_input() -> None:
    assert sglang_layout("tp8pp1dp1etp1ep8") == {"tp_size": 8, "ep_size": 8, "attn_dp_size": 1}
    assert sglang_layout("tp2pp2dp2etp4ep1") == {"tp_size": 4, "ep_size": 1, "attn_dp_size": 2, "pp_size": 2}
    with pytest.raises(ValueError, match="parallel layout"):
        sglang_layout("tp8")
    with pytest.raises(ValueError, match="best_config_topn"):
        parse_best_configs("a,b\n1,2\n")


def test_coverage_by_gpu_system_and_architecture() -> None:
    assert system_for_gpu(RTX)[0] == "rtx_pro_6000_server"
    assert system_for_gpu({"count": 8, "names": ["NVIDIA H100 80GB HBM3"]})[0] == "h100_sxm"
    assert system_for_gpu({"count": 2, "names": ["NVIDIA H100 PCIe"]})[0] == "h100_pcie"
    assert system_for_gpu({"count": 8, "names": ["NVIDIA B200"]})[0] == "b200_sxm"
    none, why = system_for_gpu({"count": 0})
    assert none is None and "NVIDIA GPU systems only" in why
    none, why = system_for_gpu({"count": 1, "names": ["Tesla T4"]})
    assert none is None and "Tesla T4 has no aiconfigurator 0.12.0 system" in why
    assert system_for_gpu({"count": 2, "names": ["NVIDIA H100", "NVIDIA L4"]})[0] is None
    assert coverage(_kimi_arch(), RTX)[0] == "rtx_pro_6000_server"
    demo = {"architectures": ["KimiK25DemoForConditionalGeneration"]}
    none, why = coverage(demo, RTX)
    assert none is None and "does not model architecture KimiK25DemoForConditionalGeneration" in why


def test_the_refusals_aiconfigurator_really_printed_become_the_reason() -> None:
    demo = failure_reason((FIXTURES / "demo-model_unsupported_architecture.stderr.txt").read_text())
    assert demo.startswith(
        "ValueError: The model's architecture KimiK25DemoForConditionalGeneration is not supported"
    )
    cpu = failure_reason((FIXTURES / "cpu_system_unsupported.stdout.txt").read_text())
    assert cpu.startswith("Backend sglang is not supported for system cpu")


def test_command_line_is_the_aggregated_search_of_the_length_budget() -> None:
    argv = command("/venv/bin", "/tmp/m", "rtx_pro_6000_server", 8, 1024, 4096, "/tmp/out")
    assert argv[:3] == ["/venv/bin/aiconfigurator", "cli", "default"]
    assert argv[argv.index("--serving-mode") + 1] == "agg" and argv[argv.index("--osl") + 1] == "4096"
    with pytest.raises(ValueError, match="total_gpus"):
        command("/venv/bin", "/tmp/m", "h200_sxm", 0, 1024, 4096, "/tmp/out")


def test_plan_entry_records_the_estimate_beside_the_plans_choice() -> None:
    rows = parse_best_configs(AGG.read_text())
    simulation = {
        "covered": True,
        "system": "rtx_pro_6000_server",
        "isl": 1024,
        "osl": 4096,
        "candidates": rows,
        "tool": "aiconfigurator 0.12.0",
    }
    entry = plan_entry(simulation, {"tp_size": 8, "ep_size": 8, "attn_dp_size": 1})
    assert entry["value"]["plan_layout_estimate"]["rank"] == 9
    assert entry["value"]["top"]["name"] == "tp8-ep1-adp2"
    assert "369.496 output tokens/s for the plan's tp8-ep8 (rank 9)" in entry["reason"]
    fallback = plan_entry({"covered": False, "reason": "no NVIDIA GPU"}, {"tp_size": 1})
    assert fallback["value"] is None
    assert (
        fallback["reason"]
        == "not covered by aiconfigurator 0.12.0: no NVIDIA GPU; the plan's own rules decide"
    )
    assert plan_entry(None, {})["value"] is None
