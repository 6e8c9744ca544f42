"""The train stage's online (disaggregated) path on the embedded default, end to end on the CPU.

Real parts: playbooks/train.yml on localhost with the topology forced online
(`drafter_training_topology=online`); the mooncake_master role runs the real Mooncake master and metadata
server on loopback; the capture_server role runs regen's transformers capture server on the demo model;
SpecForge 0.2.0's own supervisor (through regen.training.online_launch) runs its producer, which sends the
prompts to the capture server through SpecForge's SGLangServerCaptureAdapter, and its consumer (gloo, one
CPU rank under regen.training.rendezvous), which fetches the features from Mooncake over TCP and takes real
optimizer steps; the stage exports the drafter and stops the capture server and the Mooncake master. While
it runs, every process of the run listens on loopback (the trainers' store too) except Mooncake's transfer
engine, which is held to the named port range and closed to other hosts by regen's nftables table. Then: a
second run changes nothing; after an attempt that ended failed, the plan (shown in check mode, which starts
nothing) moves to attempt 2 in fresh directories (SpecForge does not resume an online producer).

Each test has its own work directory; the training venv (SpecForge layered on the project venv) and the
Mooncake venv are built once and shared.

Refusals, each with its cause and the variable to change: a Mooncake port held by another process; capture
servers named in inventory that do not answer.

A fault: the Mooncake master killed once the first features are in (as a crashed or OOM-killed master
would be). The run fails within minutes rather than hanging, the failure names the lost master (SpecForge's
own error only says a feature is "not available"), and the rest of the stack is stopped.

On GPUs, in check mode (nothing connects to the example's host): the CT200 example inventory with a
Qwen3-8B target plans SpecForge's one-server + DP7 layout: the SGLang capture server on GPU 0 with
SpecForge's capture flags, seven trainer ranks on GPUs 1-7.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.ansible import run_playbook
from tests.helpers.mooncake import free_ports, mooncake_venv

ROOT = Path(__file__).resolve().parents[2]
DEMO_CACHE = ROOT / ".cache" / "demo-models"
TRANSFER_PORTS = (21000, 21999)


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model, its facts and eight tokenized samples, shared by the module's runs."""
    sys.path.insert(0, str(ROOT))
    from tests.integration.test_train_stage import _facts, _tokenized

    base = tmp_path_factory.mktemp("online")
    model = base / "models" / "demo"
    subprocess.run(
        [sys.executable, "-m", "regen.demo.build", "--output", str(model), "--cache-dir", str(DEMO_CACHE)],
        check=True,
        capture_output=True,
    )
    config = json.loads((model / "config.json").read_text())
    (base / "model_facts.json").write_text(json.dumps(_facts(model, config, 3845, 0)))
    _tokenized(model, base / "tokenized", 8)
    # Three capture batches of eight: room for a fault after the first.
    _tokenized(model, base / "tokenized-24", 24)
    mooncake_venv(base)
    return base


@pytest.fixture(scope="module", autouse=True)
def _drop_the_online_table_afterwards():
    """The online path loads regen's nftables table `inet regen_online` on this host; remove it after."""
    yield
    subprocess.run(["nft", "delete", "table", "inet", "regen_online"], capture_output=True, check=False)


def _args(data: Path, work: Path, *extra: str) -> list[str]:
    """A run in `work` on the shared data, on free loopback ports."""
    artifacts = work / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    if not (artifacts / "model_facts.json").exists():
        (artifacts / "model_facts.json").write_text((data / "model_facts.json").read_text())
    rpc, metadata, metrics, capture, master = free_ports(5)
    pairs = {
        "regen_work_dir": work / "work",
        "regen_artifacts_dir": artifacts,
        "regen_model_path": data / "models" / "demo",
        "regen_training_venv": data / "venvs" / "training",
        "drafter_training_data_dir": data / "tokenized",
        "drafter_training_epochs": 1,
        "drafter_training_save_interval": 2,
        "drafter_training_topology": "online",
        "drafter_training_online_mooncake_venv": ROOT / ".cache" / "test-mooncake" / "venvs" / "mooncake",
        "drafter_training_online_mooncake_rpc_port": rpc,
        "drafter_training_online_mooncake_metadata_port": metadata,
        "drafter_training_online_mooncake_metrics_port": metrics,
        "drafter_training_online_capture_port": capture,
        "drafter_training_master_port": master,
    }
    out = []
    for key, value in pairs.items():
        out += ["-e", f"{key}={value}"]
    # Mooncake's transfer engine listeners (capture server, producer, consumer): a range outside the
    # kernel's ephemeral ports, so the test can tell them apart.
    out += ["-e", json.dumps({"drafter_training_online_mooncake_transfer_ports": list(TRANSFER_PORTS)})]
    return out + list(extra)


def _play(*args: str) -> tuple[int, str, dict]:
    run = run_playbook("playbooks/train.yml", *args, inventory="inventory/local", timeout=900)
    return run.returncode, run.output, run.recap.get("localhost", {})


def _stack_processes(work: Path) -> list[str]:
    """Capture servers and Mooncake masters still running for this work directory."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if str(work) in line and ("regen.training.capture_server" in line or "mooncake" in line):
            found.append(line)
    return found


class Listeners(threading.Thread):
    """The TCP listeners of every process whose command line names ``marker``, sampled until stopped."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.marker = marker
        self.seen: set[tuple[str, str, int]] = set()  # (the program's module or name, address, port)
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.2):
            for proc in psutil.process_iter(["cmdline"]):
                line = proc.info["cmdline"] or []
                if not any(self.marker in part for part in line):
                    continue
                program = next((line[i + 1] for i, p in enumerate(line[:-1]) if p == "-m"), line[0])
                try:
                    sockets = proc.net_connections("inet")
                except psutil.Error:
                    continue
                self.seen |= {
                    (program, c.laddr.ip, c.laddr.port) for c in sockets if c.status == psutil.CONN_LISTEN
                }

    def stop(self) -> set[tuple[str, str, int]]:
        self._halt.set()
        self.join()
        return self.seen


@pytest.mark.e2e
def test_online_training_runs_end_to_end_on_the_cpu(demo_data: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    args = _args(demo_data, tmp_path)
    listeners = Listeners(str(work))
    listeners.start()
    code, output, counts = _play(*args)
    seen = listeners.stop()
    assert code == 0, output[-8000:]
    # What the run started listened on loopback, the trainers' store on the plan's port, held by
    # regen.training.rendezvous (SpecForge's own launch would listen on every interface). The exception is
    # Mooncake's transfer engine in the capture server, the producer and the consumer: Mooncake 0.3.13 binds
    # it on every interface, so it is held to the named port range the firewall stage can guard.
    master = int(next(a for a in args if a.startswith("drafter_training_master_port=")).split("=")[1])
    assert ("regen.training.rendezvous", "127.0.0.1", master) in seen, seen
    first, last = TRANSFER_PORTS
    wide = {(program, port) for program, ip, port in seen if not ipaddress.ip_address(ip).is_loopback}
    assert wide, seen  # the transfer engine's listeners were seen (else this test proves nothing)
    assert all(first <= port <= last for _, port in wide), seen
    assert {program for program, _ in wide} <= {
        "regen.training.capture_server", "specforge.cli", "regen.training.rendezvous"
    }, seen  # fmt: skip
    # ... and regen's own nftables table closed that range to every other host before the stack started.
    shown = " ".join(output.split())
    assert f"(TCP {first}-{last}): admits this host only (loopback), drops the rest" in shown, output[-8000:]
    table = subprocess.run(
        ["nft", "list", "table", "inet", "regen_online"], capture_output=True, text=True, check=True
    ).stdout
    assert re.search(rf"tcp dport {first}-{last} counter packets \d+ bytes \d+ drop", table), table
    flat = re.sub(r"\s+", " ", output)
    assert "attempt 1: first attempt" in flat
    assert "TASK [capture_server : Wait until GET /health answers http://127.0.0.1:" in output
    (run_dir,) = (work / "drafter" / "runs").iterdir()
    state = json.loads((run_dir / "status.json").read_text())
    assert state["state"] == "succeeded" and state["done"] == state["total"] == 8, state
    log = (run_dir / "train.log").read_text()
    # SpecForge's own producer streamed every prompt through the capture server; its consumer trained.
    assert "drive_producer returning produced=8 prompts_failed=0" in log
    assert len(re.findall(r"^step \d+: \{'acc'", log, flags=re.M)) == 8
    control = run_dir / "online" / "attempt-1" / "control"
    assert (control / "refs.jsonl.consumer_done").exists() and (control / "refs.jsonl.closed").exists()
    assert (run_dir / "online" / "attempt-1" / "consumer-state" / "consumer.sqlite").exists()
    capture_log = (work / "drafter" / "capture" / "capture.log").read_text()
    assert "captured 8/8 prompts" in capture_log and "stopping after 8 captures" in capture_log
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    assert exported["architectures"] == ["DFlashDraftModel"]
    run_config = (run_dir / "run.yaml").read_text()
    assert "mode: disaggregated" in run_config and "online/attempt-1/control" in run_config
    # The run ended, so the stack is down.
    assert not _stack_processes(work), _stack_processes(work)

    # Nothing changes on a second run.
    code, again, counts = _play(*args)
    assert code == 0, again[-8000:]
    blocks = re.split(r"^(?=TASK \[)", again, flags=re.M)
    changed = [b.splitlines()[0] for b in blocks if b.startswith("TASK") and "\nchanged:" in b]
    assert counts["changed"] == 0, changed

    # An attempt that ended failed is not resumed: the next play plans attempt 2 in fresh directories.
    # Check mode shows the plan, the new run.yaml and the launch, starts nothing, and (as for any failed
    # run) reports the failure it finds.
    assert state["attempt"] == 1
    (run_dir / "status.json").write_text(json.dumps(dict(state, state="failed", exit_code=1)))
    code, output, counts = _play(*args, "--check", "--diff")
    flat = re.sub(r"\s+", " ", output)
    assert "attempt 2: attempt 1 ended failed" in flat, output[-8000:]
    assert "+    control_dir: " in output and "online/attempt-2/control" in output
    assert "TASK [drafter_training : Show the launch command (check mode)]" in output
    assert "Re-running the play starts the next online attempt from the first prompt" in flat
    assert not (run_dir / "online" / "attempt-2").exists() and not _stack_processes(work)


def _kill_master_after_first_capture(work: Path, rpc_port: str, killed: list[float]) -> None:
    capture_log = work / "drafter" / "capture" / "capture.log"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if capture_log.exists() and "captured 8/8" in capture_log.read_text():
            for proc in psutil.process_iter(["cmdline"]):
                line = " ".join(proc.info["cmdline"] or [])
                if "mooncake_master" in line and f"--rpc_port={rpc_port}" in line:
                    proc.kill()
                    killed.append(time.monotonic())
            return
        time.sleep(0.2)


@pytest.mark.e2e
def test_a_mooncake_master_lost_mid_run_fails_the_run_and_names_it(demo_data: Path, tmp_path: Path) -> None:
    args = _args(demo_data, tmp_path, "-e", f"drafter_training_data_dir={demo_data / 'tokenized-24'}")
    rpc_port = next(a for a in args if a.startswith("drafter_training_online_mooncake_rpc_port=")).split("=")[
        1
    ]
    killed: list[float] = []
    killer = threading.Thread(
        target=_kill_master_after_first_capture, args=(tmp_path / "work", rpc_port, killed)
    )
    killer.start()
    code, output, _ = _play(*args)
    ended = time.monotonic()
    killer.join()
    assert killed, output[-8000:]  # the fault happened (else this test proves nothing)
    assert code != 0, output[-8000:]
    flat = re.sub(r"\s+", " ", output)
    assert (
        f"Cause: after the run, the Mooncake master at 127.0.0.1:{rpc_port} does not accept connections"
        in flat
    ), output[-8000:]
    # The capture server saw it too (its /health turns 503 without the master); and nothing hung: SpecForge's
    # first failed read ended the run well inside the play's timeout.
    assert "mooncake unreachable" in flat
    assert ended - killed[0] < 300
    (run_dir,) = (tmp_path / "work" / "drafter" / "runs").iterdir()
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
    assert not _stack_processes(tmp_path / "work"), _stack_processes(tmp_path / "work")


@pytest.mark.e2e
def test_refusals_name_the_cause_and_the_variable(demo_data: Path, tmp_path: Path) -> None:
    # A Mooncake port held by another process: the role names the owner, the stage its own variable.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, output, _ = _play(
            *_args(demo_data, tmp_path, "-e", f"drafter_training_online_mooncake_rpc_port={port}")
        )
    flat = re.sub(r"\s+", " ", output)
    assert code != 0
    assert f"port {port} on 127.0.0.1 (RPC port of the Mooncake master) is already in use by pid" in flat
    assert "drafter_training_online_mooncake_rpc_port" in flat

    # Capture servers and a Mooncake master named in inventory that do not answer: refused before SpecForge.
    dead, rpc, metadata = free_ports(3)
    mooncake = {
        "master_server_addr": f"127.0.0.1:{rpc}",
        "metadata_server": f"http://127.0.0.1:{metadata}/metadata",
        "local_hostname": "127.0.0.1",
        "protocol": "tcp",
    }
    code, output, _ = _play(
        *_args(
            demo_data,
            tmp_path,
            "-e",
            json.dumps({"drafter_training_online_server_urls": [f"http://127.0.0.1:{dead}"]}),
            "-e",
            json.dumps({"drafter_training_online_mooncake": mooncake}),
            "-e",
            "drafter_training_online_preflight_timeout_s=1",
        )
    )
    flat = re.sub(r"\s+", " ", output)
    assert code != 0
    assert f"the Mooncake master at 127.0.0.1:{rpc} does not accept connections" in flat
    assert f"http://127.0.0.1:{dead} does not answer" in flat
    assert "drafter_training_online_server_urls" in flat
    assert "TASK [drafter_training : Start SpecForge's producer and consumer]" not in output


def test_one_server_beside_a_dp7_trainer_in_check_mode(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.integration.test_train_stage import _facts

    model = tmp_path / "models" / "Qwen3-8B"
    model.mkdir(parents=True)
    config = json.loads((ROOT / "tests" / "fixtures" / "configs" / "qwen3-8b" / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config))
    facts = _facts(model, config, 151669, 8)
    facts["environment"]["gpu"]["memory_per_gpu_bytes"] = 97887 * 1024 * 1024
    (tmp_path / "model_facts.json").write_text(json.dumps(facts))
    run = run_playbook(
        "playbooks/train.yml",
        "--check",
        "--diff",
        "-e",
        "ansible_connection=local",
        "-e",
        f"ansible_python_interpreter={sys.executable}",
        "-e",
        f"regen_job_python={sys.executable}",
        "-e",
        f"regen_artifacts_dir={tmp_path}",
        "-e",
        f"regen_model_path={model}",
        "-e",
        f"regen_work_dir={tmp_path / 'work'}",
        "-e",
        "drafter_training_topology=online",
        inventory="inventory/production.example",
        timeout=600,
    )
    assert run.returncode == 0, run.output[-6000:]
    flat = re.sub(r"\s+", " ", run.output)
    assert "capture servers: http://127.0.0.1:30200 (target layers 1, 9, 17, 25, 33, context 6159)" in flat
    assert (
        # SGLang capture runs in the capture venv of its own (the patched SGLang), training in SpecForge's.
        "/root/venv_capture/bin/python -m sglang.launch_server --model-path "
        + str(model)
        + " --trust-remote-code "
        "--tp-size 1"
    ) in flat
    assert (
        "--skip-tokenizer-init --chunked-prefill-size -1 --disable-radix-cache --enable-spec-capture "
        "--spec-capture-method dflash --spec-capture-aux-layer-ids 1 9 17 25 33"
    ) in flat
    # SpecForge's producer + consumer supervisor, the consumer's 7 ranks under regen's rendezvous (the store
    # on loopback), every Mooncake client on the named transfer port range.
    assert re.search(
        r"--env CUDA_VISIBLE_DEVICES=1,2,3,4,5,6,7 --env MC_MIN_RPC_PORT=15000 "
        r"--env MC_MAX_RPC_PORT=17000 -- /root/venv_specforge/bin/python -m regen\.training\.online_launch "
        r"--host 127\.0\.0\.1 --port \d+ -- --config \S+/run\.yaml",
        flat,
    ), flat[-6000:]
    assert "+    nproc_per_node: 7" in run.output and "+  resident_high_watermark_bytes: " in run.output
    # One host: the stack is on loopback; the host's own address appears only as a source the transfer
    # engine's firewall rule admits besides loopback (the summary, and the rule in the table's diff).
    admitted = "(TCP 15000-17000): admits this host only (loopback, 10.1.2.200), drops the rest"
    assert admitted in flat
    rest = flat.replace(admitted, "").replace("tcp dport { 15000-17000 } ip saddr { 10.1.2.200 } accept", "")
    assert "10.1.2.200" not in rest, rest[max(0, rest.find("10.1.2.200") - 300) :][:600]
