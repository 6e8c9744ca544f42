"""The sweep's modules through their main(): layout_simulation_info, sweep_layouts_info, model_plan_info.

layout_simulation_info runs the real aiconfigurator 0.12.0 when its venv is at .cache/aiconfigurator-0.12.0
(the serving_simulator role builds it on a GPU controller run; by hand: `python3 -m venv
.cache/aiconfigurator-0.12.0 && .cache/aiconfigurator-0.12.0/bin/pip install --require-hashes -r
envs/aiconfigurator.lock`); the failure path runs an executable that fails the way aiconfigurator does
(a fault-injection stub, named so), printing its real recorded refusal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ansible.module_utils.regen_config import read_model_dir

from tests.helpers.modules import run_module

ROOT = Path(__file__).resolve().parents[2]
KIMI_DIR = ROOT / "tests" / "fixtures" / "configs" / "kimi-k2.5"
AICONFIGURATOR = ROOT / ".cache" / "aiconfigurator-0.12.0"
RTX = {
    "count": 8,
    "names": ["NVIDIA RTX PRO 6000 Blackwell Server Edition"],
    "memory_per_gpu_bytes": 97887 * 2**20,
}


@pytest.fixture(scope="module")
def kimi() -> dict:
    return read_model_dir(str(KIMI_DIR))


def test_no_gpu_is_not_covered_and_runs_nothing(kimi, capsys) -> None:
    out = run_module(
        "layout_simulation_info", {"architecture": kimi, "gpu": {"count": 0}, "run": True}, capsys
    )
    assert out["changed"] is False and out["simulation"]["covered"] is False
    assert "NVIDIA GPU systems only" in out["simulation"]["reason"]


def test_a_failing_simulator_is_reported_not_raised(kimi, capsys, tmp_path: Path) -> None:
    refusal = (ROOT / "tests/fixtures/aiconfigurator/cpu_system_unsupported.stdout.txt").read_text()
    stub = tmp_path / "bin" / "aiconfigurator"  # fault-injection stub: exits 1 with aiconfigurator's words
    stub.parent.mkdir()
    (tmp_path / "refusal.txt").write_text(refusal)
    stub.write_text(f"#!/bin/sh\ncat {tmp_path / 'refusal.txt'}\nexit 1\n")
    stub.chmod(0o755)
    config = json.loads((KIMI_DIR / "config.json").read_text())
    out = run_module(
        "layout_simulation_info",
        {"architecture": kimi, "gpu": RTX, "config": config, "run": True, "bin_dir": str(stub.parent)},
        capsys,
    )
    sim = out["simulation"]
    assert sim["covered"] is False
    assert sim["reason"].startswith(
        "aiconfigurator 0.12.0 gave no answer (exit 1): Backend sglang is not supported"
    )


def test_a_missing_venv_fails_naming_the_role_that_builds_it(kimi, capsys, tmp_path: Path) -> None:
    out = run_module(
        "layout_simulation_info",
        {"architecture": kimi, "gpu": RTX, "config": {"a": 1}, "run": True, "bin_dir": str(tmp_path)},
        capsys,
    )
    assert out["failed"] and "role serving_simulator" in out["msg"]


@pytest.mark.e2e  # the real simulator: 12 s on an idle core, 35-50 s on two busy ones
@pytest.mark.skipif(
    not (AICONFIGURATOR / "bin" / "aiconfigurator").exists(),
    reason="the aiconfigurator venv is not built (.cache/aiconfigurator-0.12.0; see the docstring)",
)
def test_the_real_simulator_ranks_kimi_k25_on_rtx_pro_6000(kimi, capsys) -> None:
    config = json.loads((KIMI_DIR / "config.json").read_text())
    out = run_module(
        "layout_simulation_info",
        {
            "architecture": kimi,
            "gpu": RTX,
            "config": config,
            "run": True,
            "bin_dir": str(AICONFIGURATOR / "bin"),
            "isl": 1024,
            "osl": 4096,
        },
        capsys,
    )
    sim = out["simulation"]
    assert sim["covered"] and sim["system"] == "rtx_pro_6000_server"
    recorded = (
        ROOT / "tests/fixtures/aiconfigurator/"
        "kimi-k2.5_rtx_pro_6000_server_agg_isl1024_osl4096.best_config_topn.csv"
    ).read_text()
    from ansible.module_utils.regen_simulator import parse_best_configs

    assert [c["parallel"] for c in sim["candidates"]] == [r["parallel"] for r in parse_best_configs(recorded)]


def test_sweep_layouts_info_lists_and_checks(kimi, capsys) -> None:
    facts = {
        "architecture": kimi,
        "environment": {"gpu": RTX},
        "plan": {
            "serving": {
                "tp_size": {"value": 8, "reason": "r"},
                "ep_size": {"value": 8, "reason": "r"},
                "simulator_estimate": {"value": None, "reason": "not covered by aiconfigurator 0.12.0: x"},
            }
        },
    }
    out = run_module(
        "sweep_layouts_info", {"facts": facts, "layouts": [{"name": "tp16", "tp_size": 16}]}, capsys
    )
    assert [lay["name"] for lay in out["layouts"]] == ["plan", "tp16"]
    assert out["layouts"][0]["settings"] == {"tp_size": 8, "ep_size": 8}
    assert out["layouts"][1]["feasible"] is False and out["gpu_count"] == 8
    assert out["model_identity"]["model_type"] == "kimi_k25"
    bad = run_module("sweep_layouts_info", {"facts": facts, "layouts": [{"name": "x", "tpsize": 2}]}, capsys)
    assert bad["failed"] and "unknown key(s) tpsize" in bad["msg"]


def test_model_plan_info_records_the_estimate_and_applies_a_report(kimi, capsys) -> None:
    from ansible.module_utils.regen_sweep import model_identity

    report = {
        "inputs_digest": "d",
        "inputs": {"model_identity": model_identity(kimi), "gpu_count": 8, "backend": "sglang"},
        "recommended": {
            "layout": "tp8-ep1-adp2",
            "settings": {"tp_size": 8, "attn_dp_size": 2},
            "concurrency": 16,
            "output_tokens_per_s": 400.0,
            "reason": "best",
        },
    }
    out = run_module(
        "model_plan_info",
        {
            "architecture": kimi,
            "gpu": RTX,
            "sweep_report": report,
            "backend": "sglang",
            "simulation": {"covered": False, "reason": "off for the test"},
        },
        capsys,
    )
    serving = out["plan"]["serving"]
    assert serving["ep_size"]["value"] == 1 and serving["ep_size"]["derived"] == 8
    assert out["plan_values"]["serving"]["sweep"]["concurrency"] == 16
    assert serving["simulator_estimate"]["reason"].startswith(
        "not covered by aiconfigurator 0.12.0: off for the test"
    )
