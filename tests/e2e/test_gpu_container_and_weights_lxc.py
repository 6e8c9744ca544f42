"""From a bare host to a ready container, on real LXC containers (scripts/lxc-test-host.sh, the helper the
molecule scenarios create theirs with: systemd Debian, each its own network namespace on lxcbr0).

- The lxc_gpu_container role's plain-LXC path against a running container, with this machine as the node
  (ansible-playbook on localhost, group regen_hypervisor): the config gains the device and limit lines, the
  container is restarted and waited for, and inside it the device node is there and opens read-write (the
  device cgroup lets it through), init has the limits and /dev/shm its size; a second run is changed=0 and
  restarts nothing. This machine has no GPU: /dev/cpu_dma_latency stands in for a GPU node (a character
  device LXC does not pass by default; any proves the mechanism), named as such in the inventory.
- The model_weights role between two containers: the bastion path (rsync pushed from a bastion container to
  the GPU container over the bridge) with the bastion's missing login refused, a transfer killed mid-shard
  and taken up again from what it had written, a rotten shard refused and fetched again, changed=0 once
  verified; the mirror path from a directory the bastion shares with the GPU container (a bind mount
  standing in for NFS).

Limits: the test host may not raise its own hard limits (no CAP_SYS_RESOURCE in this workplace's sandbox),
so the container gets the limits this machine's root holds rather than memlock unlimited; the refusal of
limits a node cannot grant is tested in tests/integration/test_lxc_gpu_container_role.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.ansible import BIN, ROOT, ansible_env, run_playbook
from tests.helpers.bitrot import rot_in_place
from tests.integration.test_lxc_gpu_container_role import _grantable_limits

pytestmark = [pytest.mark.e2e, pytest.mark.lxc]

SUFFIX = hashlib.sha1(str(ROOT).encode()).hexdigest()[:6]
BASTION = f"regen-bastion-{SUFFIX}"
GPU = f"regen-gpu-{SUFFIX}"
LXC_PATH = Path("/var/lib/lxc")
HELPER = ROOT / "scripts" / "lxc-test-host.sh"
# The stand-in for a GPU node: a character device of this machine that LXC's defaults do not allow.
STANDIN = "cpu_dma_latency"
PUBLISHED = "/root/published"  # the files on the bastion
DEST = "/root/models/tiny"  # the model directory in the GPU container
# Random bytes: rsync's block matching must find only what a killed transfer really wrote.
SHARDS = {"model-00001-of-00002.safetensors": 24 << 20, "model-00002-of-00002.safetensors": 1 << 20}
BIG = "model-00001-of-00002.safetensors"


def _rootfs(name: str) -> Path:
    return LXC_PATH / name / "rootfs"


def _attach(name: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["lxc-attach", "-n", name, "--", *argv], capture_output=True, text=True, check=False, timeout=60
    )


def _write_published(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "kimi_k2", "hidden_size": 64}))
    (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    for name, size in SHARDS.items():
        (root / name).write_bytes(os.urandom(size))
    index = {
        "metadata": {"total_size": sum(SHARDS.values())},
        "weight_map": {f"w{i}": n for i, n in enumerate(SHARDS)},
    }
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def _create(name: str, pubkey: Path, extra_config: str = "") -> str:
    env = {**os.environ, "REGEN_LXC_EXTRA_CONFIG": extra_config}
    done = subprocess.run(
        [str(HELPER), "create", name, str(pubkey)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)["address"]


def _destroy(name: str) -> None:
    subprocess.run([str(HELPER), "destroy", name], capture_output=True, check=False, timeout=120)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The bastion (with the published files) and the GPU container (the bastion's directory bind-mounted
    read-only at /mnt/mirror), both booted, reachable over SSH with a key of this test."""
    assert os.geteuid() == 0, "LXC system containers need root: run the e2e tests as root (CI does)"
    home = tmp_path_factory.mktemp("lab")
    key = home / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    try:
        bastion = _create(BASTION, key.with_suffix(".pub"))
        _write_published(_rootfs(BASTION) / PUBLISHED.lstrip("/"))
        shared = _rootfs(BASTION) / PUBLISHED.lstrip("/")
        gpu = _create(
            GPU, key.with_suffix(".pub"), f"lxc.mount.entry = {shared} mnt/mirror none bind,ro,create=dir 0 0"
        )
        yield {"home": home, "key": key, "bastion": bastion, "gpu": gpu}
    finally:
        _destroy(GPU)
        _destroy(BASTION)


def _node_inventory(home: Path) -> Path:
    node = {
        "ansible_connection": "local",
        "ansible_python_interpreter": str(BIN / "python"),
        "regen_model_path": str(home / "unused-model"),
        "regen_artifacts_dir": str(home / "artifacts"),
        "lxc_gpu_container_platform": "lxc",
        "lxc_gpu_container_name": GPU,
        "lxc_gpu_container_gpu_count": 1,
        "lxc_gpu_container_standin_nodes": [STANDIN],  # stand-in for a GPU node (no GPU here)
        **_grantable_limits(),
        "lxc_gpu_container_shm_size_gib": 2,
    }
    path = home / "node.yml"
    path.write_text(
        yaml.safe_dump({"all": {"children": {"regen_hypervisor": {"hosts": {"localhost": node}}}}})
    )
    return path


def _weights_inventory(lab: dict) -> Path:
    ssh = {
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(lab["key"]),
        "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null",
        "ansible_python_interpreter": "/usr/bin/python3",
    }
    gpu = {
        "ansible_host": lab["gpu"],
        "regen_model_path": DEST,
        "regen_artifacts_dir": str(lab["home"] / "artifacts"),
        "model_weights_source": "bastion",
        "model_weights_bastion_host": "bastion",
        "model_weights_bastion_path": PUBLISHED,
        "model_weights_margin_gib": 0,
    }
    inventory = {
        "all": {
            "vars": ssh,
            "hosts": {"bastion": {"ansible_host": lab["bastion"]}},
            "children": {"regen_serve": {"hosts": {"gpu": gpu}}},
        }
    }
    path = lab["home"] / "weights.yml"
    path.write_text(yaml.safe_dump(inventory))
    return path


def _init_pid(name: str) -> str:
    return subprocess.run(
        ["lxc-info", "-n", name, "-pH"], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_gpu_container_role_on_a_running_container(lab):
    assert _attach(GPU, "test", "-e", f"/dev/{STANDIN}").returncode != 0  # not passed by LXC's defaults
    inventory = _node_inventory(lab["home"])
    before = _init_pid(GPU)
    config = LXC_PATH / GPU / "config"
    original = config.read_text()

    # Check mode shows the lines it would add and changes nothing: the config, the running container.
    checked = run_playbook("playbooks/container.yml", "--check", "--diff", inventory=inventory)
    assert checked.returncode == 0, checked.output[-3000:]
    assert f"dev/{STANDIN}" in checked.output and config.read_text() == original and _init_pid(GPU) == before

    first = run_playbook("playbooks/container.yml", inventory=inventory)
    assert first.returncode == 0, first.output[-3000:]
    assert first.counts()["changed"] >= 2, first.output[-3000:]  # the lines, the restart
    assert _init_pid(GPU) != before  # restarted, and up again: the role waited for its systemd
    assert _attach(GPU, "systemctl", "is-system-running").stdout.strip() in ("running", "degraded")

    # The node inside: the host's major:minor, and the device cgroup lets it open read-write.
    host = os.stat(f"/dev/{STANDIN}").st_rdev
    listed = _attach(GPU, "stat", "-c", "%t:%T", f"/dev/{STANDIN}").stdout.strip()
    assert listed == f"{os.major(host):x}:{os.minor(host):x}", listed
    opened = _attach(
        GPU, "python3", "-c", f"import os; os.close(os.open('/dev/{STANDIN}', os.O_RDWR)); print('ok')"
    )
    assert opened.stdout.strip() == "ok", opened.stderr
    # init (and so every process of the container) runs with the limits; /dev/shm has its own size.
    limits = _attach(GPU, "cat", "/proc/1/limits").stdout
    granted = _grantable_limits()
    memlock, nofile = granted["lxc_gpu_container_memlock"], granted["lxc_gpu_container_nofile"]
    assert re.search(rf"Max locked memory\s+{memlock}\s+{memlock}\s", limits), limits
    assert re.search(rf"Max open files\s+{nofile}\s+{nofile}\s", limits), limits
    shm = _attach(GPU, "findmnt", "-no", "FSTYPE,OPTIONS", "/dev/shm").stdout
    assert shm.startswith("tmpfs") and "size=2097152k" in shm, shm

    pid = _init_pid(GPU)
    again = run_playbook("playbooks/container.yml", inventory=inventory)
    assert again.returncode == 0 and again.counts()["changed"] == 0, again.output[-3000:]
    assert _init_pid(GPU) == pid  # nothing restarted


def _partial_of_big_shard() -> Path | None:
    for path in (_rootfs(GPU) / DEST.lstrip("/")).rglob(f"*{BIG}*"):
        try:
            if path.is_file() and path.stat().st_size > (2 << 20):
                return path
        except FileNotFoundError:  # rsync renamed it between the listing and the stat
            continue
    return None


def test_weights_from_a_bastion_and_a_mirror_container(lab):
    inventory = _weights_inventory(lab)
    published = _rootfs(BASTION) / PUBLISHED.lstrip("/")
    dest = _rootfs(GPU) / DEST.lstrip("/")

    # rsync runs on the bastion and logs in to the GPU host by itself: without the bastion's key authorized
    # there, the role says so before pushing anything.
    refused = run_playbook("playbooks/weights.yml", inventory=inventory)
    assert refused.returncode != 0, refused.output[-3000:]
    assert "bastion cannot log in to gpu over SSH" in refused.output, refused.output[-3000:]
    assert not (dest / BIG).exists()
    # The operator's one step: the bastion's key authorized on the GPU host.
    made = _attach(BASTION, "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", "/root/.ssh/id_ed25519")
    assert made.returncode == 0, made.stderr
    bastion_key = (_rootfs(BASTION) / "root/.ssh/id_ed25519.pub").read_text()
    with (_rootfs(GPU) / "root/.ssh/authorized_keys").open("a") as keys:
        keys.write(bastion_key)

    # Check mode pushes nothing (rsync --dry-run), and says it would fetch and verify.
    checked = run_playbook("playbooks/weights.yml", "--check", inventory=inventory)
    assert checked.returncode == 0, checked.output[-3000:]
    assert "check mode: would fetch and verify" in " ".join(checked.output.split())
    assert not (dest / BIG).exists() and not (dest / "config.json").exists()

    # A push at 2 MB/s, its rsync killed on the bastion once the big shard is partly written.
    slow = subprocess.Popen(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), "playbooks/weights.yml", "-e",
         json.dumps({"model_weights_rsync_opts": ["--bwlimit=2m"]})],
        cwd=ROOT, env=ansible_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while _partial_of_big_shard() is None and time.monotonic() < deadline and slow.poll() is None:
        time.sleep(0.2)
    assert _partial_of_big_shard() is not None, "the big shard never started arriving"
    assert _attach(BASTION, "pkill", "-x", "rsync").returncode == 0
    output, _ = slow.communicate(timeout=120)
    assert slow.returncode != 0, output[-3000:]
    kept = _partial_of_big_shard()
    assert kept is not None and 0 < kept.stat().st_size < SHARDS[BIG], output[-3000:]
    kept_bytes = kept.stat().st_size
    assert not (dest / BIG).exists()  # never a half shard under its own name
    config_inode = (dest / "config.json").stat().st_ino  # metadata arrived first

    resumed = run_playbook(
        "playbooks/weights.yml",
        "-v",
        "-e",
        json.dumps({"model_weights_rsync_opts": ["--stats"]}),
        inventory=inventory,
    )
    assert resumed.returncode == 0, resumed.output[-3000:]
    # rsync took the kept part as the basis: it matched at least what was kept (less a block) and sent
    # the rest of the big shard and the small one, not the whole big shard again.
    matched = [int(m.replace(",", "")) for m in re.findall(r"Matched data: ([\d,]+) bytes", resumed.output)]
    literal = [int(m.replace(",", "")) for m in re.findall(r"Literal data: ([\d,]+) bytes", resumed.output)]
    assert matched and max(matched) >= kept_bytes - (64 << 10), resumed.output[-3000:]
    assert literal and max(literal) < sum(SHARDS.values()), resumed.output[-3000:]
    for name in [*SHARDS, "config.json", "model.safetensors.index.json"]:
        assert (dest / name).read_bytes() == (published / name).read_bytes(), name
    assert (dest / "config.json").stat().st_ino == config_inode  # a finished file is kept, not copied again
    assert not (dest / ".~tmp~").exists()

    again = run_playbook("playbooks/weights.yml", inventory=inventory)
    assert again.returncode == 0 and again.counts("gpu")["changed"] == 0, again.output[-3000:]

    # Bit rot in a shard after it was verified, its size and time unchanged (rsync's quick check skips it),
    # and the marker gone: the copy is refused and the shard removed; the next run pushes it again.
    shard = dest / "model-00002-of-00002.safetensors"
    rot_in_place(shard)
    (dest / ".regen-weights.json").unlink()
    rotten = run_playbook("playbooks/weights.yml", inventory=inventory)
    assert rotten.returncode != 0 and f"refused: {shard.name}: sha256" in rotten.output, rotten.output[-3000:]
    assert not shard.exists()
    fixed = run_playbook("playbooks/weights.yml", inventory=inventory)
    assert fixed.returncode == 0, fixed.output[-3000:]
    assert shard.read_bytes() == (published / shard.name).read_bytes()

    # The mirror path: the bastion's directory, mounted read-only in the GPU container (NFS's stand-in);
    # the manifest the bastion path wrote there is the one the copy is checked against.
    mirror = {
        "model_weights_source": "mirror",
        "model_weights_mirror_path": "/mnt/mirror",
        "regen_model_path": "/root/models/tiny-mirror",
    }
    copied = run_playbook("playbooks/weights.yml", "-e", json.dumps(mirror), inventory=inventory)
    assert copied.returncode == 0 and copied.counts("gpu")["changed"] >= 1, copied.output[-3000:]
    mirrored = _rootfs(GPU) / "root/models/tiny-mirror"
    for name in SHARDS:
        assert (mirrored / name).read_bytes() == (published / name).read_bytes(), name
    marker = json.loads((mirrored / ".regen-weights.json").read_text())
    assert marker["source"] == "mirror:/mnt/mirror" and set(SHARDS) <= set(marker["files"])
    again = run_playbook("playbooks/weights.yml", "-e", json.dumps(mirror), inventory=inventory)
    assert again.returncode == 0 and again.counts("gpu")["changed"] == 0, again.output[-3000:]
