"""Item 5 of issue 26 (a work directory per inventory): the first run claims its work and artifacts
directories for its inventory; a stage run alone from another inventory that names the same directories
(a copy of inventory/local with other prompts) stops before it touches them, naming the fix; with
directories of its own, or regen_shared_dirs on purpose, it goes on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers.ansible import ROOT, run_playbook

CHECK = "playbooks/check_variables.yml"


def _copy_of_local(tmp_path: Path) -> Path:
    inventory = tmp_path / "mine"
    shutil.copytree(ROOT / "inventory" / "local", inventory)
    group_vars = inventory / "group_vars" / "all.yml"
    text = group_vars.read_text().replace('"{{ inventory_dir | dirname | dirname }}"', f'"{ROOT}"')
    group_vars.write_text(text)
    return inventory


def test_a_second_inventory_does_not_run_on_the_first_ones_directories(tmp_path: Path) -> None:
    dirs = {"regen_work_dir": str(tmp_path / "work"), "regen_artifacts_dir": str(tmp_path / "artifacts")}
    first = run_playbook(CHECK, extra_vars=dirs, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    owner = json.loads((tmp_path / "artifacts" / ".regen-owner.json").read_text())
    assert owner == {"inventory": str(ROOT / "inventory" / "local")}
    again = run_playbook(CHECK, extra_vars=dirs, timeout=120)
    assert again.recap["localhost"]["changed"] == 0  # claimed once

    mine = _copy_of_local(tmp_path)
    before = sorted(p.name for p in (tmp_path / "work").iterdir())
    stage = run_playbook("regen.yml", "--tags", "prompts", inventory=mine, extra_vars=dirs, timeout=300)
    output = " ".join((stage.stdout + stage.stderr).split())
    assert stage.returncode != 0, output
    assert f"holds the data of inventory {ROOT / 'inventory' / 'local'}" in output, output
    assert "regen_shared_dirs: true" in output and "regen_artifacts_dir" in output
    assert "PLAY [Build the prompt set]" not in output
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == before  # nothing written there

    own = {"regen_work_dir": str(tmp_path / "work-mine"), "regen_artifacts_dir": str(tmp_path / "art-mine")}
    separate = run_playbook(CHECK, inventory=mine, extra_vars=own, timeout=120)
    assert separate.returncode == 0, separate.stdout + separate.stderr
    assert json.loads((tmp_path / "work-mine" / ".regen-owner.json").read_text()) == {"inventory": str(mine)}
    shared = run_playbook(CHECK, inventory=mine, extra_vars={**dirs, "regen_shared_dirs": True}, timeout=120)
    assert shared.returncode == 0, shared.stdout + shared.stderr


def test_a_remote_hosts_work_directory_is_not_claimed_on_the_controller(tmp_path: Path) -> None:
    """The claim runs on the controller (delegate_to: localhost), where `ansible_connection` reads `local`
    for every host; a remote host's work directory is on that host and must not be claimed here (the
    production example's /root/regen once was). Nothing connects to the remote host: every task of the
    check is delegated."""
    inventory = tmp_path / "remote.yml"
    work = tmp_path / "remote-work"
    inventory.write_text(
        "all:\n  hosts:\n    gpu1:\n      ansible_host: 192.0.2.10\n"
        f"      regen_work_dir: {work}\n      regen_artifacts_dir: {tmp_path / 'artifacts'}\n"
    )
    result = run_playbook(CHECK, inventory=inventory, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "artifacts" / ".regen-owner.json").is_file()  # the artifacts are the controller's
    assert not work.exists()  # the remote host's directory is not made or claimed here


def test_a_copy_of_the_local_inventory_gets_directories_of_its_own(tmp_path: Path) -> None:
    """`cp -r inventory/local inventory/mine` as a user does to bring other prompts: without a path set,
    the copy's data goes to .work-mine/ and artifacts-mine/ beside the default's .work/ and artifacts/,
    each claimed for its own inventory, and neither run stops the other."""
    inventories = tmp_path / "inventory"
    for name in ("local", "mine"):
        shutil.copytree(ROOT / "inventory" / "local", inventories / name)  # regen_root: tmp_path
    for name in ("local", "mine"):
        run = run_playbook(CHECK, inventory=inventories / name, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
    suffix = {"local": "", "mine": "-mine"}
    for name, end in suffix.items():
        for directory in (f".work{end}", f"artifacts{end}"):
            owner = json.loads((tmp_path / directory / ".regen-owner.json").read_text())
            assert owner == {"inventory": str(inventories / name)}, directory
