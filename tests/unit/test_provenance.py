"""The run manifest (regen.provenance): one record per distinct result, built from what the stages
recorded, and `regen compare` over two of them. The records are written by the real writers where the
project has them (the plan's value view, python_env's manifest, the training launcher's status, the
evaluation report builder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ansible.module_utils.regen_plan import plan_values
from ansible.module_utils.regen_venv import manifest as venv_manifest

from regen import provenance
from regen.cli import main as regen_main
from regen.evaluate.report import build_report
from regen.training.status import new_status

ROOT = Path(__file__).resolve().parents[2]


def _write(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data, sort_keys=True))


def _result(drafter: str, prompt: str, accepted: list[int]) -> dict:
    tokens = sum(accepted)
    return {"drafter": drafter, "prompt_id": prompt, "category": "chat", "accepted": accepted,
            "tokens": tokens, "seconds": 0.5, "plain_tokens": tokens, "plain_seconds": 1.0, "lossless": True,
            "tree": {}}  # fmt: skip


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    plan = {
        "serving": {
            "tp_size": {"value": 1, "reason": "no GPU"},
            "device": {"value": "cpu", "reason": "no GPU"},
        },
        "drafter": {"block_size": {"value": 16, "reason": "DFlash default"}},
    }
    _write(tmp_path / "model_facts.json", {"model_path": "/m", "architecture": {"model_type": "kimi_k25"},
                                           "plan": plan, "plan_values": plan_values(plan)})  # fmt: skip
    env = {"name": "demo", "path": "/v"}
    probe = {"python": "3.11.7", "packages": {"torch": "2.13.0+cpu", "transformers": "5.24.0"}}
    _write(tmp_path / "provision" / "localhost" / "demo.json", venv_manifest(env, probe, "f" * 64, "uv"))
    _write(
        tmp_path / "serving" / "localhost-main" / "launch.json",
        {"argv": ["python", "-m", "x", "--port", "1"]},
    )
    _write(tmp_path / "serving" / "localhost-main" / "state.json", {"state": "running"})
    _write(tmp_path / "completions" / "status-localhost.json",
           {"state": "done", "done": 24, "failed": 0, "tokens": 900, "elapsed_s": 31.5})  # fmt: skip
    _write(tmp_path / "tokenized" / "stats.json", {"samples": 24, "tokens": 1800, "supervised_fraction": 0.5})
    training = new_status(total_steps=8)
    training.update(state="succeeded", done=8, loss=7.5)
    _write(tmp_path / "drafter" / "localhost" / "status.json", training)
    _write(tmp_path / "drafter" / "localhost" / "run.yaml", "training:\n  max_steps: 8\n")
    rows = [_result(name, f"p{i}", [1, 2] if name == "trained" else [15]) for name in ("trained", "oracle")
            for i in range(3)]  # fmt: skip
    report = build_report(rows, block_size=16, settings={}, inputs={})
    _write(tmp_path / "evaluate" / "report.json", report)
    return tmp_path


def test_a_run_is_recorded_once_and_an_unchanged_rerun_records_nothing(artifacts: Path) -> None:
    first = provenance.record(artifacts, now=1_800_000_000)
    assert first["changed"] is True and first["run_id"].startswith("20270115T")
    manifest = json.loads(Path(first["manifest"]).read_text())
    assert manifest["schema"] == provenance.SCHEMA and manifest["run_id"] == first["run_id"]
    assert manifest["versions"]["localhost/demo"]["packages"]["torch"] == "2.13.0+cpu"
    assert manifest["settings"]["plan"]["drafter"]["block_size"] == 16
    assert manifest["settings"]["serving_launches"]["localhost-main"][-1] == "1"
    assert manifest["results"]["generate"]["localhost"] == {"state": "done", "done": 24, "failed": 0,
                                                            "tokens": 900}  # fmt: skip
    assert manifest["results"]["evaluate"]["acceptance_length"]["oracle"] == 16
    assert manifest["timings"]["generate"] == {"localhost": 31.5}
    assert "tokenized/stats.json" in manifest["inputs"]["records"]
    again = provenance.record(artifacts, now=1_800_000_999)
    assert again == {"changed": False, "run_id": first["run_id"], "manifest": first["manifest"]}
    # A teardown between two runs changes only the server's liveness record: still the same run.
    _write(artifacts / "serving" / "localhost-main" / "state.json", {"state": "stopped"})
    assert provenance.record(artifacts)["changed"] is False
    assert len(provenance.run_dirs(artifacts)) == 1


def test_a_changed_result_is_a_new_run_and_compare_names_what_changed(artifacts: Path, capsys) -> None:
    first = provenance.record(artifacts, now=1_800_000_000)
    more = {"samples": 30, "tokens": 2000, "supervised_fraction": 0.4}
    _write(artifacts / "tokenized" / "stats.json", more)
    second = provenance.record(artifacts, now=1_800_000_100)
    assert second["changed"] is True and second["run_id"] != first["run_id"]
    a, b = provenance.compare_runs(artifacts, [])
    changes = provenance.compare(a, b)
    assert ("tokenize.samples", 24, 30) in changes["results"]
    assert [key for key, _, _ in changes["inputs"]] == ["records.tokenized/stats.json"]
    assert changes["versions"] == [] and changes["settings"] == []
    assert regen_main(["compare", "--artifacts", str(artifacts), first["run_id"][:16]]) == 0
    out = capsys.readouterr().out
    assert "results (what the jobs produced): 3 changed" in out and "tokenize.samples: 24 → 30" in out


def test_check_mode_says_it_would_record_and_writes_nothing(artifacts: Path) -> None:
    result = provenance.record(artifacts, check=True)
    assert result["changed"] is True and not Path(result["manifest"]).exists()
    assert provenance.run_dirs(artifacts) == []


def test_nothing_recorded_yet_is_not_an_error(tmp_path: Path) -> None:
    assert provenance.record(tmp_path)["run_id"] is None


def test_compare_says_what_is_missing(artifacts: Path, capsys) -> None:
    provenance.record(artifacts)
    assert regen_main(["compare", "--artifacts", str(artifacts)]) == 4
    assert "1 run(s) recorded" in capsys.readouterr().err
    assert regen_main(["compare", "--artifacts", str(artifacts), "nope", "nada"]) == 4
    assert "no run 'nope'" in capsys.readouterr().err
    bogus = artifacts / "bogus.json"
    bogus.write_text("{}")
    with pytest.raises(provenance.ProvenanceError, match="is not a regen run manifest"):
        provenance.load(bogus)


def test_the_run_view_shows_the_evaluation_headline(artifacts: Path, tmp_path: Path) -> None:
    from regen.cli.views import evaluation_headlines

    (lines,) = evaluation_headlines([artifacts, tmp_path / "nothing-here"])
    assert lines.startswith("evaluation: acceptance length trained ") and "oracle 16.00" in lines


def test_the_manifest_holds_every_stages_time_and_the_controller_venv(
    artifacts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 6 of issue 26: the manifest records each stage's time in the recording run (from the run
    history the regen_history callback writes) and the controller venv's versions beside the hosts' venvs;
    the stage times are history, so an unchanged re-run with other times still records nothing."""
    import importlib.metadata

    def history(run_id: str, seconds: float) -> None:
        plays = [
            {"name": "Check the variable names the inventory and -e set, and claim the data directories",
             "started": "2027-01-15T08:00:00.000+00:00", "finished": "2027-01-15T08:00:02.500+00:00",
             "counts": {"ok": 2}},
            {"name": "Build the prompt set", "started": "2027-01-15T08:00:02.500+00:00",
             "finished": f"2027-01-15T08:00:{2.5 + seconds:06.3f}+00:00", "counts": {"changed": 3}},
            {"name": "Summarize the run", "started": "2027-01-15T08:00:30.000+00:00", "finished": None,
             "counts": {"ok": 1}},
        ]  # fmt: skip
        pipeline = [str(ROOT / "regen.yml")]
        doc = {"schema": "regen.run/1", "ident": run_id, "plays": plays, "playbooks": pipeline}
        _write(artifacts / "runs" / "history" / f"{run_id}.json", doc)

    history("r1", 20.0)
    monkeypatch.setenv("REGEN_RUN_ID", "r1")
    first = provenance.record(artifacts, now=1_800_000_000)
    manifest = json.loads(Path(first["manifest"]).read_text())
    assert manifest["timings"]["stages"] == {"check_variables": 2.5, "prompts": 20.0}
    controller = manifest["versions"]["controller"]
    assert controller["packages"]["ansible-core"] == importlib.metadata.version("ansible-core")
    history("r2", 30.0)
    monkeypatch.setenv("REGEN_RUN_ID", "r2")
    assert provenance.record(artifacts, now=1_800_000_100)["changed"] is False
