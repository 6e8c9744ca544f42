"""The runner's parts that need no playbook run: stages from regen.yml, the checkout, secrets, artifacts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from regen.runner import BadInput, discover_stages
from regen.runner.api import _environment
from regen.runner.artifacts import collect_artifacts, command_info, data_roots, host_is_local, inventory_query
from regen.runner.project import find_project
from regen.runner.secrets import MASK, VAULT_ID, Redactor, encrypt_vars, mask_environment, scrub_command_file
from regen.runner.stages import play_stage_map, select_stages
from regen.status import Status

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "tests" / "fixtures" / "playbooks" / "runner"


# --- stages ---------------------------------------------------------------------------------------


def test_the_repository_stages_are_read_from_regen_yml() -> None:
    stages = discover_stages(ROOT)
    pipeline = [s for s in stages if not s.standalone]
    imported = [
        e["ansible.builtin.import_playbook"] for e in yaml.safe_load((ROOT / "regen.yml").read_text())
    ]
    assert [s.playbook.relative_to(ROOT).as_posix() for s in pipeline] == imported
    for stage in pipeline:
        plays = yaml.safe_load(stage.playbook.read_text())
        assert stage.tags == tuple(dict.fromkeys(t for p in plays for t in p.get("tags", [])))
        assert {p.name for p in stage.plays} == {p["name"] for p in plays}
    # the demo stage is selected by its tag as well as its name
    demo = next(s for s in pipeline if s.name == "demo_model")
    assert demo.tag == "demo"
    assert select_stages(stages, ["demo"]) == select_stages(stages, ["demo_model"]) == [demo]


def test_unknown_and_mixed_stage_selections_are_bad_input() -> None:
    stages = discover_stages(PROJECT)
    with pytest.raises(BadInput, match=r"unknown stage 'trian'.*generate"):
        select_stages(stages, ["trian"])
    with pytest.raises(BadInput, match="teardown runs on its own"):
        select_stages(stages, ["generate", "teardown"])
    assert [s.name for s in select_stages(stages, ["generate", "demo"])] == ["demo_model", "generate"]
    assert play_stage_map(stages)["Introspect the fixture model"] == "introspect"


def test_a_broken_regen_yml_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "playbooks").mkdir()
    (tmp_path / "regen.yml").write_text(
        "- name: x\n  ansible.builtin.import_playbook: playbooks/missing.yml\n"
    )
    with pytest.raises(BadInput, match=r"imports playbooks/missing\.yml, which does not exist"):
        discover_stages(tmp_path)
    (tmp_path / "regen.yml").write_text("- name: [unclosed\n")
    with pytest.raises(BadInput, match=r"regen\.yml is not valid YAML"):
        discover_stages(tmp_path)


# --- the checkout and its ansible.cfg ---------------------------------------------------------------


def test_the_checkout_is_found_and_wired_to_its_ansible_cfg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT / "src")
    monkeypatch.delenv("REGEN_ROOT", raising=False)
    project = find_project()
    assert project.root == ROOT and project.ansible_cfg == ROOT / "ansible.cfg"
    assert project.resolve_inventory(None) == ROOT / "inventory" / "local"
    assert (
        project.resolve_inventory("inventory/production.example") == ROOT / "inventory" / "production.example"
    )
    with pytest.raises(BadInput, match="inventory 'inventory/nope' does not exist"):
        project.resolve_inventory("inventory/nope")
    # a project without its own ansible.cfg runs with the repository's
    fixture = find_project(PROJECT)
    assert fixture.root == PROJECT and fixture.ansible_cfg == ROOT / "ansible.cfg"
    with pytest.raises(BadInput, match="is not a regen checkout"):
        find_project(ROOT / "src")


def test_runner_defaults_are_overridden_deliberately(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ANSIBLE_STDOUT_CALLBACK", "ANSIBLE_HOST_KEY_CHECKING", "ANSIBLE_CACHE_PLUGIN_CONNECTION"):
        monkeypatch.delenv(name, raising=False)
    project = find_project(ROOT)
    env = _environment(project, {"EXTRA": "1"}, None)
    assert env["ANSIBLE_CONFIG"] == str(ROOT / "ansible.cfg")
    assert env["ORIGINAL_STDOUT_CALLBACK"] == project.cfg_value("stdout_callback")
    assert env["ANSIBLE_HOST_KEY_CHECKING"] == "True"  # runner would turn it off
    assert env["ANSIBLE_CACHE_PLUGIN_CONNECTION"] == str(ROOT / ".cache" / "facts")  # the checkout's cache
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["EXTRA"] == "1"
    monkeypatch.setenv("ANSIBLE_STDOUT_CALLBACK", "ansible.builtin.minimal")
    assert "ORIGINAL_STDOUT_CALLBACK" not in _environment(project, None, None)  # the user's choice wins


# --- secrets --------------------------------------------------------------------------------------


def test_secrets_are_encrypted_for_ansible_vault(tmp_path: Path) -> None:
    dest = tmp_path / "s" / "run.vault.yml"
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
    password = encrypt_vars({"api_key": "sk-live-1234567890"}, dest, env=env)
    text = dest.read_text()
    assert text.startswith(f"$ANSIBLE_VAULT;1.2;AES256;{VAULT_ID}") and "sk-live" not in text
    assert dest.stat().st_mode & 0o777 == 0o600
    # ansible-vault itself decrypts it with the one-time password
    pw_file = tmp_path / "pw"
    pw_file.write_text(password)
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-vault"),
            "view",
            "--vault-id",
            f"{VAULT_ID}@{pw_file}",
            str(dest),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert yaml.safe_load(out.stdout) == {"api_key": "sk-live-1234567890"}
    with pytest.raises(BadInput, match="not a valid Ansible variable name"):
        encrypt_vars({"bad-name": "x"}, dest, env=env)


def test_the_redactor_masks_secrets_wherever_they_appear() -> None:
    redactor = Redactor(["sk-abc123", "sk-abc123-longer", "ab"])
    event = {"stdout": "key sk-abc123-longer and sk-abc123", "res": {"msg": ["x sk-abc123"], "n": 3}}
    redactor.scrub(event)
    assert event == {"stdout": f"key {MASK} and {MASK}", "res": {"msg": [f"x {MASK}"], "n": 3}}
    assert redactor.text("ab stays: too short to be a secret") == "ab stays: too short to be a secret"
    assert not Redactor([])


def test_the_recorded_environment_is_masked(tmp_path: Path) -> None:
    env = {
        "HF_TOKEN": "hf_x",
        "OPENAI_API_KEY": "sk-1",
        "PATH": "/bin",
        "NOTE": "uses sk-run-secret",
        "EMPTY_TOKEN": "",
    }
    masked = mask_environment(env, ["sk-run-secret"])
    assert masked == {
        "HF_TOKEN": MASK,
        "OPENAI_API_KEY": MASK,
        "PATH": "/bin",
        "NOTE": f"uses {MASK}",
        "EMPTY_TOKEN": "",
    }
    command = tmp_path / "command"
    command.write_text(json.dumps({"command": ["ansible-playbook"], "cwd": "/", "env": env}))
    scrub_command_file(command, ["sk-run-secret"])
    assert json.loads(command.read_text())["env"] == masked
    assert command.stat().st_mode & 0o777 == 0o600


# --- artifacts ------------------------------------------------------------------------------------


def test_artifacts_are_what_the_stages_recorded(tmp_path: Path) -> None:
    art, work = tmp_path / "artifacts", tmp_path / "work"
    (work / "generate").mkdir(parents=True)
    status = Status(job="generate", state="done", item="record", line="generate: done", done=2, total=2)
    files = {
        "artifacts/model_facts.json": {"architecture": {}},
        "artifacts/provision/ct200/serving.json": {"packages": {}},
        "artifacts/completions/status-ct200.json": status.document(output_dir=str(work / "generate")),
        "artifacts/completions/status-ct201.json": status.document(output_dir=str(tmp_path / "elsewhere")),
        "artifacts/tokenized/stats.json": {"samples": 2},
        "artifacts/drafter/ct200/status.json": {"state": "succeeded"},
        "artifacts/drafter/ct200/checkpoints.json": {"checkpoints": []},
        # Files named like artifacts, but recorded by no stage, are not listed.
        "artifacts/model_facts-old.json": {},
        "artifacts/notes/status.json": {},
        "work/generate/completions-00000.jsonl": {},
        "work/tokenized/train-00000.parquet": {},
        "work/train/checkpoint-200/config.json": {},
    }
    for name, doc in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(doc))
    found = collect_artifacts([art, tmp_path / "absent"])

    def rel(paths: list[Path]) -> list[str]:
        return [p.relative_to(tmp_path).as_posix() for p in paths]

    assert rel(found.facts) == ["artifacts/model_facts.json"]
    assert rel(found.environment_manifests) == ["artifacts/provision/ct200/serving.json"]
    # the generation job's output directory, from its recorded status (ct201's is not on this machine)
    assert rel(found.completions) == ["work/generate"]
    assert rel(found.tokenized) == ["artifacts/tokenized/stats.json"]
    assert rel(found.checkpoints) == ["artifacts/drafter/ct200/checkpoints.json"]
    assert rel(found.status_files) == [
        "artifacts/completions/status-ct200.json",
        "artifacts/completions/status-ct201.json",
        "artifacts/drafter/ct200/status.json",
    ]
    assert rel(found.roots) == ["artifacts"]


def test_inventory_paths_come_from_ansible_itself() -> None:
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
    local = inventory_query(
        [ROOT / "inventory" / "local"],
        env=env,
        names=("regen_work_dir", "regen_artifacts_dir"),
        patterns=("regen_serve", "regen_nothing"),
    )
    assert local["hosts"]["localhost"]["regen_work_dir"] == str(ROOT / ".work")
    assert local["patterns"] == {"regen_serve": ["localhost"], "regen_nothing": []}
    artifact_dirs, work_dirs = data_roots(local["hosts"])
    assert artifact_dirs == [ROOT / "artifacts"] and work_dirs == [ROOT / ".work"]
    prod = inventory_query(
        [ROOT / "inventory" / "production.example"],
        env=env,
        names=("regen_work_dir",),
        extravars={"regen_work_dir": "/srv/regen"},
    )
    ct200 = prod["hosts"]["ct200"]
    assert ct200["regen_work_dir"] == "/srv/regen"  # extra vars win, as with -e
    assert not host_is_local("ct200", ct200)  # a remote host's work dir is not scanned from here
    assert data_roots(prod["hosts"])[1] == []


def test_the_recorded_command_line_tells_tags_mode_and_inventory(tmp_path: Path) -> None:
    (tmp_path / "command").write_text(
        json.dumps(
            {
                "command": [
                    "ansible-playbook",
                    "-i",
                    "/inv",
                    "--limit",
                    "ct200",
                    "--tags",
                    "demo,introspect",
                    "--check",
                    "regen.yml",
                ]
            }
        )
    )
    assert command_info(tmp_path) == {
        "check": True,
        "tags": ["demo", "introspect"],
        "inventory": ["/inv"],
        "limit": "ct200",
        "playbook": "regen.yml",
    }
    assert command_info(tmp_path / "missing") == {}


# --- processes of a cancelled run ------------------------------------------------------------------


def test_descendants_in_their_own_sessions_are_ended(tmp_path: Path) -> None:
    from regen import procs

    # A parent with a child in the same group and one that called setsid, like Ansible's workers.
    script = (
        "import subprocess, sys, time\n"
        "a = subprocess.Popen(['sleep', '60'])\n"
        "b = subprocess.Popen(['sleep', '61'], start_new_session=True)\n"
        "print(a.pid, b.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        child_a, child_b = (int(x) for x in parent.stdout.readline().split())
        found = {p.pid: p for p in procs.descendants(parent.pid)}
        assert {child_a, child_b} <= set(found)
        assert os.getpgid(child_b) == child_b != os.getpgid(child_a)
        os.killpg(parent.pid, 9)  # what ansible-runner does to ansible-playbook's group
        parent.wait(10)
        assert procs.still_running(found[child_b]), "the setsid child survives runner's kill"
        assert set(procs.terminate(list(found.values()), grace=5)) >= {child_b}
        assert not procs.still_running(found[child_a]) and not procs.still_running(found[child_b])
    finally:
        if parent.poll() is None:
            parent.kill()
