"""Item 4 of issue 26, as a user meets it: a group_vars file that is not valid YAML is named with its line,
by ansible-playbook itself (plugins/vars/regen_vars_files.py) and by `regen plan --offline`, which exits 4
(bad input) instead of 0."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.helpers.ansible import BIN, ROOT, ansible_env, run_playbook


def _broken_inventory(tmp_path: Path) -> tuple[Path, Path, int]:
    inventory = tmp_path / "inventory"
    shutil.copytree(ROOT / "inventory" / "local", inventory)
    group_vars = inventory / "group_vars" / "all.yml"
    lines = group_vars.read_text().splitlines()
    lines.append("prompt_data_sources: builtin: demo")  # an unquoted colon in a value
    group_vars.write_text("\n".join(lines) + "\n")
    return inventory, group_vars, len(lines)


def test_ansible_playbook_names_the_file_and_line(tmp_path: Path) -> None:
    inventory, group_vars, line = _broken_inventory(tmp_path)
    run = run_playbook("playbooks/check_variables.yml", inventory=inventory, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert f"{group_vars}:{line}:" in output, output


def test_regen_plan_offline_fails_naming_the_file(tmp_path: Path) -> None:
    inventory, group_vars, line = _broken_inventory(tmp_path)
    proc = subprocess.run(
        [str(BIN / "regen"), "plan", "--offline", "-i", str(inventory)],
        cwd=ROOT, env=ansible_env(COLUMNS="400"), capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert f"{group_vars}:{line}:" in proc.stdout + proc.stderr


def test_a_valid_inventory_still_plans(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(BIN / "regen"), "plan", "--offline", "-i", str(ROOT / "inventory" / "local")],
        cwd=ROOT, env=ansible_env(COLUMNS="400"), capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
