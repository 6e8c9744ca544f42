"""The model_weights role for real (playbooks/weights.yml on localhost): the hub path through the real `hf`
client against a loopback file server this test starts (tests/helpers/hub_server.py, serving files the test
wrote), and the mirror path. A killed transfer is taken up again (finished shards kept, the partial one
restarted, its dead temporary file removed), a corrupted shard is refused
and fetched again, the disk is checked before any shard, and a verified copy is changed=0 without contacting
anything."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.helpers.ansible import BIN, ROOT, ansible_env, localhost_inventory, run_playbook
from tests.helpers.bitrot import rot_in_place
from tests.helpers.hub_server import HubServer

COMMIT = "3f1c0ffee0ddba11c0dedbadc0ffee0123456789"
REPO = "org/tiny-moe"
# hf writes a download in 10 MiB chunks (huggingface_hub's DOWNLOAD_CHUNK_SIZE): the first shard is larger, so
# a killed transfer leaves a partly written temporary file behind.
SHARDS = {"model-00001-of-00002.safetensors": 24 << 20, "model-00002-of-00002.safetensors": 1 << 20}


def _write_repo(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "kimi_k2", "hidden_size": 64}))
    (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    for i, (name, size) in enumerate(SHARDS.items()):
        (root / name).write_bytes(hashlib.sha256(str(i).encode()).digest() * (size // 32))
    index = {
        "metadata": {"total_size": sum(SHARDS.values())},
        "weight_map": {f"w{i}": n for i, n in enumerate(SHARDS)},
    }
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def _inventory(tmp_path: Path, **variables) -> Path:
    base = {
        "regen_work_dir": str(tmp_path / "work"),
        "regen_artifacts_dir": str(tmp_path / "artifacts"),
        "regen_model_path": str(tmp_path / "models" / "tiny"),
        "model_weights_margin_gib": 0,
    }
    return localhost_inventory(tmp_path / "hosts.yml", variables={**base, **variables})


def _hub_vars(tmp_path: Path, hub: HubServer) -> dict:
    return {
        "model_weights_source": "hub",
        "model_weights_repo_id": REPO,
        "model_weights_revision": COMMIT,
        "model_weights_hf_cli": str(BIN / "hf"),
        "model_weights_hf_environment": {
            "HF_ENDPOINT": hub.endpoint,
            "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
        },
    }


def _partly_written(paths) -> bool:
    for path in paths:
        try:
            if path.stat().st_size > 0:
                return True
        except FileNotFoundError:  # finished (renamed) between the listing and the stat
            continue
    return False


def _kill_during_first_shard(inventory: Path, dest: Path) -> None:
    """Start the play, wait until the small shard is finished and the large one partly written, kill the play
    and hf with it."""
    proc = subprocess.Popen(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), "playbooks/weights.yml"],
        cwd=ROOT,
        env=ansible_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            # hf fetches the shards in parallel: the small one must be finished (under its own name), not
            # merely started, when the large one is cut.
            finished = (dest / "model-00002-of-00002.safetensors").exists()
            if finished and _partly_written(dest.glob(".cache/huggingface/download/*.incomplete")):
                break
            assert proc.poll() is None, "the play ended before any shard was partly written"
            time.sleep(0.05)
        else:
            raise AssertionError("no partial shard appeared")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        # Ansible runs the command module's child in a session of its own: kill the hf client too (the one
        # downloading into this test's directory), as a power cut or an OOM kill would.
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"download" in cmdline and str(dest).encode() in cmdline:
                os.kill(int(pid), signal.SIGKILL)


def test_hub_path_resumes_verifies_refuses_and_is_idempotent(tmp_path):
    repo = _write_repo(tmp_path / "published")
    dest = tmp_path / "models" / "tiny"
    with HubServer(repo, REPO, COMMIT, throttle=0.01) as hub:
        inventory = _inventory(tmp_path, **_hub_vars(tmp_path, hub))
        _kill_during_first_shard(inventory, dest)
        assert (dest / "config.json").is_file()  # metadata first
        assert not (dest / "model-00001-of-00002.safetensors").exists()
        hub.throttle = 0
        before = len(hub.requests)
        first = run_playbook("playbooks/weights.yml", inventory=inventory)
        assert first.returncode == 0, first.output[-3000:]
        # huggingface_hub 2.x downloads into a process-unique temporary file: the killed run's partial shard
        # restarts from its first byte, the finished shard is kept, and the role removed the dead partial.
        again_fetched = [r[1].rsplit("/", 1)[1] for r in hub.requests[before:] if r[0] == "GET"]
        assert "model-00001-of-00002.safetensors" in again_fetched
        assert "model-00002-of-00002.safetensors" not in again_fetched
        assert not list(dest.glob(".cache/huggingface/download/*.incomplete"))
        for name in SHARDS:
            assert (dest / name).read_bytes() == (repo / name).read_bytes()

        seen = len(hub.requests)
        again = run_playbook("playbooks/weights.yml", inventory=inventory)
        assert again.returncode == 0 and again.counts()["changed"] == 0, again.output[-3000:]
        assert len(hub.requests) == seen  # verified: nothing contacted

        # Bit rot in a shard after it was verified (same size, same mtime, so hf's record says the file is
        # current and hf keeps it); the marker goes (a changed source setting would do the same): the
        # verification refuses the shard and removes it, the next run fetches it again.
        shard = dest / "model-00002-of-00002.safetensors"
        rot_in_place(shard)
        (dest / ".regen-weights.json").unlink()
        refused = run_playbook("playbooks/weights.yml", inventory=inventory)
        assert (
            refused.returncode != 0 and "refused: model-00002-of-00002.safetensors: sha256" in refused.output
        )
        assert not shard.exists()
        fixed = run_playbook("playbooks/weights.yml", inventory=inventory)
        assert fixed.returncode == 0, fixed.output[-3000:]
        assert shard.read_bytes() == (repo / shard.name).read_bytes()


def test_check_mode_on_a_fresh_host_fetches_nothing_and_says_what_it_would_do(tmp_path):
    repo = _write_repo(tmp_path / "published")
    dest = tmp_path / "models" / "tiny"
    with HubServer(repo, REPO, COMMIT) as hub:
        inventory = _inventory(tmp_path, **_hub_vars(tmp_path, hub))
        checked = run_playbook("playbooks/weights.yml", "--check", inventory=inventory)
        assert checked.returncode == 0, checked.output[-3000:]
        assert "check mode: would fetch and verify" in " ".join(checked.output.split())
        assert not hub.requests and not dest.exists()


def test_disk_is_checked_before_any_shard_is_fetched(tmp_path):
    repo = _write_repo(tmp_path / "published")
    with HubServer(repo, REPO, COMMIT) as hub:
        inventory = _inventory(tmp_path, **_hub_vars(tmp_path, hub), model_weights_margin_gib=10**7)
        run = run_playbook("playbooks/weights.yml", inventory=inventory)
        assert run.returncode != 0 and "not enough disk under" in run.output
        assert not any(r[1].endswith(".safetensors") for r in hub.requests if r[0] == "GET")


def test_mirror_path_writes_the_manifest_at_the_source_and_refuses_a_corrupted_shard(tmp_path):
    mirror = _write_repo(tmp_path / "mirror")
    dest = tmp_path / "models" / "tiny"
    inventory = _inventory(tmp_path, model_weights_source="mirror", model_weights_mirror_path=str(mirror))
    first = run_playbook("playbooks/weights.yml", inventory=inventory)
    assert first.returncode == 0, first.output[-3000:]
    manifest = json.loads((mirror / ".regen-sha256.json").read_text())["files"]
    assert set(manifest) == {"config.json", "tokenizer_config.json", "model.safetensors.index.json", *SHARDS}
    assert (dest / "model-00001-of-00002.safetensors").read_bytes() == (
        mirror / "model-00001-of-00002.safetensors"
    ).read_bytes()
    again = run_playbook("playbooks/weights.yml", inventory=inventory)
    assert again.returncode == 0 and again.counts()["changed"] == 0, again.output[-3000:]

    # The mirror's shard rots after its manifest was written: the copy is refused, never kept.
    shard = mirror / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[0:4] = b"ROT!"
    shard.write_bytes(bytes(data))
    (dest / shard.name).unlink()
    refused = run_playbook("playbooks/weights.yml", inventory=inventory)
    assert refused.returncode != 0 and f"refused {shard.name}" in refused.output, refused.output[-3000:]
    assert not (dest / shard.name).exists()
