"""playbooks/introspect.yml with a layout sweep report: the plan takes the measured layout, says what it
applied, records the simulator's (non-)coverage, and ignores a report measured for another model.

The report is what `regen.jobs.sweep report` writes (regen.bench.report.build_report over layout records);
the model identity comes from the real model_config_info module on the demo model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ansible.module_utils.regen_sweep import model_identity

from regen.bench.report import build_report
from tests.helpers.ansible import localhost_inventory, run_playbook
from tests.helpers.modules import run_module


def _level(concurrency: int, tps: float) -> dict:
    return {
        "concurrency": concurrency,
        "requests": 3,
        "completed": 3,
        "failed": 0,
        "output_tokens_per_s": tps,
        "ttft_ms": {"p50": 50.0, "p90": 60.0, "p99": 61.0},
        "tpot_ms": {"p50": 10.0, "p90": 12.0, "p99": 13.0},
    }


def _write_report(path: Path, identity: dict, gpu_count: int) -> dict:
    layouts = [
        {
            "name": "plan",
            "settings": {},
            "status": "measured",
            "levels": [_level(1, 3.0), _level(2, 2.9)],
            "estimate": {},
        },
        {
            "name": "torch-threads-1",
            "settings": {"environment": {"OMP_NUM_THREADS": "1"}},
            "status": "measured",
            "levels": [_level(1, 40.0), _level(2, 52.0)],
            "estimate": {},
        },
    ]
    report = build_report(
        layouts,
        inputs={"model_identity": identity, "gpu_count": gpu_count, "backend": "transformers"},
        inputs_digest="test",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))
    return report


def test_introspect_plans_with_a_matching_sweep_report(tmp_path: Path, demo_model_dir: Path, capsys) -> None:
    arch = run_module("model_config_info", {"path": str(demo_model_dir)}, capsys)["architecture"]
    gpus = run_module("gpu_info", {}, capsys)["gpu"]["count"]
    artifacts = tmp_path / "artifacts"
    _write_report(artifacts / "sweep" / "report.json", model_identity(arch), gpus)
    variables = {
        "regen_model_path": str(demo_model_dir),
        "regen_serving_python": sys.executable,
        "regen_artifacts_dir": str(artifacts),
        "regen_profile": "cpu",
        "model_facts_env_modules": ["tiktoken"],
    }
    inventory = localhost_inventory(tmp_path / "inventory.yml", groups=("regen_serve",), variables=variables)
    run = run_playbook("playbooks/introspect.yml", inventory=inventory, timeout=600)
    assert run.returncode == 0, run.output[-4000:]
    facts = json.loads((artifacts / "model_facts.json").read_text())
    sweep = facts["plan"]["serving"]["sweep"]
    if gpus:
        pytest.skip("a GPU host: the CPU report is for another kind of host (checked in the unit tests)")
    assert sweep["value"]["layout"] == "torch-threads-1" and sweep["value"]["concurrency"] == 2
    assert sweep["value"]["settings"] == {"environment": {"OMP_NUM_THREADS": "1"}}
    assert sweep["reason"].startswith("measured by the layout sweep: torch-threads-1")
    assert facts["plan_values"]["serving"]["sweep"]["concurrency"] == 2
    estimate = facts["plan"]["serving"]["simulator_estimate"]
    assert estimate["value"] is None
    assert estimate["reason"].startswith("not covered by aiconfigurator 0.12.0: no NVIDIA GPU")
    again = run_playbook("playbooks/introspect.yml", inventory=inventory, timeout=600)
    assert again.counts()["changed"] == 0, again.output[-4000:]

    # A report of another model is not applied, and the plan says why.
    other = dict(model_identity(arch), num_layers=61)
    _write_report(artifacts / "sweep" / "report.json", other, gpus)
    third = run_playbook("playbooks/introspect.yml", inventory=inventory, timeout=600)
    assert third.returncode == 0, third.output[-4000:]
    sweep = json.loads((artifacts / "model_facts.json").read_text())["plan"]["serving"]["sweep"]
    assert sweep["value"] is None and "the sweep measured another model" in sweep["reason"]
