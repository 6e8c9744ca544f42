"""The run estimate (module_utils/regen_estimate.py): time and disk of a run, each with its arithmetic.

Real inputs: the Kimi K2.6 NVFP4 config from the pinned wheel (tests/fixtures/configs/kimi-k2.6-nvfp4), the
plan for 8x RTX PRO 6000 (sm_120) and aiconfigurator 0.12.0's ranking recorded on this project's machine for
Kimi K2.5 on rtx_pro_6000_server (tests/fixtures/aiconfigurator; K2.6 has K2.5's architecture).
"""

from __future__ import annotations

from pathlib import Path

from ansible.module_utils.regen_config import read_model_dir
from ansible.module_utils.regen_gpu import described
from ansible.module_utils.regen_plan import make_plan, plan_values, refresh_estimate
from ansible.module_utils.regen_simulator import parse_best_configs, plan_entry

ROOT = Path(__file__).resolve().parents[2]
K26 = ROOT / "tests" / "fixtures" / "configs" / "kimi-k2.6-nvfp4"
AGG = ROOT / "tests" / "fixtures" / "aiconfigurator" / (
    "kimi-k2.5_rtx_pro_6000_server_agg_isl1024_osl4096.best_config_topn.csv")
CT200 = described(8, 97887 * 1024**2, "12.0")


def _plan(rows=100_000):
    arch = read_model_dir(str(K26))
    return arch, make_plan(arch, None, CT200, prompts={"rows": rows})


def test_without_a_throughput_source_the_time_is_unknown_and_says_how_to_get_it():
    _arch, plan = _plan()
    run = plan["estimate"]["run"]["value"]
    assert run["generation"]["output_tokens"] == 100_000 * 4096 and run["generation"]["seconds"] is None
    assert "serving_simulator" in run["generation"]["arithmetic"]
    # Features if captured offline: 6 target layers x 7,168 x 2 B per token over the length budget.
    assert run["disk"]["features_bytes"] == 100_000 * 6152 * 6 * 7168 * 2
    assert run["training"]["seconds"] is None and "measured" in run["training"]["reason"]


def test_with_the_simulators_estimate_ct200s_100k_prompts_take_days():
    arch, plan = _plan()
    simulation = {"covered": True, "system": "rtx_pro_6000_server", "isl": 1024, "osl": 4096,
                  "candidates": parse_best_configs(AGG.read_text()), "tool": "aiconfigurator 0.12.0"}
    plan["serving"]["simulator_estimate"] = plan_entry(simulation, plan_values(plan)["serving"])
    # The simulator ranks the plan's TP8/EP8 ninth; the EP risk on sm_120 stands beside its ranking.
    assert "rank 9" in plan["serving"]["simulator_estimate"]["reason"]
    assert "issue 21132" in plan["serving"]["simulator_estimate"]["reason"]
    refresh_estimate(plan, arch, {"rows": 100_000})
    generation = plan["estimate"]["run"]["value"]["generation"]
    # 409,600,000 output tokens (every completion at max_tokens) / 369.496 tokens/s = 1,108,537 s = 12.8 days
    assert generation["seconds"] == 100_000 * 4096 / 369.496
    assert "/ 369 tokens/s (aiconfigurator 0.12.0 estimate for the plan's layout) = 12 d 19 h" in (
        generation["arithmetic"])
    capture = plan["estimate"]["run"]["value"]["capture"]
    assert capture["tokens"] == 100_000 * 6152 and capture["seconds"] > 0


def test_the_run_summary_shows_the_estimate_with_its_arithmetic():
    from regen import summary

    arch, plan = _plan()
    facts = {"architecture": arch, "plan": plan, "plan_values": plan_values(plan)}
    rows = [text for key, text in summary.model_lines(facts) if key == "estimate"]
    assert rows and rows[0].startswith("generation: 100,000 prompts x 4,096 max_tokens")
    assert any(text.startswith("features: 100,000 x 6,152 tokens x 86,016 B/token") for text in rows)
