"""The online (disaggregated) run config for Kimi K2.6, as the train stage renders it, against SpecForge.

The config comes out of the drafter planning module (library/drafter_plan_info.py, run in-process as on a
host) for the topology the plan chooses online for: a capture host with the 8 GPUs the target needs beside
a training host with 8 more. SpecForge then judges it twice, in its own venv: `regen.training.validate`
(its `load_config`, `resolve_run`, `build_launch_plan`) and the real `specforge train --config ... --plan`
command, which resolves the producer/consumer topology without starting anything.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible.module_utils import regen_config

from tests.helpers.modules import run_module
from tests.helpers.specforge_venv import specforge_python

ROOT = Path(__file__).resolve().parents[2]
KIMI = json.loads(
    (ROOT / "tests" / "fixtures" / "drafter" / "targets" / "kimi-k2.6" / "config.json").read_text()
)
# RTX PRO 6000 Blackwell Server Edition (the recorded nvidia-smi fixture).
GPU_BYTES = 97887 * 1024 * 1024


def _plan(tmp_path: Path, capsys, **online) -> dict:
    facts = {
        "architecture": regen_config.normalize_config(KIMI),
        "tokenizer": {"mask_token": {"id": 163838}},
        "environment": {"gpu": {"count": 8, "memory_per_gpu_bytes": GPU_BYTES}},
        "plan_values": {"serving": {"tp_size": 8, "ep_size": 8, "pp_size": 1}},
    }
    args = {
        "facts": facts,
        "model_path": "/root/models/Kimi-K2.6",
        "require_model": False,
        "embedding_key": "language_model.model.embed_tokens.weight",
        "lm_head_key": "language_model.lm_head.weight",
        "hidden_states_dir": str(tmp_path / "hidden_states"),
        "samples": 100_000,
        "tokens": 400_000_000,
        "hosts": ["train1"],
        "host": "train1",
        "gpus_per_host": 8,
        "capture_hosts": ["capture1"],
        "training_topology": "online",
        "work_dir": str(tmp_path / "drafter"),
        "max_length": 6152,
        "chat_template": "kimi-k2-thinking",
        "recipe": {
            "learning_rate": 6e-4,
            "attention_backend": "flex_attention",
            "fsdp_sharding": "SHARD_GRAD_OP",
            "save_interval": 1000,
            "log_interval": 50,
        },
        "online": {
            "manage": True,
            "bind_address": "10.1.2.201",
            "addresses": {"capture1": "10.1.2.202"},
            "rpc_port": 50051,
            "metadata_port": 8080,
            "capture_port": 30200,
            "segment_bytes": 32 << 30,
            "transfer_ports": [15000, 17000],
            **online,
        },
    }
    return run_module("drafter_plan_info", args, capsys)


def _specforge(*args: str) -> subprocess.CompletedProcess:
    python = specforge_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISAGG_", "MOONCAKE_"))}
    env["PYTHONPATH"] = str(ROOT / "src")
    return subprocess.run(
        [str(python.parent / "specforge"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


def test_kimi_online_config_passes_specforges_loader_and_plan(tmp_path: Path, capsys) -> None:
    plan = _plan(tmp_path, capsys)
    assert not plan.get("failed"), plan
    assert plan["training_topology"]["mode"] == "online" and plan["hidden_states"]["mode"] == "online"
    online = plan["online"]
    run_dir = plan["paths"]["run_dir"]
    assert online["attempt"] == 1 and online["server_urls"] == ["http://10.1.2.202:30200"]
    (server,) = online["capture_servers"]
    assert server["environment"]["MOONCAKE_MASTER_SERVER_ADDR"] == "10.1.2.201:50051"
    # The capture server's segment is on its own host, where the trainer's transfer engine reads it.
    assert server["environment"]["MOONCAKE_LOCAL_HOSTNAME"] == "10.1.2.202"
    # Every Mooncake client (capture server, producer, consumer) listens on the one named port range.
    environment = server["environment"]
    assert (environment["MC_MIN_RPC_PORT"], environment["MC_MAX_RPC_PORT"]) == ("15000", "17000")
    assert online["transfer_env_args"] == ["--env", "MC_MIN_RPC_PORT=15000", "--env", "MC_MAX_RPC_PORT=17000"]
    # Only whole optimizer windows: 100,000 prompts over 8 trainer ranks.
    assert plan["total_steps"] == 12_500 and plan["topology"]["nproc_per_node"] == 8
    config = plan["run_config"]
    disaggregated = config["deployment"]["disaggregated"]
    assert disaggregated["control_dir"] == f"{run_dir}/online/attempt-1/control"
    assert disaggregated["consumer_state_dir"] == f"{run_dir}/online/attempt-1/consumer-state"
    assert config["data"]["prompts_path"] == plan["paths"]["prompts"]
    assert config["runtime"] == online["runtime"]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))

    checked = subprocess.run(
        [str(specforge_python()), "-m", "regen.training.validate", "--run-config", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr[-3000:]
    result = json.loads(checked.stdout)["run"]
    assert (result["mode"], result["deployment"], result["strategy"]) == ("online", "disaggregated", "dflash")

    planned = _specforge("train", "--config", str(path), "--plan")
    assert planned.returncode == 0, planned.stderr[-3000:]
    launch = json.loads(planned.stdout)
    assert (launch["kind"], launch["role"]) == ("supervisor", "both")
    producer, consumer = launch["commands"]
    assert producer["label"] == "producer" and producer["argv"][-2:] == ["--role", "producer"]
    # The consumer: torchrun on the training host's 8 GPUs, SpecForge's own module entry.
    argv = consumer["argv"]
    assert argv[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "8"]
    assert argv[-2:] == ["--role", "consumer"]
    for env in (producer["env"], consumer["env"]):
        assert env["DISAGG_BACKEND"] == "mooncake" and env["DISAGG_STORE_ID"] == plan["run_id"]
        assert env["DISAGG_REF_CHANNEL"] == f"{run_dir}/online/attempt-1/control/refs.jsonl"
        assert env["DISAGG_DB"] == f"{run_dir}/online/attempt-1/consumer-state/consumer.sqlite"
        assert env["MOONCAKE_MASTER_SERVER_ADDR"] == "10.1.2.201:50051"
        assert env["MOONCAKE_METADATA_SERVER"] == "http://10.1.2.201:8080/metadata"
        # Server-owned online capture: SpecForge's roles hold no segment of their own.
        assert env["DISAGG_CLIENT_SEGMENT_SIZE"] == "0"


def test_specforge_refuses_what_it_does_not_know(tmp_path: Path, capsys) -> None:
    # Without this the test above could pass against a loader that accepts anything.
    plan = _plan(tmp_path, capsys)
    config = plan["run_config"]
    config["deployment"]["disaggregated"]["server_url"] = "http://10.1.2.202:30200"
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    planned = _specforge("train", "--config", str(path), "--plan")
    assert planned.returncode != 0 and "server_url" in planned.stderr


def test_a_loopback_stack_across_hosts_is_refused(tmp_path: Path, capsys) -> None:
    plan = _plan(tmp_path, capsys, bind_address="127.0.0.1")
    assert plan["failed"] and "which no other host reaches" in plan["msg"]


def test_a_segment_too_small_for_one_step_is_refused(tmp_path: Path, capsys) -> None:
    plan = _plan(tmp_path, capsys, segment_bytes=1 << 30)
    assert plan["failed"] and "drafter_training_online_segment_bytes" in plan["msg"]


@pytest.mark.parametrize("ports", [None, [15000], [17000, 15000], [80, 90], ["a", "b"]])
def test_a_transfer_port_range_that_is_not_one_is_refused_naming_the_variable(
    tmp_path: Path, capsys, ports
) -> None:
    plan = _plan(tmp_path, capsys, transfer_ports=ports)
    assert plan["failed"] and "drafter_training_online_mooncake_transfer_ports" in plan["msg"], plan
