"""One NCCL decision for every multi-GPU process the pipeline starts: server, capture server, trainer.

`regen_gpu.nccl_decision` turns the GPU facts (with the provision-time P2P measurement when there is one)
into the environment; the serving launch line, the capture server's environment and the trainer's launch
(`drafter_plan_info`'s `nccl.env_args`, passed to regen.training.launcher as --env) all read it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ansible.module_utils import regen_config
from ansible.module_utils.regen_gpu import nccl_decision

from tests.helpers.modules import run_module

ROOT = Path(__file__).resolve().parents[2]
KIMI = json.loads((ROOT / "tests" / "fixtures" / "configs" / "kimi-k2.6-nvfp4" / "config.json").read_text())
GPU_BYTES = 97887 * 1024 * 1024
# What regen.serving.p2p_probe recorded and gpu_info turned into facts: P2P measured off (a hang/slow path).
MEASURED_OFF = {"measured": True, "p2p": False, "env": {"NCCL_P2P_DISABLE": "1"},
                "reason": "P2P on: all-reduce timed out after 60 s; P2P off: 21.3 GB/s busbw"}


def _gpu(**extra):
    return {"count": 8, "memory_per_gpu_bytes": GPU_BYTES, "compute_capabilities": ["12.0"], **extra}


def test_the_measurement_wins_and_one_process_needs_nothing():
    env, reason, source = nccl_decision(_gpu(nccl_p2p=MEASURED_OFF), 8, "the trainer")
    assert env == {"NCCL_P2P_DISABLE": "1"} and source == "measured" and "timed out" in reason
    measured_on = dict(MEASURED_OFF, p2p=True, env={}, reason="P2P on: 48 GB/s; off: 21 GB/s")
    assert nccl_decision(_gpu(nccl_p2p=measured_on, interconnect="pcie"), 8)[0] == {}
    assert nccl_decision(_gpu(nccl_p2p=MEASURED_OFF), 1)[0] == {}


def test_without_a_measurement_pcie_sm120_defaults_to_no_p2p_and_others_keep_nccls_defaults():
    env, reason, source = nccl_decision(_gpu(interconnect="pcie"), 8)
    assert env == {"NCCL_P2P_DISABLE": "1"} and source == "default" and "nccl#1999" in reason
    assert nccl_decision(_gpu(interconnect="pcie"), 8, default_env={})[0] == {}  # the role's opt-out
    env, reason, _ = nccl_decision(_gpu(), 8)  # described GPUs: interconnect unknown
    assert env == {} and "no NVLink" in reason
    hopper = dict(_gpu(interconnect="nvlink"), compute_capabilities=["9.0"])
    assert nccl_decision(hopper, 8)[0] == {}


def test_the_trainer_and_the_capture_server_get_the_measured_decision(tmp_path: Path, capsys) -> None:
    facts = {
        "architecture": regen_config.normalize_config(KIMI),
        "tokenizer": {"mask_token": {"id": 163838}},
        "environment": {"gpu": _gpu(nccl_p2p=MEASURED_OFF)},
        "plan_values": {"serving": {"tp_size": 8, "ep_size": 8, "pp_size": 1}},
    }
    args = {
        "facts": facts, "model_path": "/root/models/Kimi-K2.6", "require_model": False,
        "embedding_key": "language_model.model.embed_tokens.weight",
        "lm_head_key": "language_model.lm_head.weight",
        "hidden_states_dir": str(tmp_path / "hidden_states"), "samples": 100_000, "tokens": 400_000_000,
        "hosts": ["train1"], "host": "train1", "gpus_per_host": 8, "capture_hosts": ["capture1"],
        "training_topology": "online", "work_dir": str(tmp_path / "drafter"), "max_length": 6152,
        "chat_template": "kimi-k2-thinking",
        "recipe": {"learning_rate": 6e-4, "attention_backend": "flex_attention",
                   "fsdp_sharding": "SHARD_GRAD_OP", "save_interval": 1000, "log_interval": 50},
        "online": {"manage": True, "bind_address": "10.1.2.201", "addresses": {"capture1": "10.1.2.202"},
                   "rpc_port": 50051, "metadata_port": 8080, "capture_port": 30200,
                   "segment_bytes": 32 << 30, "transfer_ports": [15000, 17000]},
    }
    plan = run_module("drafter_plan_info", args, capsys)
    assert not plan.get("failed"), plan
    assert plan["nccl"]["env"] == {"NCCL_P2P_DISABLE": "1"}
    assert plan["nccl"]["env_args"] == ["--env", "NCCL_P2P_DISABLE=1"]
    assert "FSDP trainer" in plan["nccl"]["reason"] and "measured at provision time" in plan["nccl"]["reason"]
    (server,) = plan["online"]["capture_servers"]
    assert server["environment"]["NCCL_P2P_DISABLE"] == "1"
    assert server["environment"]["MOONCAKE_MASTER_SERVER_ADDR"] == "10.1.2.201:50051"
