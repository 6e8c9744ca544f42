"""Item 5 of issue 26, as a user meets it: a run started with plain ansible-playbook (what `make regen`
runs) joins the run history: `regen status` lists it under the id the run's summary prints, `regen status
ID` shows it, and `regen compare` accepts that id. A run stopped by a failure is listed as failed with its
task. The runs are `regen.yml --tags summary` on a controller-side artifacts directory holding real recorded
facts (tests/fixtures/serving), so each takes seconds."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from tests.helpers.ansible import BIN, ROOT, ansible_env, run_playbook

FACTS = ROOT / "tests" / "fixtures" / "serving" / "facts-kimi-k2.6.json"


def _regen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "regen"), *args],
        cwd=ROOT,
        env=ansible_env(COLUMNS="400"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _summary_run(artifacts: Path, *more: str) -> str:
    run = run_playbook(
        "regen.yml",
        "--tags",
        "summary",
        *more,
        extra_vars={"regen_artifacts_dir": str(artifacts)},
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    match = re.search(r"run\s+(\S+-local-[0-9a-f]{4}), manifest (\S+)", run.stdout)
    assert match, run.stdout[-3000:]
    return match.group(1)


def test_a_plain_ansible_playbook_run_is_in_the_history_and_compare_takes_its_id(tmp_path: Path) -> None:
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    facts = json.loads(FACTS.read_text())
    facts.pop("_comment", None)
    (artifacts / "model_facts.json").write_text(json.dumps(facts))
    first = _summary_run(artifacts)
    facts["architecture"]["num_hidden_layers"] = 62  # a change the second run's manifest records
    (artifacts / "model_facts.json").write_text(json.dumps(facts))
    second = _summary_run(artifacts)
    assert first != second

    status = _regen("status", "--artifacts", str(artifacts))
    assert status.returncode == 0, status.stderr
    listed = status.stdout
    assert first in listed and second in listed, listed
    assert listed.index(second) < listed.index(first)  # newest first
    one = _regen("status", second, "--artifacts", str(artifacts), "--json")
    assert one.returncode == 0, one.stderr
    doc = json.loads(one.stdout)
    assert doc["ident"] == second and doc["status"] == "successful"
    ran = [s["name"] for s in doc["stages"] if s["status"] != "not run"]
    assert ran[0] == "check_variables" and ran[-1] == "summary", doc["stages"]

    compare = _regen("compare", "--artifacts", str(artifacts), first, second)
    assert compare.returncode == 0, compare.stderr
    assert "records.model_facts.json:" in compare.stdout, compare.stdout  # the facts the second run changed
    header = compare.stdout.splitlines()[0]
    names = sorted(p.name for p in (artifacts / "runs").iterdir() if p.name != "history")
    assert header == f"regen compare {names[0]} → {names[1]}", header


def test_a_failed_run_is_listed_with_its_task(tmp_path: Path) -> None:
    artifacts = tmp_path / "artifacts"
    run = run_playbook(
        "regen.yml",
        "--tags",
        "summary",
        extra_vars={"regen_artifacts_dir": str(artifacts), "drafter_training_epoch": 1},
        timeout=300,
    )
    assert run.returncode != 0
    status = _regen("status", "--artifacts", str(artifacts), "--json")
    runs = json.loads(status.stdout)
    assert len(runs) == 1 and runs[0]["status"] == "failed", runs
    assert runs[0]["failed_task"]["task"] == "Check every variable name against the roles' declarations"
    assert runs[0]["failed_task"]["stage"] == "check_variables"
