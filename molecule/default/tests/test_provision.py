"""Verify the CT200 stand-in after `converge` (molecule runs these with testinfra over SSH).

The container was provisioned by playbooks/provision.yml with the demo set in offline mode. These tests
look at the container itself (testinfra's `host`) and at what the run left on the controller; the last
one re-runs the python_env role with a lock that lacks tiktoken and expects the exact failure that
motivated regen, with the working venv left in place.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

VENV = "/root/regen/venvs/demo"
MODEL = "/root/models/regen-demo-kimi"
HOST = "ct200-standin"
PROJECT = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", Path(__file__).resolve().parents[3]))
EPHEMERAL = Path(os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "/nonexistent"))


def test_the_container_is_a_systemd_debian_host(host) -> None:
    assert host.system_info.distribution == "debian"
    assert host.run("systemctl is-system-running").stdout.strip() in ("running", "degraded")
    assert host.run("readlink /proc/1/exe").stdout.strip().endswith("systemd")


def test_demo_venv_is_a_symlink_to_a_verified_build(host) -> None:
    link = host.file(VENV)
    assert link.is_symlink
    target = link.linked_to
    assert target.startswith(VENV + ".regen-"), target
    fingerprint = host.file(f"{target}/.regen-env/fingerprint").content_string.strip()
    assert target.endswith(fingerprint[:12])
    out = host.check_output(
        f"{VENV}/bin/python -c 'import transformers, tiktoken; "
        "print(transformers.__version__, tiktoken.__version__)'"
    )
    assert out.split() == ["5.24.0", "0.14.0"]
    # The demo set deliberately has no torch.
    assert host.run(f"{VENV}/bin/python -c 'import torch'").rc != 0


def test_tokenizer_smoke_passes_inside_the_container(host) -> None:
    script = (
        "import json; from transformers import AutoTokenizer; "
        f"t = AutoTokenizer.from_pretrained('{MODEL}', trust_remote_code=True); "
        "ids = t.encode('hello from the container'); "
        "print(json.dumps({'cls': type(t).__name__, 'n': len(t), 'text': t.decode(ids)}))"
    )
    result = host.run(f'HF_HUB_OFFLINE=1 {VENV}/bin/python -c "{script}"')
    assert result.rc == 0, result.stderr
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    assert doc["cls"] == "TikTokenTokenizer"
    assert "hello from the container" in doc["text"]
    assert doc["n"] > 1000


def test_manifest_is_recorded_on_the_controller_and_in_the_venv(host) -> None:
    manifest_path = EPHEMERAL / "artifacts" / "provision" / HOST / "demo.json"
    assert manifest_path.is_file(), manifest_path
    manifest = json.loads(manifest_path.read_text())
    assert manifest["environment"] == "demo"
    assert manifest["packages"]["tiktoken"] == "0.14.0"
    assert manifest["packages"]["transformers"] == "5.24.0"
    assert manifest["python"]["version"].startswith("3.11.")
    assert manifest["python"]["executable"].startswith(VENV)
    assert manifest["tokenizer"]["ok"] is True and manifest["tokenizer"]["model_path"] == MODEL
    assert manifest["torch"] is None  # no torch in the demo set, so no CUDA version or arch list
    assert manifest["installer"] == "pip"  # no uv in the container
    on_host = json.loads(host.file(f"{VENV}/.regen-env/manifest.json").content_string)
    assert on_host["fingerprint"] == manifest["fingerprint"]


def test_offline_mode_used_the_copied_wheelhouse(host) -> None:
    wheels = host.file("/root/regen/wheelhouse/demo")
    assert wheels.is_directory
    names = host.check_output("ls /root/regen/wheelhouse/demo")
    assert "tiktoken-0.14.0-" in names and "transformers-5.24.0-" in names


@pytest.fixture(scope="module")
def lock_without_tiktoken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lock = (PROJECT / "envs" / "demo.lock").read_text()
    # The whole hashed entry goes: the requirement line and the --hash lines that continue it.
    kept, removed = re.subn(r"(?m)^tiktoken==\S+(?: \\\n[ \t]+--hash=\S+)+\n", "", lock)
    assert removed == 1
    path = tmp_path_factory.mktemp("locks") / "demo-without-tiktoken.lock"
    path.write_text(kept)
    return path


def test_venv_without_tiktoken_fails_verification_and_keeps_the_old_venv(host, lock_without_tiktoken) -> None:
    before = host.file(VENV).linked_to
    playbook = lock_without_tiktoken.parent / "broken.yml"
    playbook.write_text(
        "- hosts: ct200-standin\n"
        "  gather_facts: false\n"
        "  roles:\n"
        # Role regen types and defaults the regen_* globals (regen_demo_packages too) for the roles after it.
        "    - role: regen\n"
        "    - role: python_env\n"
        "      vars:\n"
        "        python_env_envs:\n"
        f"          - {{name: demo, path: {VENV}, lock: {lock_without_tiktoken},\n"
        "             remedy_variable: regen_demo_packages, verify_imports: [transformers],\n"
        f"             tokenizer_model_path: {MODEL}}}\n"
    )
    env = {**os.environ, "ANSIBLE_CALLBACK_RESULT_FORMAT": "json", "ANSIBLE_NOCOLOR": "1"}
    inventory = os.environ["MOLECULE_INVENTORY_FILE"]
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            "-i",
            str(Path(inventory).parent),
            str(playbook),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    expected = (
        f"tiktoken is not installed in {VENV} (environment 'demo'), so the tokenizer of {MODEL} cannot "
        "load there (AutoTokenizer with trust_remote_code); add tiktoken to regen_demo_packages"
    )
    assert expected in output, output[-3000:]
    # The previous, working venv is untouched and still verifies; the failed build is gone.
    assert host.file(VENV).linked_to == before
    assert host.run(f"{VENV}/bin/python -c 'import tiktoken'").rc == 0
    leftovers = host.check_output(f"ls -d {VENV}.regen-* | wc -l")
    assert leftovers.strip() == "1"
