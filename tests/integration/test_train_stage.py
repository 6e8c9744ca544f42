"""The train stage (playbooks/train.yml, role drafter_training) through real ansible-playbook runs.

* Production settings in check mode: the CT200 example inventory with only the connection (and the
  helper interpreter, which a not-yet-provisioned host lacks) pointed at this machine. Nothing connects
  to the example's address; the play must plan Kimi K2.6's drafter, the SGLang EP8 capture and the
  8-GPU launch, and show the commands it would run.
* The embedded default end to end (marked e2e): the demo model, real SpecForge 0.2.0 DFlash training on
  CPU, export, a second run that changes nothing, and a resume from the last checkpoint after a crash.
* Rolling offline on the same demo data (marked e2e): two rounds within a disk budget, killed in the
  second round and run again, ending with the offline run's weights bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from regen.training import rolling
from regen.training.capture import sample_path as capture_path
from tests.helpers.ansible import ansible_env, run_playbook

ROOT = Path(__file__).resolve().parents[2]
# The demo builder's cache (the demo_model_dir fixture's too): the demo model pre-trains once per session.
DEMO_CACHE = ROOT / ".cache" / "demo-models"
BIN = Path(sys.executable).parent


def _play(
    playbook: str, *args: str, inventory: str = "inventory/local", check: bool = True
) -> tuple[str, dict]:
    run = run_playbook(playbook, *args, inventory=inventory, timeout=900)
    if check:
        assert run.returncode == 0, run.output[-8000:]
    return run.output, run.recap


def _facts(model_dir: Path | None, config: dict, mask_id: int, gpus: int) -> dict:
    from ansible.module_utils import regen_config, regen_plan

    arch = regen_config.normalize_config(config)
    tokenizer = {"mask_token": {"id": mask_id, "reason": "test", "needs_new_token": False}}
    gpu = {"count": gpus}
    return {
        "schema_version": 1,
        "model_path": str(model_dir),
        "architecture": arch,
        "tokenizer": tokenizer,
        "environment": {"gpu": gpu, "python": {}},
        "plan": regen_plan.make_plan(arch, tokenizer, gpu),
    }


def test_production_launch_in_check_mode(tmp_path: Path) -> None:
    config = json.loads((ROOT / "tests/fixtures/drafter/targets/kimi-k2.6/config.json").read_text())
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    (artifacts / "model_facts.json").write_text(
        json.dumps(_facts(Path("/root/models/Kimi-K2.6"), config, 163838, 8))
    )
    output, recap = _play(
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
        f"regen_artifacts_dir={artifacts}",
        inventory="inventory/production.example",
    )
    assert set(recap) == {"ct200"} and recap["ct200"]["failed"] == recap["ct200"]["unreachable"] == 0
    flat = re.sub(r"\s+", " ", output)
    # SpecForge's published Kimi drafter: six draft layers reading six target layers.
    assert "target layers [1, 12, 24, 35, 47, 58] of 61" in flat
    assert "6 layers x 7168 hidden x 2 B (bfloat16) = 86016 B/token (84.0 KiB)" in flat
    assert "on 8 trainer process(es), node rank 0 of 1" in flat
    # The serving stage is stopped first: training and the SGLang capture need its GPUs.
    assert "TASK [sglang_server : Stop the server]" in output
    # Offline capture: SpecForge's SGLang capture across the 8 GPUs with EP8, its store on loopback.
    assert (
        "/root/venv_specforge/bin/python -m regen.training.rendezvous --host 127.0.0.1 --port 29500 "
        "--nproc 8 -- regen.training.capture --backend sglang"
    ) in flat
    assert "--layers 1,12,24,35,47,58" in flat and '{"ep_size": 8, "mem_fraction_static": 0.8}' in flat
    # One host: the ranks start through regen's rendezvous, the store on loopback at the plan's port.
    assert re.search(
        r"-- /root/venv_specforge/bin/python -m regen.training.rendezvous --host 127.0.0.1 --port 29500 "
        r"--nproc 8 -- specforge.cli train --config /root/regen/drafter/runs/dflash-\w+/run\.yaml "
        r"--node-rank 0",
        flat,
    )
    # The run config it would write: SpecForge's own topology keys, 8 trainer processes on one node.
    assert "+  mode: local_colocated" in output and "+    nproc_per_node: 8" in output
    assert "+  strategy: dflash" in output and "+  attention_backend: flex_attention" in output
    # Capture and training max_length are the plan's length budget: a plan without prompt statistics
    # assumes 2,048 prompt tokens + 1 turn x (4,096 max_tokens + 8 template tokens) = 6,152.
    assert "+  max_length: 6152" in output and "--max-length 6152" in flat
    assert "10.1.2.200" not in output


def test_production_rolling_in_check_mode(tmp_path: Path) -> None:
    """CT200 forced to rolling offline, in check mode: the play shows a round's capture (only the samples
    its round file lists, into the run's rolling directory) and its training (stopped at the round's last
    step, SpecForge told not to open the other rounds' placeholders), and writes nothing on the host."""
    config = json.loads((ROOT / "tests/fixtures/drafter/targets/kimi-k2.6/config.json").read_text())
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    (artifacts / "model_facts.json").write_text(
        json.dumps(_facts(Path("/root/models/Kimi-K2.6"), config, 163838, 8))
    )
    output, recap = _play(
        "playbooks/train.yml",
        "--check",
        "-e",
        "ansible_connection=local",
        "-e",
        f"ansible_python_interpreter={sys.executable}",
        "-e",
        f"regen_job_python={sys.executable}",
        "-e",
        f"regen_artifacts_dir={artifacts}",
        "-e",
        "drafter_training_topology=rolling",
        inventory="inventory/production.example",
    )
    assert recap["ct200"]["failed"] == 0
    flat = re.sub(r"\s+", " ", output)
    assert "topology: rolling offline requested in inventory" in flat
    assert re.search(
        r"regen\.training\.capture --backend sglang .* "
        r"--output /root/regen/drafter/hidden_states/rolling-\w+ .* "
        r"--only /root/regen/drafter/runs/dflash-\w+/rolling/round-000\.json",
        flat,
    )
    assert "SPECFORGE_VALIDATE_OFFLINE_FEATURES" not in flat  # SpecForge's own checks are not turned off
    assert "'training.max_steps=<last step of round 1>'" in flat
    assert "10.1.2.200" not in output


def _tokenized(model_dir: Path, out: Path, count: int) -> None:
    """Chat samples rendered with the demo model's own template; loss on the assistant reply."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    words = (ROOT / "src/regen/demo/corpus.txt").read_text().split()
    rng = random.Random(0)
    out.mkdir(parents=True)
    with (out / "part-00000.jsonl").open("w") as handle:
        for _ in range(count):
            user = " ".join(rng.choices(words, k=10))
            reply = " ".join(rng.choices(words, k=24))
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
            )
            prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
            reply_ids = tokenizer.encode(reply + "<|im_end|>", add_special_tokens=False)
            handle.write(
                json.dumps(
                    {
                        "input_ids": prompt_ids + reply_ids,
                        "loss_mask": [0] * len(prompt_ids) + [1] * len(reply_ids),
                    }
                )
                + "\n"
            )


class ListenerSampler:
    """Every TCP socket listening in a process whose command line names ``marker``, sampled while it runs."""

    def __init__(self, marker: str, interval: float = 0.1) -> None:
        self.marker, self.interval = marker, interval
        self.seen: set[tuple[str, int, str]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> ListenerSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            for proc in psutil.process_iter(["cmdline"]):
                try:
                    if self.marker not in " ".join(proc.info["cmdline"] or []):
                        continue
                    for conn in proc.net_connections("inet"):
                        if conn.status == psutil.CONN_LISTEN:
                            self.seen.add((conn.laddr.ip, conn.laddr.port, " ".join(proc.cmdline()[:4])))
                except (psutil.Error, OSError):
                    continue


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _steps(log: Path) -> dict[int, float]:
    from regen.training.status import parse_step_line

    found = {}
    for line in log.read_text().splitlines():
        parsed = parse_step_line(line)
        if parsed:
            found[parsed[0]] = parsed[1]["loss"]
    return found


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The train stage on the demo model, once per module: eight tokenized samples, one epoch, a checkpoint
    every 2 steps (the local inventory sizes the demo's recipe for the evaluate stage instead), offline.
    Its losses and final weights are kept aside as the one-round reference the rolling test compares to."""
    tmp = tmp_path_factory.mktemp("train")
    model = tmp / "work" / "models" / "demo"
    subprocess.run(
        [sys.executable, "-m", "regen.demo.build", "--output", str(model), "--cache-dir", str(DEMO_CACHE)],
        check=True,
        capture_output=True,
    )
    artifacts = tmp / "artifacts"
    artifacts.mkdir()
    config = json.loads((model / "config.json").read_text())
    (artifacts / "model_facts.json").write_text(json.dumps(_facts(model, config, 3845, 0)))
    _tokenized(model, tmp / "work" / "tokenized", 8)
    args = [
        "-e",
        f"regen_work_dir={tmp / 'work'}",
        "-e",
        f"regen_artifacts_dir={artifacts}",
        "-e",
        f"regen_model_path={model}",
        "-e",
        "drafter_training_epochs=1",
        "-e",
        "drafter_training_save_interval=2",
    ]
    # Every listener the trainer opens binds loopback, and the store is on the plan's port.
    port = _free_port()
    args += ["-e", f"drafter_training_master_port={port}"]
    with ListenerSampler(str(tmp / "work" / "drafter")) as listeners:
        output, recap = _play("playbooks/train.yml", *args)
    (run_dir,) = (tmp / "work" / "drafter" / "runs").iterdir()
    reference = tmp / "reference-step8.pt"
    shutil.copy(run_dir / "checkpoints" / f"{run_dir.name}-step8" / "training_state.pt", reference)
    return {
        "tmp": tmp,
        "args": args,
        "port": port,
        "output": output,
        "recap": recap,
        "listeners": listeners.seen,
        "run_dir": run_dir,
        "artifacts": artifacts,
        "losses": _steps(run_dir / "train.log"),
        "reference": reference,
    }


@pytest.mark.e2e
def test_local_cpu_training_end_to_end(demo_run: dict) -> None:
    args, port, output, first = demo_run["args"], demo_run["port"], demo_run["output"], demo_run["recap"]
    assert first["localhost"]["failed"] == 0
    listeners = demo_run["listeners"]
    assert listeners, "the trainer was never seen listening (the sampler missed the run?)"
    assert {ip for ip, _, _ in listeners} == {"127.0.0.1"}, listeners
    assert port in {p for _, p, _ in listeners}, listeners
    run_dir, artifacts = demo_run["run_dir"], demo_run["artifacts"]
    state = json.loads((run_dir / "status.json").read_text())
    assert state["state"] == "succeeded" and state["done"] == state["total"] == 8
    losses = _steps(run_dir / "train.log")
    assert sorted(losses) == list(range(1, 9))
    assert all(0 < loss < 20 for loss in losses.values())  # a real cross-entropy over a 4096-token vocabulary
    assert f"succeeded | step 8/8 | loss {losses[8]:.4f}" in output
    # Exported where SGLang's DFLASH loads it, with the flags next to it.
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    assert (
        exported["architectures"] == ["DFlashDraftModel"]
        and (run_dir / "export" / "model.safetensors").exists()
    )
    assert exported["dflash_config"]["target_layer_ids"] == [2]
    assert (run_dir / "sglang_dflash.args").read_text().split() == [
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(run_dir / "export"),
        "--speculative-num-draft-tokens",
        "16",
    ]
    published = artifacts / "drafter" / "localhost"
    assert {
        "draft_config.json",
        "run.yaml",
        "plan.json",
        "status.json",
        "checkpoints.json",
        "serve_with_drafter.sh",
    } <= {p.name for p in published.iterdir()}
    plan = json.loads((published / "plan.json").read_text())
    assert plan["hidden_states"]["bytes_per_token"] == 1 * 64 * 2

    again, second = _play("playbooks/train.yml", *args)
    blocks = re.split(r"^(?=TASK \[)", again, flags=re.M)
    changed = [b.splitlines()[0] for b in blocks if b.startswith("TASK") and "\nchanged:" in b]
    assert second["localhost"]["changed"] == 0, changed

    # A crash after the step-6 checkpoint: the last save never happened and the supervisor vanished.
    checkpoints = run_dir / "checkpoints"
    run_id = run_dir.name
    shutil.rmtree(checkpoints / f"{run_id}-step8")
    (checkpoints / f"{run_id}-latest").unlink()
    (checkpoints / f"{run_id}-latest").symlink_to(f"{run_id}-step6")
    state.update(state="running", pid=2**22 + 1, mode="process", launched_at=0)
    (run_dir / "status.json").write_text(json.dumps(state))
    shutil.rmtree(run_dir / "export")
    (run_dir / "train.log").rename(run_dir / "train.log.first")
    _play("playbooks/train.yml", *args)
    resumed = json.loads((run_dir / "status.json").read_text())
    assert resumed["state"] == "succeeded" and resumed["resume_from"].endswith(f"{run_id}-step6")
    again = _steps(run_dir / "train.log")
    # Only the lost steps ran again, and they reproduced the original run exactly.
    assert sorted(again) == [7, 8] and again == {7: losses[7], 8: losses[8]}
    assert (run_dir / "export" / "model.safetensors").exists()


def _step_lines(log: Path) -> list[tuple[int, float]]:
    """Every (step, loss) SpecForge logged, in order: a step a resume ran again appears twice."""
    from regen.training.status import parse_step_line

    found = []
    for line in log.read_text().splitlines():
        parsed = parse_step_line(line)
        if parsed:
            found.append((parsed[0], parsed[1]["loss"]))
    return found


def _wait_for(predicate, timeout: float, what: str, play: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        if play.poll() is not None:
            pytest.fail(f"the play ended (exit {play.returncode}) before {what}:\n{log.read_text()[-6000:]}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-6000:]}")


@pytest.mark.e2e
def test_rolling_training_gives_the_one_round_result(demo_run: dict) -> None:
    """Rolling offline on the demo, forced, with a disk budget that holds half the features: two rounds
    (capture 4 samples, train steps 1-4, empty them; capture the other 4, train steps 5-8 resuming the same
    SpecForge run). Killed (play and trainer, SIGKILL) in the middle of the second round's training and run
    again, it ends with the offline run's weights, bit for bit, every step's loss the same, and the budget
    never exceeded."""
    import torch

    tmp, budget = demo_run["tmp"], 80 * 1024
    args = [
        *demo_run["args"],
        "-e",
        "drafter_training_topology=rolling",
        "-e",
        f"drafter_training_hidden_states_max_bytes={budget}",
        # A detached supervisor (not a systemd unit), so the test knows what to kill.
        "-e",
        "drafter_training_launch_mode=process",
    ]
    runs = tmp / "work" / "drafter" / "runs"
    offline = demo_run["run_dir"]
    log = tmp / "rolling-play.log"
    with log.open("w") as out:
        play = subprocess.Popen(
            [str(BIN / "ansible-playbook"), "-i", "inventory/local", "playbooks/train.yml", *args],
            cwd=ROOT,
            env=ansible_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def second_round_training() -> dict | None:
            for status_file in runs.glob("*/status.json"):
                if status_file.parent == offline:
                    continue
                state = json.loads(status_file.read_text() or "{}")
                if state.get("round") == 1 and state.get("state") == "running" and state.get("done", 0) >= 5:
                    return state
            return None

        state = _wait_for(second_round_training, 600, "the second round's training", play, log)
        os.killpg(play.pid, signal.SIGKILL)
        os.killpg(int(state["pid"]), signal.SIGKILL)
    finally:
        if play.poll() is None:
            os.killpg(play.pid, signal.SIGKILL)
        play.wait()
    (run_dir,) = (p for p in runs.iterdir() if p != offline)
    ledger_path = run_dir / "rolling" / "ledger.json"
    ledger = json.loads(ledger_path.read_text())
    features = Path(ledger["features_dir"])
    rounds = [json.loads((ledger_path.parent / r["file"]).read_text()) for r in ledger["rounds"]]
    # The first round's features are gone (their names stay, empty), the second round's are on disk.
    assert [(r["first_step"], r["last_step"]) for r in rounds] == [(1, 4), (5, 8)]
    assert all(capture_path(features, i).stat().st_size == 0 for i in rounds[0]["indices"])
    assert all(capture_path(features, i).stat().st_size > 0 for i in rounds[1]["indices"])
    assert rolling.disk_usage(features) <= budget

    output, again = _play("playbooks/train.yml", *args)
    assert again["localhost"]["failed"] == 0
    ledger = json.loads(ledger_path.read_text())
    assert ledger["finished"] and len(ledger["rounds"]) == 2 and not features.exists()
    # The budget held: the features on disk after each round's capture, and their peak.
    captured = [ledger["records"][str(r)]["captured_bytes"] for r in range(2)]
    assert 0 < max(captured) == ledger["peak_bytes"] <= budget == ledger["budget_bytes"]
    assert "rolling: all 2 rounds trained (step 8/8)" in output
    # The same SpecForge run: round 2 resumed from round 1's last checkpoint (or the trainer's own
    # mid-round one after the kill), with the run's horizon and the round's stop on its command line.
    resumed = json.loads((run_dir / "status.json").read_text())
    assert (
        resumed["state"] == "succeeded" and resumed["round"] == 1 and resumed["done"] == resumed["total"] == 8
    )
    assert "training.max_steps=8" in resumed["command"] and resumed["resume_from"]
    assert "total_steps: 8" in (run_dir / "run.yaml").read_text()
    # Same losses at every step (the steps the kill made the trainer run again included) ...
    lines = _step_lines(run_dir / "train.log")
    assert {step for step, _ in lines} == set(range(1, 9)) and len(lines) > 8
    assert all(loss == demo_run["losses"][step] for step, loss in lines), (lines, demo_run["losses"])
    # ... and the same weights as the one-round (offline) run, bit for bit.
    ours = torch.load(
        run_dir / "checkpoints" / f"{run_dir.name}-step8" / "training_state.pt", weights_only=False
    )
    theirs = torch.load(demo_run["reference"], weights_only=False)
    assert ours["draft_state_dict"].keys() == theirs["draft_state_dict"].keys()
    for name, tensor in theirs["draft_state_dict"].items():
        assert torch.equal(ours["draft_state_dict"][name], tensor), name
    assert (run_dir / "export" / "model.safetensors").exists()
    assert (demo_run["artifacts"] / "drafter" / "localhost" / "rolling_ledger.json").exists()

    _, third = _play("playbooks/train.yml", *args)
    assert third["localhost"]["changed"] == 0
