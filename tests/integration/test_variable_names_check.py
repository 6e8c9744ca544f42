"""Item 1 of issue 26, as a user meets it: a misspelled variable in group_vars or -e stops `regen.yml` at
its first play with the closest known names, before any stage runs; a name declared in regen_user_variables
passes; the check runs alone too."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.helpers.ansible import ROOT, run_playbook


def _inventory_copy(tmp_path: Path, extra: str) -> Path:
    inventory = tmp_path / "inventory"
    shutil.copytree(ROOT / "inventory" / "local", inventory)
    group_vars = inventory / "group_vars" / "all.yml"
    # The copy lives outside the checkout: keep its paths pointing at the checkout's.
    text = group_vars.read_text().replace('"{{ inventory_dir | dirname | dirname }}"', f'"{ROOT}"')
    group_vars.write_text(text + extra)
    return inventory


def test_a_misspelled_group_var_stops_the_run_before_any_stage(tmp_path: Path) -> None:
    inventory = _inventory_copy(tmp_path, "prompt_data_souces: [builtin:demo]\n")
    # --tags generate: the check runs with any stage selection (tag always)
    run = run_playbook("regen.yml", "--tags", "generate", inventory=inventory, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert "prompt_data_souces: did you mean prompt_data_sources" in output
    assert "TASK [Check every variable name" in output
    # nothing after the check ran: no stage play started
    assert "PLAY [Generate" not in output and "PLAY [Start" not in output, output


def test_a_misspelled_extra_var_fails_and_a_declared_own_variable_passes(tmp_path: Path) -> None:
    run = run_playbook("playbooks/check_variables.yml", extra_vars={"drafter_training_epoch": 3}, timeout=120)
    assert run.returncode != 0
    assert "drafter_training_epoch: did you mean drafter_training_epochs" in run.stdout
    declared = {
        "my_cost_center": "ml",
        "regen_user_variables": ["my_cost_center"],
        # Directories of this test's own: the first check claims them (a change), whatever ran before.
        "regen_work_dir": str(tmp_path / "work"),
        "regen_artifacts_dir": str(tmp_path / "artifacts"),
    }
    first = run_playbook("playbooks/check_variables.yml", extra_vars=declared, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    ok = run_playbook("playbooks/check_variables.yml", extra_vars=declared, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.recap["localhost"]["changed"] == 0


def test_the_shipped_inventories_pass_the_check() -> None:
    shipped = ("inventory/local", "inventory/production.example", "inventory/production-two-hosts.example")
    for inventory in shipped:
        run = run_playbook("playbooks/check_variables.yml", inventory=inventory, timeout=120)
        assert run.returncode == 0, (inventory, run.stdout + run.stderr)
