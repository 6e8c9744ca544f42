"""The sweep's plan side: which layouts run, which cannot, and how a report changes the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible.module_utils.regen_config import read_model_dir
from ansible.module_utils.regen_plan import make_plan, plan_values
from ansible.module_utils.regen_simulator import parse_best_configs
from ansible.module_utils.regen_sweep import (
    LayoutError,
    apply_report,
    check_layouts,
    feasibility,
    model_identity,
    report_applies,
    sweep_layouts,
)

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024**2
RTX = {
    "count": 8,
    "names": ["NVIDIA RTX PRO 6000 Blackwell Server Edition"],
    "memory_per_gpu_bytes": 97887 * MIB,
    "compute_capabilities": ["12.0"],
    "interconnect": "pcie",
}
AGG = (
    ROOT
    / "tests/fixtures/aiconfigurator/kimi-k2.5_rtx_pro_6000_server_agg_isl1024_osl4096.best_config_topn.csv"
)


@pytest.fixture(scope="module")
def kimi() -> dict:
    # config.json only: the weight size is the config's estimate, as introspection makes it without the index.
    return read_model_dir(str(ROOT / "tests/fixtures/configs/kimi-k2.5"))


def test_feasibility_by_gpu_count_divisibility_and_weights(kimi) -> None:
    assert kimi["weight_bytes"]  # the fixture's size estimate drives the memory check
    ok, why = feasibility({"tp_size": 8, "ep_size": 8}, kimi, RTX)
    assert ok and "per GPU leave" in why
    ok, why = feasibility({"tp_size": 16}, kimi, RTX)
    assert not ok and why == "needs 16 GPUs (tp 16 x pp 1 x dp 1), the host has 8"
    ok, why = feasibility({"tp_size": 8, "ep_size": 3}, kimi, RTX)
    assert not ok and "ep 3 does not divide tp 8" in why
    ok, why = feasibility({"tp_size": 2}, kimi, RTX)  # the ~550 GiB config estimate over 2 GPUs
    assert not ok and "exceed the" in why and "no room for any KV cache" in why
    ok, why = feasibility({"tp_size": 2}, kimi, {"count": 0})
    assert not ok and why.startswith("no GPU on this host")
    assert feasibility({"environment": {"OMP_NUM_THREADS": "1"}}, kimi, {"count": 0}) == (
        True,
        "one CPU process",
    )


def test_layouts_are_the_plans_then_the_simulators_best_with_estimates(kimi) -> None:
    candidates = parse_best_configs(AGG.read_text())
    simulation = {"covered": True, "candidates": candidates, "tool": "aiconfigurator 0.12.0"}
    plan = plan_values(make_plan(kimi, None, RTX))["serving"]
    layouts = sweep_layouts([], plan, simulation, kimi, RTX, simulator_top=3)
    assert layouts[0]["name"] == "plan"
    assert [lay["source"] for lay in layouts][1:] == [
        "simulator rank 1",
        "simulator rank 2",
        "simulator rank 3",
    ]
    assert layouts[1]["settings"] == {"tp_size": 8, "ep_size": 1, "attn_dp_size": 2}
    assert layouts[1]["estimate"]["output_tokens_per_s"] == pytest.approx(466.468)
    # The plan's own layout gets its estimate too, when the simulator ranked it.
    assert layouts[0]["estimate"]["output_tokens_per_s"] == pytest.approx(369.496)
    assert all(lay["feasible"] for lay in layouts)


def test_inventory_layouts_duplicates_and_infeasible_ones(kimi) -> None:
    plan = {"tp_size": 8, "ep_size": 8}
    requested = [{"name": "same-as-plan", "tp_size": 8, "ep_size": 8}, {"name": "tp16", "tp_size": 16}]
    layouts = sweep_layouts(requested, plan, {"covered": False, "reason": "no GPU"}, kimi, RTX)
    assert [lay["name"] for lay in layouts] == ["plan", "tp16"]
    assert layouts[0]["also"] == ["same-as-plan"]
    assert layouts[1]["feasible"] is False and "needs 16 GPUs" in layouts[1]["reason"]
    assert layouts[1]["estimate"] == {"output_tokens_per_s": None, "reason": "no GPU"}


def test_malformed_layouts_are_refused_naming_the_fix() -> None:
    with pytest.raises(LayoutError, match=r"\[0\]\.name must be a short name"):
        check_layouts([{"name": "a b"}])
    with pytest.raises(LayoutError, match=r"unknown key.*tp"):
        check_layouts([{"name": "x", "tp": 8}])
    with pytest.raises(LayoutError, match="tp_size must be an integer >= 1"):
        check_layouts([{"name": "x", "tp_size": 0}])
    with pytest.raises(LayoutError, match="used twice"):
        check_layouts([{"name": "x"}, {"name": "x"}])
    with pytest.raises(LayoutError, match="reserved 'plan'"):
        check_layouts([{"name": "plan"}])


def _report(arch, gpu_count=8, backend="sglang", layout="tp8-ep1-adp2", settings=None):
    return {
        "inputs_digest": "abc",
        "inputs": {"model_identity": model_identity(arch), "gpu_count": gpu_count, "backend": backend},
        "recommended": {
            "layout": layout,
            "settings": settings or {"tp_size": 8, "ep_size": 1, "attn_dp_size": 2},
            "concurrency": 32,
            "output_tokens_per_s": 512.5,
            "reason": "the most output tokens/s",
        },
    }


def test_a_matching_report_replaces_the_plans_layout_and_says_so(kimi) -> None:
    plan = make_plan(kimi, None, RTX)
    assert plan["serving"]["ep_size"]["value"] == 8
    swept = apply_report(plan, _report(kimi), {}, kimi, RTX, "sglang")
    serving = swept["serving"]
    assert serving["ep_size"] == {"value": 1, "reason": serving["ep_size"]["reason"], "derived": 8}
    assert serving["ep_size"]["reason"].startswith(
        "measured by the layout sweep: tp8-ep1-adp2 at concurrency 32"
    )
    assert serving["attn_dp_size"]["value"] == 2
    assert serving["sweep"]["value"]["concurrency"] == 32
    assert sorted(serving["sweep"]["value"]["applied"]) == ["attn_dp_size", "ep_size"]
    args = serving["sglang_args"]["value"]
    assert "--ep-size" not in args and args[args.index("--attn-dp-size") + 1] == "2"
    assert plan["serving"]["ep_size"]["value"] == 8  # the input plan is left as it was


def test_the_inventory_override_wins_over_the_sweep(kimi) -> None:
    overrides = {"serving": {"ep_size": 8}}
    plan = make_plan(kimi, None, RTX, overrides)
    swept = apply_report(plan, _report(kimi), overrides, kimi, RTX, "sglang")
    assert swept["serving"]["ep_size"]["value"] == 8
    assert "kept the inventory's ep_size" in swept["serving"]["sweep"]["reason"]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"gpu_count": 4}, "the sweep ran on 4 GPU(s), this host has 8"),
        ({"backend": "transformers"}, "measured the transformers server"),
        ({"model_type": "deepseek_v3"}, "the sweep measured another model"),
    ],
)
def test_a_report_for_another_host_or_model_is_not_applied(kimi, change, words) -> None:
    report = _report(kimi, gpu_count=change.get("gpu_count", 8), backend=change.get("backend", "sglang"))
    if "model_type" in change:
        report["inputs"]["model_identity"]["model_type"] = change["model_type"]
    swept = apply_report(make_plan(kimi, None, RTX), report, {}, kimi, RTX, "sglang")
    assert swept["serving"]["sweep"]["value"] is None and words in swept["serving"]["sweep"]["reason"]
    assert swept["serving"]["ep_size"]["value"] == 8


def test_no_report_or_no_recommendation_leaves_the_plan(kimi) -> None:
    assert report_applies({}, kimi, RTX, "sglang")[0] is False
    report = _report(kimi)
    report["recommended"] = {"layout": None, "reason": "no layout was measured"}
    applies, why = report_applies(report, kimi, RTX, "sglang")
    assert not applies and "no layout was measured" in why


def test_a_cpu_recommendation_carries_its_server_settings(kimi) -> None:
    cpu = {"count": 0}
    report = _report(
        kimi,
        gpu_count=0,
        backend="transformers",
        layout="torch-threads-1",
        settings={"environment": {"OMP_NUM_THREADS": "1"}},
    )
    swept = apply_report(make_plan(kimi, None, cpu), report, {}, kimi, cpu, "transformers")
    sweep = swept["serving"]["sweep"]["value"]
    assert sweep["settings"]["environment"] == {"OMP_NUM_THREADS": "1"} and sweep["applied"] == []
