"""module_utils/regen_serving.py: bad plans fail with the variable to fix; quoting for systemd and shells."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "serving"

from ansible.module_utils import regen_serving as rs
from ansible.module_utils.regen_serving import ServingPlanError

from tests.helpers.modules import run_module

KIMI = json.loads((FIXTURES / "facts-kimi-k2.6.json").read_text())
QWEN = json.loads((FIXTURES / "facts-qwen3-8b.json").read_text())


def _spec(**kw):
    base = {"backend": "sglang", "model_path": "/models/Kimi-K2.6", "python": "/venv/bin/python",
            "facts": KIMI, "gpu_count": 8}
    base.update(kw)
    return base


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (_spec(gpu_count=4), "needs 8 GPUs per node"),
        (_spec(overrides={"ep_size": 3}), "ep_size 3 does not divide the 8 GPUs"),
        (_spec(overrides={"attn_dp_size": 3}), "attn_dp_size 3 does not divide tp_size 8"),
        (_spec(overrides={"dp_size": 2, "attn_dp_size": 2}), "cannot both be above 1"),
        (_spec(overrides={"dp_size": 2}), "needs 16 GPUs per node"),
        (_spec(host="0.0.0.0"), "no API key is set"),
        (_spec(host="10.1.2.200"), "sglang_server_api_key"),
        (_spec(api_key_set=True), "no secret_config_path"),
        (_spec(overrides={"moe_a2a_backend": "magic"}), "not one of SGLang 0.5.23's choices"),
        (_spec(overrides={"ep_size": 1, "moe_a2a_backend": "deepep"}), "needs expert parallelism"),
        (_spec(overrides={"mem_fraction_static": 1.5}), "between 0 and 1"),
        (_spec(overrides={"kv_cache_dtype": "int8"}), "--kv-cache-dtype choices"),
        (_spec(extra_args=["--kv-cache-dtype", "fp8_e4m3"]), "set sglang_server_kv_cache_dtype instead"),
        (_spec(overrides={"tp_size": "eight"}), "tp_size must be an integer"),
        (_spec(nnodes=2, node_rank=0, overrides={"tp_size": 16, "ep_size": 16}), "dist_init_addr"),
        (_spec(nnodes=2, node_rank=2), "outside 0..1"),
        (_spec(nnodes=3, overrides={"tp_size": 16}), "cannot be split evenly over 3 nodes"),
        (_spec(extra_args=["--tp-size", "4"]), "set sglang_server_tp_size instead"),
        (_spec(extra_args=["--api-key=x"]), "sglang_server_api_key"),
        (_spec(extra_args="--foo"), "list of strings"),
        (_spec(port=70000), "1..65535"),
        (_spec(backend="vllm"), "sglang, transformers"),
        (_spec(model_path=""), "sglang_server_model_path is empty"),
        (_spec(backend="transformers", host="10.0.3.17"), "but no API key is set"),
        (_spec(backend="transformers", overrides={"tp_size": 2}), "needs the sglang backend"),
    ],
)
def test_bad_plans_fail_with_the_fix(spec, needle):
    with pytest.raises(ServingPlanError) as err:
        rs.plan_server(spec)
    assert needle in str(err.value)


def test_inventory_overrides_beat_the_plan_and_say_so():
    plan = rs.plan_server(_spec(overrides={"tp_size": 4, "ep_size": 4, "reasoning_parser": ""}, gpu_count=8))
    assert plan["settings"]["tp_size"] == {"value": 4, "source": "override",
                                           "reason": "set in inventory (sglang_server_tp_size)"}
    assert "--reasoning-parser" not in plan["argv"]  # "" switches the parser off
    assert "using 4 of the 8 visible GPUs" in plan["warnings"]


def test_a_planned_null_parser_is_a_decision_not_a_gap():
    facts = json.loads(json.dumps(KIMI))
    facts["plan"]["generation"]["reasoning_parser"] = {"value": None, "reason": "no think tokens"}
    plan = rs.plan_server(_spec(facts=facts))
    assert "--reasoning-parser" not in plan["argv"]
    assert plan["settings"]["reasoning_parser"]["source"] == "plan"


def test_without_facts_the_role_falls_back_to_gpus_and_model_type():
    plan = rs.plan_server(_spec(facts={}, gpu_count=2))
    argv = plan["argv"]
    assert argv[argv.index("--tp-size") + 1] == "2"
    assert "--ep-size" not in argv  # no facts: nothing says it is MoE
    assert plan["settings"]["tp_size"]["source"] == "default"
    facts = {"architecture": {"model_type": "kimi_k25", "moe": {"routed_experts": 8}}}
    typed = rs.plan_server(_spec(facts=facts, gpu_count=2))
    assert typed["argv"][typed["argv"].index("--ep-size") + 1] == "2"
    assert typed["argv"][typed["argv"].index("--reasoning-parser") + 1] == "kimi_k2"


def test_sglang_on_cpu_needs_no_gpu():
    facts = json.loads(json.dumps(QWEN))
    facts["plan"]["serving"]["device"] = {"value": "cpu", "reason": "no NVIDIA GPU found"}
    plan = rs.plan_server(_spec(facts=facts, gpu_count=0))
    assert plan["argv"][plan["argv"].index("--device") + 1] == "cpu"
    assert plan["gpus_per_node"] == 0


def test_transformers_backend_line():
    plan = rs.plan_server(_spec(backend="transformers", model_path="/m/demo", python="/v/bin/python",
                                port=8123))
    assert plan["argv"] == ["/v/bin/python", "-m", "regen.serving.transformers_serve", "serve", "/m/demo",
                            "--trust-remote-code", "--device", "cpu", "--host", "127.0.0.1", "--port", "8123"]
    assert plan["readiness"]["path"] == "/v1/models"
    assert plan["endpoint"] == "http://127.0.0.1:8123" and plan["api_base"] == "http://127.0.0.1:8123/v1"


def test_transformers_backend_binds_a_cluster_address_with_a_key():
    """With an API key the CPU server may listen where a generation host elsewhere reaches it; the key
    travels in the environment file (the launcher reads it), never on the command line."""
    plan = rs.plan_server(_spec(backend="transformers", model_path="/m/demo", python="/v/bin/python",
                                host="10.0.3.17", port=8123, api_key_set=True))
    assert plan["argv"][-4:] == ["--host", "10.0.3.17", "--port", "8123"]
    assert plan["endpoint"] == "http://10.0.3.17:8123"
    assert not any("key" in arg.lower() for arg in plan["argv"])


def test_gpu_ids_pin_cuda_visible_devices_and_env_is_redacted_for_records():
    plan = rs.plan_server(_spec(gpu_ids=[4, 5, 6, 7], gpu_count=4, overrides={"tp_size": 4, "ep_size": 4},
                                env={"HF_TOKEN": "hf_secret", "NCCL_P2P_LEVEL": "SYS"}))
    assert plan["env"]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert plan["env_redacted"]["HF_TOKEN"] == "<redacted>"
    assert plan["env_redacted"]["NCCL_P2P_LEVEL"] == "SYS"


def _with_gpu(**gpu):
    facts = json.loads(json.dumps(KIMI))
    facts["environment"]["gpu"].update(gpu)
    return facts


def test_nccl_p2p_is_disabled_only_for_several_pcie_blackwell_gpus():
    assert rs.plan_server(_spec())["env"]["NCCL_P2P_DISABLE"] == "1"  # 8x sm_120 on PCIe (the fixture)
    nvlink = rs.plan_server(_spec(facts=_with_gpu(interconnect="nvlink")))
    assert "NCCL_P2P_DISABLE" not in nvlink["env"] and nvlink["env"]["TORCH_CUDA_ARCH_LIST"] == "12.0"
    hopper = rs.plan_server(_spec(facts=_with_gpu(compute_capabilities=["9.0"])))
    assert "NCCL_P2P_DISABLE" not in hopper["env"]
    single = rs.plan_server(_spec(gpu_count=1, overrides={"tp_size": 1, "ep_size": 1}))
    assert "NCCL_P2P_DISABLE" not in single["env"]
    verified = rs.plan_server(_spec(pcie_blackwell_env={}))
    assert "NCCL_P2P_DISABLE" not in verified["env"]
    inventory_wins = rs.plan_server(_spec(env={"NCCL_P2P_DISABLE": "0", "TORCH_CUDA_ARCH_LIST": "12.0a"}))
    assert inventory_wins["env"]["NCCL_P2P_DISABLE"] == "0"
    assert inventory_wins["env"]["TORCH_CUDA_ARCH_LIST"] == "12.0a"


def _measured(p2p: bool, on: float, off: float) -> dict:
    env = {} if p2p else {"NCCL_P2P_DISABLE": "1"}
    return {"measured": True, "p2p": p2p, "env": env, "reason": f"{on} GB/s with P2P, {off} GB/s without",
            "busbw_gbps": {"p2p_on": on, "p2p_off": off}, "world_size": 8}


def test_a_p2p_measurement_decides_nccl_p2p_instead_of_the_blackwell_default():
    works = rs.plan_server(_spec(facts=_with_gpu(nccl_p2p=_measured(True, 41.2, 18.9))))
    assert "NCCL_P2P_DISABLE" not in works["env"]
    assert "measured at provision time: 41.2 GB/s" in works["settings"]["nccl_env"]["reason"]
    hangs = rs.plan_server(_spec(facts=_with_gpu(nccl_p2p=_measured(False, 0.0, 18.9))))
    assert hangs["env"]["NCCL_P2P_DISABLE"] == "1"
    stale = {"measured": False, "reason": "measured on other GPUs or another driver"}
    unmeasured = rs.plan_server(_spec(facts=_with_gpu(nccl_p2p=stale)))
    assert unmeasured["env"]["NCCL_P2P_DISABLE"] == "1"  # the PCIe Blackwell default, and it says why
    assert "other GPUs or another driver" in unmeasured["settings"]["nccl_env"]["reason"]
    # The inventory's own environment still wins over a measurement.
    forced = rs.plan_server(_spec(facts=_with_gpu(nccl_p2p=_measured(True, 41.2, 18.9)),
                                  env={"NCCL_P2P_DISABLE": "1"}))
    assert forced["env"]["NCCL_P2P_DISABLE"] == "1"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "::1", "localhost"])
def test_loopback_addresses(host):
    assert rs.is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.200", "ct200"])
def test_reachable_addresses(host):
    assert not rs.is_loopback(host)


def test_router_rejects_bad_input():
    with pytest.raises(ServingPlanError, match="at least one worker"):
        rs.plan_router({"python": "/p", "worker_urls": []})
    with pytest.raises(ServingPlanError, match="not of the form"):
        rs.plan_router({"python": "/p", "worker_urls": ["10.0.0.1:30000"]})
    with pytest.raises(ServingPlanError, match="repeat"):
        rs.plan_router({"python": "/p", "worker_urls": ["http://a:1", "http://a:1"]})
    with pytest.raises(ServingPlanError, match="cache_aware"):
        rs.plan_router({"python": "/p", "worker_urls": ["http://a:1"], "policy": "fastest"})
    with pytest.raises(ServingPlanError, match="no API key"):
        rs.plan_router({"python": "/p", "worker_urls": ["http://a:1"], "host": "0.0.0.0"})


def test_shell_join_round_trips_through_a_posix_shell():
    argv = ["/v/bin/python", "-m", "x", "--name", "two words", "it's", "", "${REGEN_SERVING_API_KEY}", "a=b"]
    line = rs.shell_join(argv)
    assert shlex.split(line) == argv
    assert "${REGEN_SERVING_API_KEY}" in line  # left for the shell to expand


def _systemd_split(line):
    """The inverse of systemd's ExecStart quoting for the cases we emit (quotes, \\ escapes, $$, %%)."""
    words, word, quoted, i, started = [], "", False, 0, False
    while i < len(line):
        c = line[i]
        if c == "\\" and quoted:
            word += line[i + 1]
            i += 2
            continue
        if c == '"':
            quoted, started = not quoted, True
        elif c == " " and not quoted:
            if started or word:
                words.append(word)
            word, started = "", False
        else:
            word += c
            started = True
        i += 1
    if started or word:
        words.append(word)
    return [w.replace("$$", "$").replace("%%", "%") for w in words]


def test_systemd_exec_escapes_specifiers_dollars_and_spaces():
    argv = ["/v/bin/python", "-m", "x", "--p", "50%", "--cost", "$5", "--name", 'two "quoted" words',
            "--api-key", "${REGEN_SERVING_API_KEY}", "C:\\path"]
    line = rs.systemd_exec(argv)
    assert "50%%" in line and "$$5" in line
    assert " ${REGEN_SERVING_API_KEY} " in line  # the only word systemd may expand
    assert _systemd_split(line) == argv


def test_systemd_env_line():
    assert rs.systemd_env_line("NCCL_P2P_LEVEL", "SYS") == '"NCCL_P2P_LEVEL=SYS"'
    assert rs.systemd_env_line("X", 'a "b" 5%') == '"X=a \\"b\\" 5%%"'
    with pytest.raises(ServingPlanError):
        rs.systemd_env_line("BAD-NAME", "1")


# --- the module wrapper (library/serving_launch_info.py) ------------------------------------------


def _run_module(args: dict, capsys: pytest.CaptureFixture[str]) -> dict:
    return run_module("serving_launch_info", args, capsys)


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def test_module_plans_reads_only_and_never_returns_the_key(tmp_path, capsys):
    model = _model_dir(tmp_path)
    args = {"backend": "sglang", "model_path": str(model), "python": "/v/bin/python", "facts": KIMI,
            "gpu_count": 8, "host": "0.0.0.0", "api_key": "sekrit-xyz",
            "secret_config_path": str(tmp_path / "main.secret.yaml"), "_ansible_check_mode": True}
    result = _run_module(args, capsys)
    assert result["changed"] is False and not result.get("failed")
    assert "sekrit-xyz" not in json.dumps(result)
    assert result["plan"]["argv"][-2:] == ["--config", str(tmp_path / "main.secret.yaml")]
    assert result["exec_start"].startswith("/v/bin/python -m sglang.launch_server --model-path ")
    assert '"HF_HUB_OFFLINE=1"' in result["environment_lines"]
    assert result["gpu_count"] == 8 and result["gpu_count_source"] == "inventory"
    # The port is probed once, by the supervisor on the host (regen.procs.port_free), never by the plan.
    assert "port_in_use" not in result


def test_module_fails_on_a_missing_model_dir_and_on_a_bad_plan(tmp_path, capsys):
    result = _run_module({"model_path": str(tmp_path / "nope"), "python": "/p", "gpu_count": 8}, capsys)
    assert result["failed"] and "does not exist on this host" in result["msg"]
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _run_module({"model_path": str(empty), "python": "/p", "gpu_count": 8}, capsys)
    assert result["failed"] and "has no config.json" in result["msg"]
    args = {"model_path": str(_model_dir(tmp_path)), "python": "/p", "facts": KIMI, "gpu_count": 4}
    result = _run_module(args, capsys)
    assert result["failed"] and "needs 8 GPUs per node" in result["msg"] and "has 4 visible" in result["msg"]


def test_module_counts_no_gpu_without_nvidia_smi(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi on this PATH: a CPU host
    result = _run_module({"model_path": str(_model_dir(tmp_path)), "python": "/p", "facts": KIMI}, capsys)
    assert result["failed"] and "has 0 visible" in result["msg"]
    assert result["gpu_count_source"] == "nvidia-smi not found"


# --- attention backend on the launch line


def _flag(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


def _with_backend(entry):
    facts = json.loads(json.dumps(KIMI))
    facts["plan"]["serving"]["attention_backend"] = entry
    return facts


def test_the_plans_attention_backend_is_on_the_launch_line():
    plan = rs.plan_server(_spec(facts=_with_backend({"value": "flashinfer", "reason": "row sm120-mla"})))
    assert _flag(plan["argv"], "--attention-backend") == "flashinfer"
    assert plan["settings"]["attention_backend"] == {
        "value": "flashinfer", "source": "plan", "reason": "row sm120-mla"
    }


def test_a_planned_null_leaves_the_flag_off():
    plan = rs.plan_server(_spec(facts=_with_backend({"value": None, "reason": "compute capability unknown"})))
    assert "--attention-backend" not in plan["argv"]
    assert plan["settings"]["attention_backend"]["reason"] == "compute capability unknown"


def test_facts_without_a_planned_backend_take_the_table():
    # Facts written before the plan named a backend: the table over the facts' attention kind and GPU.
    facts = json.loads(json.dumps(KIMI))
    del facts["plan"]["serving"]["attention_backend"]
    assert facts["architecture"]["attention"]["kind"] == "mla"
    plan = rs.plan_server(_spec(facts=facts))
    assert _flag(plan["argv"], "--attention-backend") == "flashinfer"
    assert plan["settings"]["attention_backend"]["source"] == "default"
    assert "sm120-mla" in plan["settings"]["attention_backend"]["reason"]


def test_inventory_attention_backend_wins_and_warns_where_the_table_advises_against_it():
    facts = _with_backend({"value": "flashinfer", "reason": "row sm120-mla"})
    facts["architecture"]["attention"] = {"kind": "mla"}
    plan = rs.plan_server(_spec(facts=facts, overrides={"attention_backend": "trtllm_mla"}))
    assert _flag(plan["argv"], "--attention-backend") == "trtllm_mla"
    assert plan["settings"]["attention_backend"]["source"] == "override"
    assert any("Unsupported architecture" in w for w in plan["warnings"])


def test_an_unknown_attention_backend_is_refused_with_the_variable():
    with pytest.raises(ServingPlanError, match="sglang_server_attention_backend"):
        rs.plan_server(_spec(overrides={"attention_backend": "magic_mla"}))


def test_cpu_serving_names_no_attention_backend():
    plan = rs.plan_server(_spec(gpu_count=0, overrides={"device": "cpu", "tp_size": 1, "ep_size": 1}))
    assert "--attention-backend" not in plan["argv"]


def test_a_context_length_of_its_own_is_reported_as_overriding_the_length_budget():
    # The Kimi facts with the plan's length section and serving context length a budgeted plan carries.
    facts = json.loads(json.dumps(KIMI))
    facts["plan"]["length"] = {"budget": {"value": 5934, "reason": "longest conversation: ..."}}
    facts["plan"]["serving"]["context_length"] = {"value": 5934, "reason": "the length budget"}
    planned = rs.plan_server(_spec(facts=facts))
    assert planned["argv"][planned["argv"].index("--context-length") + 1] == "5934"
    assert planned["settings"]["context_length"]["source"] == "plan"
    assert not any("overrides the plan's length budget" in w for w in planned["warnings"])
    own = rs.plan_server(_spec(facts=facts, overrides={"context_length": 32768}))
    assert own["argv"][own["argv"].index("--context-length") + 1] == "32768"
    note = "sglang_server_context_length=32768 overrides the plan's length budget of 5934 tokens"
    assert note in own["settings"]["context_length"]["reason"] and any(note in w for w in own["warnings"])


def test_the_planned_kv_cache_dtype_reaches_the_line_and_an_empty_override_keeps_the_plan():
    facts = json.loads(json.dumps(KIMI))
    facts["plan"]["serving"]["kv_cache_dtype"] = {"value": "fp8_e4m3", "reason": "declared by the checkpoint"}
    argv = rs.plan_server(_spec(facts=facts))["argv"]
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert "--kv-cache-dtype" not in rs.plan_server(_spec())["argv"]  # facts from before: SGLang's auto


# --- the router's interpreter


def _router_args(python: str) -> dict:
    return {"kind": "router", "python": python, "worker_urls": ["http://10.0.0.1:30000", "http://10.0.0.2:30000"],
            "host": "10.0.0.1", "api_key": "router-key-5e1f"}


def test_a_router_python_without_sglang_router_is_refused_naming_the_variable(tmp_path, capsys):
    # This interpreter (the controller's venv) has no sglang_router, as a serving venv from an older lock.
    result = _run_module(_router_args(sys.executable), capsys)
    assert result["failed"] and "cannot import sglang_router" in result["msg"]
    assert "sglang_server_router_python" in result["msg"] and "envs/serving.lock" in result["msg"]


def test_a_router_python_that_does_not_exist_fails_except_in_check_mode(tmp_path, capsys):
    missing = str(tmp_path / "venv" / "bin" / "python")
    result = _run_module(_router_args(missing), capsys)
    assert result["failed"] and "does not exist on this host" in result["msg"]
    result = _run_module({**_router_args(missing), "_ansible_check_mode": True}, capsys)
    assert not result.get("failed") and result["router_python"].startswith("not checked")
    assert result["plan"]["argv"][0] == missing


def test_a_router_python_with_sglang_router_plans(tmp_path, capsys):
    # A stand-in interpreter whose sglang_router imports (fault-injection stub: a package of that name).
    package = tmp_path / "site" / "sglang_router"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    result = _run_module(_router_args(str(python)), capsys)
    assert not result.get("failed"), result
    assert result["router_python"] == "imports sglang_router"
