"""The pipeline's wiring: regen.yml, its stage playbooks, tags, and both inventories.

These run the real ansible-playbook / ansible-inventory binaries from the project venv; nothing here
connects to any host (syntax checks and inventory rendering only).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _ansible(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / tool), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": f"{BIN}:/usr/bin:/bin"},
        check=False,
    )


def _stage_imports() -> list[dict]:
    return yaml.safe_load((ROOT / "regen.yml").read_text())


def test_regen_yml_passes_syntax_check() -> None:
    result = _ansible("ansible-playbook", "regen.yml", "--syntax-check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_stage_playbook_is_imported_and_exists() -> None:
    imported = [entry["ansible.builtin.import_playbook"] for entry in _stage_imports()]
    assert imported, "regen.yml imports no stage"
    for path in imported:
        assert (ROOT / path).is_file(), f"regen.yml imports {path}, which does not exist"
    # Every stage playbook belongs to the pipeline; teardown runs on its own, the Mooncake master waits
    # for the training topology (issue 17) to decide when a run needs it, and the layout sweep is a
    # measurement a user asks for (issue 16), off the main line. The operator path from a bare Proxmox node
    # (issue 27: PCIe settings, the container, the weights) runs before the pipeline, on other hosts.
    stage_files = {f"playbooks/{p.name}" for p in (ROOT / "playbooks").glob("*.yml")}
    standalone = {"playbooks/teardown.yml", "playbooks/mooncake.yml", "playbooks/sweep.yml",
                  "playbooks/pcie.yml", "playbooks/container.yml", "playbooks/weights.yml"}  # fmt: skip
    assert stage_files - set(imported) <= standalone


def test_each_stage_has_its_own_tag() -> None:
    result = _ansible("ansible-playbook", "regen.yml", "--list-tags")
    assert result.returncode == 0, result.stderr
    tags_per_play = [
        set(re.findall(r"[\w-]+", m.group(1))) for m in re.finditer(r"TAGS: \[([^\]]*)\]", result.stdout)
    ]
    for entry in _stage_imports():
        stage_plays = yaml.safe_load((ROOT / entry["ansible.builtin.import_playbook"]).read_text())
        for play in stage_plays:
            tags = set(play.get("tags", []))
            assert tags, f"play {play['name']!r} in {entry['ansible.builtin.import_playbook']} has no tag"
            assert any(tags <= listed for listed in tags_per_play), (play["name"], tags)


def test_no_stage_is_a_placeholder() -> None:
    for playbook in (ROOT / "playbooks").glob("*.yml"):
        text = playbook.read_text().lower()
        assert "todo" not in text and "placeholder" not in text, playbook


def test_local_inventory_is_all_localhost() -> None:
    result = _ansible("ansible-inventory", "-i", "inventory/local", "--list")
    assert result.returncode == 0, result.stderr
    inventory = json.loads(result.stdout)
    hosts = set(inventory["_meta"]["hostvars"])
    assert hosts == {"localhost"}
    assert inventory["_meta"]["hostvars"]["localhost"]["ansible_connection"] == "local"
    for group in ("regen_demo", "regen_serve", "regen_generate", "regen_train"):
        assert inventory[group]["hosts"] == ["localhost"], group


def test_production_example_describes_ct200() -> None:
    result = _ansible("ansible-inventory", "-i", "inventory/production.example", "--host", "ct200")
    assert result.returncode == 0, result.stderr
    ct200 = json.loads(result.stdout)
    assert ct200["ansible_host"] == "10.1.2.200"
    assert ct200["ansible_user"] == "root"
    assert ct200["regen_model_path"] == "/root/models/Kimi-K2.6"
    assert ct200["regen_serving_venv"] == "/root/venv_sglang"
    assert ct200["regen_serving_ep_size"] == 8
    assert ct200["regen_profile"] == "gpu"
    groups = _ansible("ansible-inventory", "-i", "inventory/production.example", "--list")
    listed = json.loads(groups.stdout)
    for group in ("regen_serve", "regen_generate", "regen_train"):
        assert listed[group]["hosts"] == ["ct200"], group
    assert "regen_demo" not in listed or not listed["regen_demo"].get("hosts")


def test_production_example_regenerates_a_real_prompt_mix() -> None:
    """CT200 must not regenerate the demo prompts: real sets, each accepted by the prompts job's parser."""
    from regen.jobs.prompts import parse_source

    result = _ansible("ansible-inventory", "-i", "inventory/production.example", "--host", "ct200")
    assert result.returncode == 0, result.stderr
    ct200 = json.loads(result.stdout)
    sources = [parse_source(spec) for spec in ct200["prompt_data_sources"]]
    assert not [s for s in sources if s.kind == "builtin"], "the production example uses the demo prompts"
    assert len(sources) >= 3 and len({s.name for s in sources}) == len(sources)
    # Sizes add up to the 100,000-prompt set the plan is sized for (GSM8K: its whole train split).
    gsm8k_train_rows = 7473
    assert sum(s.sample or gsm8k_train_rows for s in sources) == 100_000
    assert 0 < ct200["prompt_data_eval_fraction"] < 0.1
