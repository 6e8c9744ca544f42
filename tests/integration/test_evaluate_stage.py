"""The evaluate stage through real runs: the job CLI on the demo model (report keys, no re-evaluation of
unchanged inputs, resume from results.jsonl, a changed checkpoint evaluated afresh) and playbooks/evaluate.yml
on localhost (report in the artifacts, a second run changed=0). The drafters are untrained SpecForge
DFlashDraftModels written as `export --to hf` lays them out; the venv is SpecForge 0.2.0 over the project's
torch/transformers, as the pipeline's training venv on the embedded default."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from regen.status import validate
from tests.helpers.ansible import localhost_inventory, run_playbook
from tests.helpers.evaluate_venv import DRAFTER_SNIPPET, ROOT, VENV, evaluate_python, run_python

SMALL = ["--max-prompts", "2", "--max-new-tokens", "8"]
# What the introspect stage publishes and the stage reads through its settings resolver: the length budget
# (prompt tokens kept = budget - max_new_tokens) and the chat-template kwargs.
PLAN_FACTS = {
    "plan": {
        "length": {"budget": {"value": 264, "reason": "256 prompt tokens + 8 generated"}},
        "generation": {"chat_template_kwargs": {"value": {}, "reason": "none"}},
    }
}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    base = tmp_path_factory.mktemp("evaluate-stage")
    code = DRAFTER_SNIPPET + "import sys\nmake_drafter(sys.argv[1], sys.argv[2], seed=1)\n"
    code += "make_drafter(sys.argv[1], sys.argv[3], seed=2)\n"
    run = run_python(code, str(demo_model_dir), str(base / "drafter-a"), str(base / "drafter-b"))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [
        {
            "id": f"p{i}",
            "category": ("code", "chat")[i % 2],
            "conversations": [{"role": "user", "content": text}],
        }
        for i, text in enumerate(["Write a sort function.", "Hello, how are you?", "Print 1 to 10.", "Hi!"])
    ]
    (base / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return base


def _job(work: Path, model: Path, checkpoint: str, out: Path, *extra: str) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run(
        [str(evaluate_python()), "-m", "regen.jobs.evaluate", "--target-model", str(model),
         "--checkpoint", str(work / checkpoint), "--prompts", str(work / "prompts.jsonl"),
         "--output-dir", str(out), *SMALL, *extra],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def test_job_reports_resumes_and_skips_unchanged_inputs(work: Path, demo_model_dir: Path) -> None:
    out = work / "job"
    first, _ = _job(work, demo_model_dir, "drafter-a", out)
    assert first["changed"] is True and first["lossless"] is True
    report = json.loads((out / "report.json").read_text())
    assert set(report["drafters"]) == {"trained", "untrained", "oracle"}
    assert report["drafters"]["oracle"]["acceptance_length"] == report["block_size"]
    assert report["drafters"]["untrained"]["acceptance_length"] < 1.2
    assert {"acceptance_length", "acceptance_length_ci95", "acceptance_by_position"} <= set(
        report["drafters"]["trained"]
    )
    assert (out / "report.md").read_text().startswith("# Drafter evaluation")
    assert (out / "acceptance_by_position.png").stat().st_size > 0
    status_doc = json.loads((out / "status.json").read_text())
    assert validate(status_doc) == [], status_doc
    assert (status_doc["job"], status_doc["state"], status_doc["done"], status_doc["total"]) == (
        "evaluate", "succeeded", 6, 6)  # fmt: skip

    again, log = _job(work, demo_model_dir, "drafter-a", out)
    assert again["changed"] is False and "evaluated" not in log

    # A crash after the last result but before the report: the rerun decodes nothing again.
    (out / "report.json").unlink()
    resumed, log = _job(work, demo_model_dir, "drafter-a", out)
    assert resumed["changed"] is True and "evaluated" not in log
    assert json.loads((out / "report.json").read_text())["drafters"] == report["drafters"]

    other, log = _job(work, demo_model_dir, "drafter-b", out)
    assert other["changed"] is True and log.count("evaluated drafter=") == 6


def test_job_evaluates_each_kind_of_turn_with_the_templates_switch(work: Path, demo_model_dir: Path) -> None:
    out = work / "kinds"
    kinds = ["--chat-template-kwargs", '{"thinking": true}', "--thinking-switch", "thinking"]
    kinds += ["--turn-kinds", "non-thinking,thinking"]
    result, log = _job(work, demo_model_dir, "drafter-a", out, *kinds)
    assert result["changed"] is True and result["lossless"] is True
    report = json.loads((out / "report.json").read_text())
    assert report["turn_kinds"] == ["non-thinking", "thinking"]
    for name in ("trained", "untrained", "oracle"):
        assert set(report["drafters"][name]["turn_kinds"]) == {"non-thinking", "thinking"}
    assert report["settings"]["turn_kinds"]["non-thinking"] == {"thinking": False}
    assert log.count("turn_kind=thinking") == log.count("turn_kind=non-thinking") == 6
    status_doc = json.loads((out / "status.json").read_text())
    assert (status_doc["done"], status_doc["total"]) == (12, 12)
    # A drafter of the user's (no export marker of the train stage) has no training-step series.
    assert report["training_steps"]["measured"] is False


def test_playbook_publishes_the_report_and_a_second_run_changes_nothing(
    work: Path, demo_model_dir: Path, tmp_path: Path
) -> None:
    evaluate_python()
    inventory = localhost_inventory(
        tmp_path / "inventory.yml",
        groups=("regen_train",),
        variables={
            "regen_root": str(ROOT),
            "regen_work_dir": str(tmp_path / "work"),
            "regen_artifacts_dir": str(tmp_path / "artifacts"),
            "regen_model_path": str(demo_model_dir),
            "regen_training_venv": str(VENV),
            "regen_profile": "cpu",
            "drafter_evaluation_max_prompts": 2,
            "drafter_evaluation_max_new_tokens": 8,
            "regen_model_facts": PLAN_FACTS,
        },
    )
    extra = {"evaluate_checkpoint": str(work / "drafter-a"), "evaluate_prompts": str(work / "prompts.jsonl")}
    first = run_playbook("playbooks/evaluate.yml", inventory=inventory, extra_vars=extra, timeout=900)
    assert first.returncode == 0, first.output[-6000:]
    report = json.loads((tmp_path / "artifacts" / "evaluate" / "report.json").read_text())
    assert (
        report["lossless"] is True
        and report["drafters"]["oracle"]["acceptance_length"] == report["block_size"]
    )
    assert "acceptance length trained" in first.output
    second = run_playbook("playbooks/evaluate.yml", inventory=inventory, extra_vars=extra, timeout=900)
    assert second.returncode == 0, second.output[-6000:]
    assert second.counts()["changed"] == 0, second.output[-6000:]


def test_playbook_without_an_export_says_what_to_do(tmp_path: Path, demo_model_dir: Path) -> None:
    inventory = localhost_inventory(
        tmp_path / "inventory.yml",
        groups=("regen_train",),
        variables={
            "regen_root": str(ROOT),
            "regen_work_dir": str(tmp_path / "work"),
            "regen_artifacts_dir": str(tmp_path / "artifacts"),
            "regen_model_path": str(demo_model_dir),
        },
    )
    run = run_playbook("playbooks/evaluate.yml", inventory=inventory, timeout=300)
    assert run.returncode != 0
    assert "run the train stage first" in run.output and "evaluate_checkpoint" in run.output


def test_playbook_evaluates_the_prompts_stage_held_out_split(
    work: Path, demo_model_dir: Path, tmp_path: Path
) -> None:
    from regen.jobs import prompts as P

    prompts_dir = tmp_path / "work" / "prompts"
    assert (
        P.main(
            [
                "--source",
                str(work / "prompts.jsonl"),
                "--output-dir",
                str(prompts_dir),
                "--eval-fraction",
                "0.5",
            ]
        )
        == 0
    )
    held = sorted(
        json.loads(line)["id"]
        for f in (prompts_dir / "eval").glob("*.jsonl")
        for line in f.read_text().splitlines()
    )
    assert held, "the seeded split held nothing out of 4 prompts; pick another fraction"
    inventory = localhost_inventory(
        tmp_path / "inventory.yml",
        groups=("regen_train",),
        variables={
            "regen_root": str(ROOT),
            "regen_work_dir": str(tmp_path / "work"),
            "regen_artifacts_dir": str(tmp_path / "artifacts"),
            "regen_model_path": str(demo_model_dir),
            "regen_training_venv": str(VENV),
            "drafter_evaluation_max_prompts": 2,
            "drafter_evaluation_max_new_tokens": 4,
            "drafter_evaluation_drafters": ["oracle"],
            "regen_model_facts": PLAN_FACTS,
        },
    )
    run = run_playbook(
        "playbooks/evaluate.yml",
        inventory=inventory,
        extra_vars={"evaluate_checkpoint": str(work / "drafter-a")},
        timeout=900,
    )
    assert run.returncode == 0, run.output[-6000:]
    assert "the held-out split" in run.output
    report = json.loads((tmp_path / "artifacts" / "evaluate" / "report.json").read_text())
    assert report["settings"]["prompts_source"].endswith("/eval")
    assert set(report["inputs"]["prompt_ids"]) <= set(held)


def test_gpu_profile_takes_the_serving_path_and_serves_nothing_without_a_drafter(tmp_path: Path) -> None:
    """The gpu profile evaluates through SGLang (tests/integration/test_evaluate_gpu_path.py runs that path on
    the CT200 example); without an exported drafter it stops before it stops or serves anything, and never
    loads the target on the CPU."""
    inventory = localhost_inventory(
        tmp_path / "inventory.yml",
        groups=("regen_train",),
        variables={
            "regen_root": str(ROOT),
            "regen_work_dir": str(tmp_path / "work"),
            "regen_artifacts_dir": str(tmp_path / "artifacts"),
            "regen_model_path": str(tmp_path / "kimi-k2.6"),
            "regen_profile": "gpu",
        },
    )
    run = run_playbook("playbooks/evaluate.yml", inventory=inventory, timeout=300)
    assert run.returncode != 0
    assert "Evaluate through SGLang, the target alone and with the drafter" in run.output
    assert "run the train stage first" in run.output and "evaluate_checkpoint" in run.output
    assert "sglang_server" not in run.output and "regen.jobs.evaluate " not in run.output
    assert run.counts()["changed"] == 0 and not (tmp_path / "artifacts" / "evaluate").exists()
