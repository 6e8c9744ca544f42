"""Launch-line planning for the model server (SGLang or `transformers serve`) and its router.

Standard library only and free of I/O: `plan_server` turns the model facts, the introspection plan and
the inventory overrides into the exact argv, environment and endpoint of one server; `plan_router`
does the same for an `sglang-router` in front of several servers. Every derived value carries where it
came from (`override`, `plan`, `facts`, `default`) and a one-line reason, so a run can say why it
launched what it launched. Bad combinations raise `ServingPlanError` with a message that names the
variable to change.

The flags rendered here exist in the SGLang release the serving lock pins (`SGLANG_VERSION`);
tests/unit/test_serving_argv.py parses the rendered argv with that release's own argument parser.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from .regen_attention_backends import backend_for_facts
from .regen_families import family_of
from .regen_gpu import PCIE_BLACKWELL_NCCL_ENV, nccl_decision
from .regen_net import is_loopback
from .regen_plan import nested, plan_entry

# API_KEY_ENV: the variable that carries the API key from the 0600 environment file into the router's
# environment (systemd's EnvironmentFile=, the supervisor's --secret-env-file); ROUTER_LAUNCHER reads it.
from .regen_secrets import API_KEY_ENV

SGLANG_VERSION = "0.5.23"
BACKENDS = ("sglang", "transformers")
ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "manual")
# SGLang 0.5.23 `--moe-a2a-backend` choices (fields/exec_.py); "none" means all-reduce based EP.
MOE_A2A_BACKENDS = (
    "none", "deepep", "mooncake", "nixl", "mori", "ascend_fuseep", "flashinfer", "megamoe", "deepep_v2",
    "ascend_tp", "pplx",
)
# SGLang 0.5.23 `--attention-backend` choices (arg_groups/choices.py ATTENTION_BACKEND_CHOICES).
ATTENTION_BACKENDS = (
    "triton", "torch_native", "flex_attention", "dsa", "nsa", "qsa", "dsv4", "compressed", "fa3", "fa4",
    "flashinfer", "llada2_cfg_flashinfer", "flashmla", "trtllm_mla", "cutedsl_mla", "tokenspeed_mla",
    "trtllm_mha", "hpc_ops", "minicpm_flashattn", "minicpm_flashinfer", "aiter", "wave", "intel_amx",
    "ascend", "intel_xpu",
)
# SGLang 0.5.23 `--moe-runner-backend` choices (arg_groups/choices.py MOE_RUNNER_BACKEND_CHOICES).
MOE_RUNNER_BACKENDS = (
    "auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm", "experimental_sgl_trtllm",
    "flashinfer_trtllm_routed", "flashinfer_cutlass", "flashinfer_mxfp4", "flashinfer_cutedsl",
    "flashinfer_megamoe", "cutlass", "aiter", "marlin", "humming", "experimental_sgl_marlin", "lora_cutedsl",
    "lora_triton", "lora_marlin", "hpc_ops", "megamoe", "intel_xpu",
)
# SGLang 0.5.23 `--kv-cache-dtype` choices (arg_groups/fields/model.py); the plan names one only when the
# checkpoint declares its KV-cache format (the memory arithmetic counts that many bytes per element).
KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
PCIE_BLACKWELL_ENV = PCIE_BLACKWELL_NCCL_ENV

# Flags the role renders itself; passing them again through extra args would make the effective value
# depend on argparse's last-wins order, so that is refused with the variable to use instead.
_RENDERED_FLAGS = {
    "--model-path": "sglang_server_model_path",
    "--model": "sglang_server_model_path",
    "--trust-remote-code": "sglang_server_trust_remote_code",
    "--tp-size": "sglang_server_tp_size",
    "--tp": "sglang_server_tp_size",
    "--tensor-parallel-size": "sglang_server_tp_size",
    "--ep-size": "sglang_server_ep_size",
    "--ep": "sglang_server_ep_size",
    "--expert-parallel-size": "sglang_server_ep_size",
    "--pp-size": "sglang_server_pp_size",
    "--dp-size": "sglang_server_dp_size",
    "--dp": "sglang_server_dp_size",
    "--pipeline-parallel-size": "sglang_server_pp_size",
    "--attn-dp-size": "sglang_server_attn_dp_size",
    "--enable-dp-attention": "sglang_server_attn_dp_size",
    "--moe-a2a-backend": "sglang_server_moe_a2a_backend",
    "--attention-backend": "sglang_server_attention_backend",
    "--reasoning-parser": "sglang_server_reasoning_parser",
    "--tool-call-parser": "sglang_server_tool_call_parser",
    "--context-length": "sglang_server_context_length",
    "--kv-cache-dtype": "sglang_server_kv_cache_dtype",
    "--quantization": "model_facts_plan_overrides.serving.quantization",
    "--moe-runner-backend": "model_facts_plan_overrides.serving.moe_runner_backend",
    "--cuda-graph-max-bs-decode": "model_facts_plan_overrides.serving.cuda_graph_max_bs",
    "--mem-fraction-static": "sglang_server_mem_fraction_static",
    "--host": "sglang_server_host",
    "--port": "sglang_server_port",
    "--api-key": "sglang_server_api_key",
    "--config": "sglang_server_api_key",
    "--enable-metrics": "sglang_server_enable_metrics",
    "--served-model-name": "sglang_server_served_model_name",
    "--nnodes": "sglang_server_nnodes",
    "--node-rank": "sglang_server_node_rank",
    "--dist-init-addr": "sglang_server_dist_init_addr",
    "--device": "sglang_server_device",
}


class ServingPlanError(ValueError):
    """The requested server cannot be launched as asked; the message says what to change."""


# --------------------------------------------------------------------------------------------------
# Reading facts: regen_plan's `nested` and `plan_entry` read the facts and the plan entries.
# --------------------------------------------------------------------------------------------------


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


class _Settings:
    """Collects each effective value with its source and reason (reported as `settings`)."""

    def __init__(self, overrides, facts):
        self.overrides = overrides or {}
        self.facts = facts or {}
        self.serving = nested(self.facts, "plan", "serving") or {}
        self.generation = nested(self.facts, "plan", "generation") or {}
        self.table = {}

    def pick(self, key, plan_section=None, plan_key=None, fallback=None, fallback_reason=None,
             keep_null=False):
        """Inventory override, else the plan's value, else the fallback. An override of "" is kept
        (it switches a flag off); a planned null counts only with keep_null (parsers: "none")."""
        value = self.overrides.get(key)
        if value is not None:
            return self._set(key, value, "override", f"set in inventory (sglang_server_{key})")
        if plan_section is not None:
            present, value, reason = plan_entry(plan_section, plan_key or key)
            if present and (value is not None or keep_null):
                return self._set(key, value, "plan", reason or "from the introspection plan")
        return self._set(key, fallback, "default", fallback_reason)

    def _set(self, key, value, source, reason):
        self.table[key] = {"value": value, "source": source, "reason": reason}
        return value


def _refuse_unknown(settings, key, plan_section):
    """A plan entry marked unknown (the tokenizer did not load at introspection) is no decision: serving
    with its null would silently drop the flag, so stop and say why, unless the inventory sets it."""
    entry = plan_section.get(key) if isinstance(plan_section, dict) else None
    if settings.table[key]["source"] == "plan" and isinstance(entry, dict) and entry.get("unknown") is True:
        raise ServingPlanError(
            f"the plan's {key} is unknown ({str(entry.get('reason')).removeprefix('unknown: ')}): "
            f"{entry.get('remedy')}; or set "
            f"sglang_server_{key} in inventory (\"\" for none)"
        )


def _int_setting(settings, key, minimum=1):
    value = settings.table[key]["value"]
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
        settings.table[key]["value"] = value
    if not _is_int(value) or value < minimum:
        raise ServingPlanError(
            f"{key} must be an integer >= {minimum}, got {value!r} ({settings.table[key]['source']}); "
            f"fix sglang_server_{key} or the plan"
        )
    return value


def url_host(host):
    """The host part of a URL for a bind address: wildcards are reached through loopback."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def _listen_address(spec, default_port, prefix):
    """(host, port, api_key_set) of a server or router; anything but loopback needs an API key."""
    host = str(spec.get("host") or "127.0.0.1")
    port = spec.get("port", default_port)
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if not _is_int(port) or not 1 <= port <= 65535:
        raise ServingPlanError(f"{prefix}_port must be an integer in 1..65535, got {port!r}")
    api_key_set = bool(spec.get("api_key_set"))
    if not is_loopback(host) and not api_key_set:
        raise ServingPlanError(
            f"{prefix}_host is {host}, which other machines can reach, but no API key is set; set "
            "sglang_server_api_key (e.g. from ansible-vault) or bind 127.0.0.1"
        )
    return host, port, api_key_set


def _check_extra_args(extra_args):
    if extra_args is None:
        return []
    if not isinstance(extra_args, list) or not all(isinstance(a, str) for a in extra_args):
        raise ServingPlanError(
            f"sglang_server_extra_args must be a list of strings (one argv element each), got {extra_args!r}"
        )
    for arg in extra_args:
        flag = arg.split("=", 1)[0]
        if flag in _RENDERED_FLAGS:
            raise ServingPlanError(
                f"sglang_server_extra_args contains {flag}, which the role renders itself; "
                f"set {_RENDERED_FLAGS[flag]} instead"
            )
    return list(extra_args)


def _served_model_name(settings, model_path):
    name = settings.overrides.get("served_model_name")
    if name:
        return settings._set("served_model_name", name, "override", "set in inventory")
    _present, planned, reason = plan_entry(settings.serving, "served_model_name")
    if planned:
        return settings._set("served_model_name", planned, "plan", reason or "from the introspection plan")
    base = os.path.basename(os.path.normpath(model_path)) if model_path else None
    return settings._set("served_model_name", base or "model", "default", "the model directory's name")


# --------------------------------------------------------------------------------------------------
# Server plan
# --------------------------------------------------------------------------------------------------


def plan_server(spec):
    """Pure: the launch plan for one server process.

    `spec` keys (all optional unless noted):
      backend ("sglang"|"transformers"), name, model_path (required), python (required),
      facts (the model_facts document), overrides (dict: device, tp_size, ep_size, pp_size, dp_size,
      attn_dp_size, moe_a2a_backend, attention_backend, reasoning_parser, tool_call_parser,
      context_length, kv_cache_dtype, mem_fraction_static,
      trust_remote_code, served_model_name, enable_metrics; None = take the plan),
      host, port, api_key_set (bool), secret_config_path (YAML file with the API key, SGLang --config),
      extra_args (list), env (dict), gpu_count (int or None = unknown), gpu_ids (list),
      nnodes, node_rank, dist_init_addr, device (transformers), cuda_env (dict merged into env),
      pcie_blackwell_env (dict applied on PCIe-only Blackwell hosts; None = PCIE_BLACKWELL_ENV).

    Returns a dict: argv, env, endpoint, readiness (method, path), served_model_name, serves_api,
    gpus_per_node, settings (value/source/reason per knob), warnings, and config_hash.
    """
    backend = spec.get("backend") or "sglang"
    if backend not in BACKENDS:
        raise ServingPlanError(
            f"sglang_server_backend must be one of {', '.join(BACKENDS)}, got {backend!r}"
        )
    model_path = spec.get("model_path")
    if not model_path or not isinstance(model_path, str):
        raise ServingPlanError("sglang_server_model_path is empty; point it at the model directory")
    python = spec.get("python")
    if not python:
        raise ServingPlanError("sglang_server_python is empty; point it at the serving venv's python")
    host, port, api_key_set = _listen_address(spec, 30000, "sglang_server")
    warnings = []
    extra_args = _check_extra_args(spec.get("extra_args"))
    settings = _Settings(spec.get("overrides"), spec.get("facts"))
    served_name = _served_model_name(settings, model_path)
    user_env = {}
    for source in (spec.get("cuda_env"), spec.get("env")):
        if source:
            if not isinstance(source, dict):
                raise ServingPlanError("sglang_server_environment must be a mapping of NAME: value")
            user_env.update({str(k): str(v) for k, v in source.items()})

    if backend == "sglang":
        plan = _plan_sglang(spec, settings, model_path, python, host, port, served_name, warnings)
    else:
        plan = _plan_transformers(spec, settings, model_path, python, host, port, api_key_set, warnings)
    # The model is a local directory (the role checks it exists): never let the server reach a model hub.
    # Derived settings come next and the inventory's environment last, so it can undo any of them.
    env = dict(OFFLINE_ENV)
    env.update(plan.pop("env_defaults", {}))
    env.update(user_env)
    gpu_ids = spec.get("gpu_ids") or []
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpu_ids)
    plan["argv"].extend(extra_args)
    base = f"http://{url_host(host)}:{port}"
    plan.update(
        {
            "backend": backend,
            "name": spec.get("name") or "main",
            "env": env,
            "endpoint": base if plan["serves_api"] else None,
            "api_base": base + "/v1" if plan["serves_api"] else None,
            "host": host,
            "port": port,
            "served_model_name": served_name,
            "settings": settings.table,
            "warnings": warnings + [w for w in (nested(spec.get("facts"), "plan", "warnings") or [])
                                    if isinstance(w, str)],
        }
    )
    plan["config_hash"] = config_hash(plan["argv"], env)
    plan["command_line"] = shell_join(plan["argv"])
    plan["env_redacted"] = redact_env(env)
    plan["explain"] = explain(settings.table)
    return plan


def explain(table):
    """One line per derived value: `tp_size=8 (plan: 8 GPUs ...)`, in a stable order."""
    lines = []
    for key in sorted(table):
        entry = table[key]
        reason = f": {entry['reason']}" if entry.get("reason") else ""
        lines.append(f"{key}={entry['value']} ({entry['source']}{reason})")
    return lines


def _plan_sglang(spec, settings, model_path, python, host, port, served_name, warnings):
    facts = settings.facts
    text_type = nested(facts, "architecture", "text_model_type")
    moe = nested(facts, "architecture", "moe")
    gpu_count = spec.get("gpu_count")
    nnodes = spec.get("nnodes") or 1
    if not _is_int(nnodes) or nnodes < 1:
        raise ServingPlanError(f"sglang_server_nnodes must be an integer >= 1, got {nnodes!r}")
    node_rank = spec.get("node_rank") or 0
    if not _is_int(node_rank) or not 0 <= node_rank < nnodes:
        raise ServingPlanError(
            f"node rank {node_rank!r} is outside 0..{nnodes - 1}; the host must be one of the {nnodes} "
            "hosts of sglang_server_group"
        )

    settings.pick("device", settings.serving, fallback="cuda", fallback_reason="SGLang's GPU backend")
    device = settings.table["device"]["value"]
    default_tp = gpu_count * nnodes if _is_int(gpu_count) and gpu_count > 0 else 1
    settings.pick("tp_size", settings.serving, fallback=default_tp,
                  fallback_reason=f"every visible GPU on every node ({default_tp})")
    tp = _int_setting(settings, "tp_size")
    settings.pick("pp_size", settings.serving, fallback=1, fallback_reason="no pipeline parallelism")
    pp = _int_setting(settings, "pp_size")
    settings.pick("dp_size", settings.serving, fallback=1, fallback_reason="one replica")
    dp = _int_setting(settings, "dp_size")
    settings.pick("ep_size", settings.serving, fallback=tp if moe else 1,
                  fallback_reason="MoE: one expert shard per tensor-parallel rank" if moe else "dense model")
    ep = _int_setting(settings, "ep_size")
    settings.pick("attn_dp_size", settings.serving, fallback=1, fallback_reason="attention DP off")
    attn_dp = _int_setting(settings, "attn_dp_size")
    settings.pick("moe_a2a_backend", settings.serving, fallback="none",
                  fallback_reason="all-reduce based EP; DeepEP needs NVLink/RDMA this host may lack")
    a2a = settings.table["moe_a2a_backend"]["value"]

    if a2a not in MOE_A2A_BACKENDS:
        raise ServingPlanError(
            f"moe_a2a_backend {a2a!r} is not one of SGLang {SGLANG_VERSION}'s choices: "
            + ", ".join(MOE_A2A_BACKENDS)
        )
    if dp > 1 and attn_dp > 1:
        raise ServingPlanError(
            f"dp_size {dp} (replicas) and attn_dp_size {attn_dp} (attention DP inside one replica) cannot "
            f"both be above 1 in SGLang {SGLANG_VERSION}; set one of sglang_server_dp_size / "
            "sglang_server_attn_dp_size to 1"
        )
    # Attention DP splits the tensor-parallel group; plain DP launches whole extra replicas.
    world = tp * pp * dp
    if world % nnodes:
        raise ServingPlanError(
            f"tp_size x pp_size x dp_size = {world} GPUs cannot be split evenly over {nnodes} nodes; "
            "make it a multiple of sglang_server_nnodes"
        )
    per_node = world // nnodes if device != "cpu" else 0
    if _is_int(gpu_count) and device != "cpu":
        if per_node > gpu_count:
            raise ServingPlanError(
                f"the plan needs {per_node} GPUs per node (tp_size {tp} x pp_size {pp} x dp_size {dp} "
                f"over {nnodes} node(s)) but this host has {gpu_count} visible; lower "
                "sglang_server_tp_size / dp_size or add nodes (sglang_server_nnodes)"
            )
        if per_node < gpu_count:
            warnings.append(f"using {per_node} of the {gpu_count} visible GPUs")
    if ep > 1:
        if tp % ep:
            raise ServingPlanError(
                f"ep_size {ep} does not divide the {tp} GPUs of tensor parallelism (tp_size); choose an "
                f"ep_size that divides it (SGLang {SGLANG_VERSION} requires ep_size x moe_dp_size == tp_size)"
            )
        if not moe:
            warnings.append(f"ep_size {ep} asked for a model the facts describe as dense")
    if tp % attn_dp:
        raise ServingPlanError(
            f"attn_dp_size {attn_dp} does not divide tp_size {tp}; SGLang needs tp_size % attn_dp_size == 0"
        )
    if a2a != "none" and ep <= 1:
        raise ServingPlanError(
            f"moe_a2a_backend {a2a} needs expert parallelism, but ep_size is {ep}"
        )
    attention_backend = _attention_backend(settings, device, warnings)

    # Fallback parsers for when the facts carry no generation plan: the model family's (the registry is
    # checked against SGLang's own choices by tests/unit/test_serving_argv.py).
    row = family_of(nested(facts, "architecture"))
    fallback_reasoning, fallback_tool = (row.reasoning_parser, row.tool_call_parser) if row else (None, None)
    family = row.model_type if row else text_type
    for key, fallback in (("reasoning_parser", fallback_reasoning), ("tool_call_parser", fallback_tool)):
        settings.pick(key, settings.generation, fallback=fallback, keep_null=True,
                      fallback_reason=f"SGLang's parser for model_type {family}" if fallback
                      else f"no SGLang parser known for model_type {family}")
        _refuse_unknown(settings, key, settings.generation)
    settings.pick("context_length", settings.serving, fallback=None,
                  fallback_reason="the model's own maximum")
    _report_budget_override(settings, warnings)
    settings.pick("kv_cache_dtype", settings.serving, fallback=None,
                  fallback_reason="the model's dtype (SGLang's auto)")
    kv_dtype = settings.table["kv_cache_dtype"]["value"]
    if kv_dtype in ("", None):
        kv_dtype = settings.table["kv_cache_dtype"]["value"] = None
    elif kv_dtype not in KV_CACHE_DTYPES:
        raise ServingPlanError(
            f"kv_cache_dtype {kv_dtype!r} ({settings.table['kv_cache_dtype']['source']}) is not one of "
            f"SGLang {SGLANG_VERSION}'s --kv-cache-dtype choices: {', '.join(KV_CACHE_DTYPES)}; fix "
            "sglang_server_kv_cache_dtype (or model_facts_plan_overrides.serving.kv_cache_dtype)"
        )
    # The MoE kernels, the quantization flag and the decode CUDA-graph batch the plan's tables chose
    # (regen_kernel_tables, regen_budget.graph_batch_for); absent from the plan, SGLang decides.
    for key in ("quantization", "moe_runner_backend", "cuda_graph_max_bs"):
        settings.pick(key, settings.serving, fallback=None, fallback_reason="SGLang's own choice")
    runner = settings.table["moe_runner_backend"]["value"]
    if runner and runner not in MOE_RUNNER_BACKENDS:
        raise ServingPlanError(
            f"moe_runner_backend {runner!r} is not one of SGLang {SGLANG_VERSION}'s --moe-runner-backend "
            f"choices: {', '.join(MOE_RUNNER_BACKENDS)}; fix "
            "model_facts_plan_overrides.serving.moe_runner_backend"
        )
    settings.pick("mem_fraction_static", settings.serving, fallback=None,
                  fallback_reason="SGLang's own default")
    settings.pick("trust_remote_code", settings.serving, fallback=True,
                  fallback_reason="needed by models that ship their own code (Kimi); harmless for others")
    settings.pick("enable_metrics", fallback=True, fallback_reason="Prometheus /metrics for the run")

    argv = [python, "-m", "sglang.launch_server", "--model-path", model_path]
    if settings.table["trust_remote_code"]["value"]:
        argv.append("--trust-remote-code")
    argv += ["--tp-size", str(tp)]
    if ep > 1:
        argv += ["--ep-size", str(ep)]
    if pp > 1:
        argv += ["--pp-size", str(pp)]
    if dp > 1:
        argv += ["--dp-size", str(dp)]
    if attn_dp > 1:
        # SGLang 0.5.23 replaced `--dp-size N --enable-dp-attention` with this one flag.
        argv += ["--attn-dp-size", str(attn_dp)]
    if a2a != "none":
        argv += ["--moe-a2a-backend", a2a]
    if attention_backend:
        argv += ["--attention-backend", attention_backend]
    for key, flag in (("reasoning_parser", "--reasoning-parser"), ("tool_call_parser", "--tool-call-parser")):
        value = settings.table[key]["value"]
        if value:
            argv += [flag, str(value)]
    context_length = settings.table["context_length"]["value"]
    if context_length is not None:
        argv += ["--context-length", str(_int_setting(settings, "context_length"))]
    if kv_dtype:
        argv += ["--kv-cache-dtype", str(kv_dtype)]
    if device == "cuda":
        for key, flag in (("quantization", "--quantization"), ("moe_runner_backend", "--moe-runner-backend"),
                          ("cuda_graph_max_bs", "--cuda-graph-max-bs-decode")):
            if settings.table[key]["value"]:
                argv += [flag, str(settings.table[key]["value"])]
    fraction = settings.table["mem_fraction_static"]["value"]
    if fraction is not None:
        try:
            fraction = float(fraction)
        except (TypeError, ValueError):
            fraction = -1.0
        if not 0.0 < fraction < 1.0:
            raise ServingPlanError(
                "mem_fraction_static must be a number between 0 and 1 (share of GPU memory for weights "
                f"and KV cache), got {settings.table['mem_fraction_static']['value']!r}"
            )
        argv += ["--mem-fraction-static", _format_float(fraction)]
    if device != "cuda":
        argv += ["--device", str(device)]
    argv += ["--host", host, "--port", str(port)]
    argv += ["--served-model-name", served_name]
    if settings.table["enable_metrics"]["value"]:
        argv.append("--enable-metrics")
    if nnodes > 1:
        dist = spec.get("dist_init_addr")
        if not dist or not re.match(r"^[^\s:]+:\d+$|^\[[0-9a-fA-F:]+\]:\d+$", str(dist)):
            raise ServingPlanError(
                f"a {nnodes}-node server needs sglang_server_dist_init_addr as HOST:PORT of rank 0, "
                f"got {dist!r}"
            )
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", str(dist)]
    if spec.get("api_key_set"):
        secret = spec.get("secret_config_path")
        if not secret:
            raise ServingPlanError("an API key is set but no secret_config_path was given to hold it")
        # The key travels in a 0600 YAML file that SGLang merges with `--config`, so neither the unit
        # file nor the process's argv shows it.
        argv += ["--config", secret]
    return {
        "argv": argv,
        "env_defaults": _gpu_env(spec, settings, per_node),
        "serves_api": node_rank == 0,
        "readiness": {"method": "GET", "path": "/health_generate"} if node_rank == 0 else None,
        "gpus_per_node": per_node,
        "nnodes": nnodes,
        "node_rank": node_rank,
    }


def _report_budget_override(settings, warnings):
    """An inventory context length beside the plan's length budget (plan.length.budget) is kept, and said
    to override the budget the other stages follow."""
    entry = settings.table["context_length"]
    budget = plan_entry(nested(settings.facts, "plan", "length") or {}, "budget")[1]
    if entry["source"] != "override" or budget is None or str(entry["value"]) == str(budget):
        return
    note = (f"sglang_server_context_length={entry['value']} overrides the plan's length budget of {budget} "
            "tokens (generation, tokenize and training follow the budget; set regen_length_budget to change "
            "them together)")
    entry["reason"] += f"; {note}"
    warnings.append(note)


def _attention_backend(settings, device, warnings):
    """The inventory's backend, else the plan's (model_facts), else the backend table over the facts
    (facts written before the plan named one); None leaves the flag off and SGLang picks at start-up."""
    if device == "cpu":
        # Only the inventory names a backend on CPU (e.g. intel_amx); the plan's is for its GPUs.
        table = None
        settings.pick("attention_backend", fallback=None,
                      fallback_reason="CPU: the plan's GPU attention backend does not apply")
    else:
        table = backend_for_facts(settings.facts)
        fallback, why = table["value"], table["reason"]
        if table["row"]:
            why = f"{why} (backend table row {table['row']})"
        # A planned null is a decision (mixed GPU generations, no table row): keep it.
        settings.pick("attention_backend", settings.serving, fallback=fallback, fallback_reason=why,
                      keep_null=True)
    entry = settings.table["attention_backend"]
    value = entry["value"]
    if value in (None, ""):
        entry["value"] = None
        return None
    if value not in ATTENTION_BACKENDS:
        raise ServingPlanError(
            f"attention_backend {value!r} ({entry['source']}) is not one of SGLang {SGLANG_VERSION}'s "
            f"--attention-backend choices: {', '.join(ATTENTION_BACKENDS)}; fix "
            "sglang_server_attention_backend (or model_facts_plan_overrides.serving.attention_backend)"
        )
    if entry["source"] == "override":
        table = table or backend_for_facts(settings.facts)
        if value in (table.get("avoid") or {}):
            entry["reason"] += f"; warning: {table['avoid'][value]}"
            warnings.append(f"sglang_server_attention_backend={value}: {table['avoid'][value]}")
    return value


def _gpu_env(spec, settings, per_node):
    """Environment derived from the GPU facts: the CUDA arch list for JIT-compiled kernels, and NCCL
    settings for PCIe-only Blackwell workstation cards (sm_120), where NCCL's peer-to-peer path hangs
    on the first all-reduce unless IOMMU/ACS are off on the host (NVIDIA/nccl#1999); the role's
    sglang_server_pcie_blackwell_environment (default NCCL_P2P_DISABLE=1) is applied there."""
    gpu = nested(settings.facts, "environment", "gpu") or {}
    env = {}
    capabilities = [c for c in gpu.get("compute_capabilities") or [] if isinstance(c, str) and c]
    if capabilities and per_node:
        env["TORCH_CUDA_ARCH_LIST"] = ";".join(sorted(set(capabilities)))
        settings._set("torch_cuda_arch_list", env["TORCH_CUDA_ARCH_LIST"], "facts",
                      "the GPUs' compute capabilities, so JIT-compiled kernels target them")
    extra = spec.get("pcie_blackwell_env")
    decided, reason, source = nccl_decision(gpu, per_node, "the SGLang server's TP ranks", extra)
    if decided or source == "measured":
        env.update(decided)
        settings._set("nccl_env", decided, "facts", reason
                      + ("; set sglang_server_pcie_blackwell_environment: {} once P2P works"
                         if source == "default" else ""))
    return env


def _plan_transformers(spec, settings, model_path, python, host, port, api_key_set, warnings):
    # A non-loopback bind without a key was refused by _listen_address; with a key, regen's launcher
    # (regen.serving.transformers_serve) makes the server ask for it, read from REGEN_SERVING_API_KEY.
    for key in ("tp_size", "ep_size", "pp_size", "dp_size", "attn_dp_size"):
        if _is_int(settings.overrides.get(key)) and settings.overrides[key] > 1:
            raise ServingPlanError(
                f"sglang_server_{key}={settings.overrides[key]} needs the sglang backend; "
                "`transformers serve` runs one process"
            )
    if (spec.get("nnodes") or 1) > 1:
        raise ServingPlanError("multi-node serving needs the sglang backend (sglang_server_backend: sglang)")
    settings.pick("trust_remote_code", settings.serving, fallback=True,
                  fallback_reason="needed by models that ship their own code (Kimi); harmless for others")
    device = spec.get("device") or "cpu"
    settings._set("device", device, "override" if spec.get("device") else "default",
                  "where `transformers serve` runs the model")
    # transformers' own CLI, started through regen's launcher: it adds streaming for tokenizers without a
    # Rust backend (Kimi's tiktoken tokenizer, so the demo's), which transformers 5.24 cannot stream
    # (regen.serving.transformers_serve). The serving python needs the regen package for it.
    argv = [python, "-m", "regen.serving.transformers_serve", "serve", model_path]
    trust = settings.table["trust_remote_code"]["value"]
    argv.append("--trust-remote-code" if trust else "--no-trust-remote-code")
    argv += ["--device", device, "--host", host, "--port", str(port)]
    warnings.append("transformers backend: parallelism and parser settings of the plan do not apply")
    return {
        "argv": argv,
        "serves_api": True,
        "readiness": {"method": "GET", "path": "/v1/models"},
        "gpus_per_node": 0 if device == "cpu" else 1,
        "nnodes": 1,
        "node_rank": 0,
    }


def _format_float(value):
    text = (f"{value:.4f}").rstrip("0")
    return text + "0" if text.endswith(".") else text


# --------------------------------------------------------------------------------------------------
# Router plan
# --------------------------------------------------------------------------------------------------


# sglang-router 0.3.2 takes its worker API key only as `--api-key VALUE` (RouterArgs; no environment
# variable, no config file), where `ps` and /proc/PID/cmdline show it to every local user until the
# router retitles itself. So a router with a key is started through the router's own Python entry
# point (`parse_router_args` + `launch_router`, what `python -m sglang_router.launch_router` runs), with
# `RouterArgs.api_key` filled from the process environment, which systemd's EnvironmentFile= or the
# supervisor's --secret-env-file load from the 0600 file. /proc/PID/environ is readable by the owner only.
ROUTER_LAUNCHER = (
    "import os, sys; "
    "from sglang_router.launch_router import launch_router, parse_router_args; "
    f"key = os.environ.pop({API_KEY_ENV!r}, ''); "
    f"key or sys.exit('regen: {API_KEY_ENV} is empty: the router reads its API key from the 0600 "
    "environment file the sglang_server role writes; re-run the serve stage'); "
    "args = parse_router_args(sys.argv[1:]); "
    "args.api_key = key; "
    "launch_router(args)"
)
# Router flags the role renders itself (router extra args must not repeat them).
_ROUTER_RENDERED_FLAGS = {
    "--worker-urls": "sglang_server_router_worker_urls",
    "--policy": "sglang_server_router_policy",
    "--host": "sglang_server_router_host",
    "--port": "sglang_server_router_port",
    "--api-key": "sglang_server_router_api_key",
    "--prometheus-host": "sglang_server_router_metrics_host",
    "--prometheus-port": "sglang_server_router_metrics_port",
}


def plan_router(spec):
    """Pure: the `sglang-router` launch plan in front of several servers.

    `spec`: python (required), worker_urls (list, >= 1), policy, host, port, api_key_set,
    metrics_host, metrics_port (the router's Prometheus listener; sglang-router's own default is
    0.0.0.0:29000, so it is always named), extra_args, env. With an API key the router is started by
    ROUTER_LAUNCHER, which reads the key from REGEN_SERVING_API_KEY in its environment (loaded from the
    0600 environment file at start by systemd or the process supervisor): it is never on the argv.
    """
    python = spec.get("python")
    if not python:
        raise ServingPlanError("sglang_server_router_python is empty; point it at a venv with sglang-router")
    urls = spec.get("worker_urls") or []
    if not isinstance(urls, list) or not urls:
        raise ServingPlanError(
            "the router needs at least one worker URL (sglang_server_router_worker_urls or the "
            "regen_serving_endpoint of the hosts in sglang_server_group)"
        )
    for url in urls:
        if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+$", url):
            raise ServingPlanError(f"router worker URL {url!r} is not of the form http://HOST:PORT")
    if len(set(urls)) != len(urls):
        raise ServingPlanError("router worker URLs repeat: " + ", ".join(urls))
    policy = spec.get("policy") or "cache_aware"
    if policy not in ROUTER_POLICIES:
        raise ServingPlanError(
            f"sglang_server_router_policy must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}"
        )
    host, port, api_key_set = _listen_address(spec, 30100, "sglang_server_router")
    metrics_host = str(spec.get("metrics_host") or "127.0.0.1")
    metrics_port = spec.get("metrics_port", 29000)
    if isinstance(metrics_port, str) and metrics_port.isdigit():
        metrics_port = int(metrics_port)
    if not _is_int(metrics_port) or not 1 <= metrics_port <= 65535:
        raise ServingPlanError(
            f"sglang_server_router_metrics_port must be an integer in 1..65535, got {metrics_port!r}"
        )
    if metrics_port == port:
        raise ServingPlanError(
            f"the router's metrics listener and its API both ask for port {port}; set "
            "sglang_server_router_metrics_port to another port"
        )
    warnings = []
    if not is_loopback(metrics_host):
        warnings.append(
            f"the router's Prometheus metrics listen on {metrics_host}:{metrics_port} without "
            "authentication (sglang_server_router_metrics_host); other machines can read them"
        )
    extra = spec.get("extra_args") or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise ServingPlanError("sglang_server_router_extra_args must be a list of strings")
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in _ROUTER_RENDERED_FLAGS:
            raise ServingPlanError(
                f"sglang_server_router_extra_args contains {flag}, which the role renders itself; "
                f"set {_ROUTER_RENDERED_FLAGS[flag]} instead"
            )
    args = ["--worker-urls", *urls, "--policy", policy, "--host", host, "--port", str(port),
            "--prometheus-host", metrics_host, "--prometheus-port", str(metrics_port), *extra]
    if api_key_set:
        argv = [python, "-c", ROUTER_LAUNCHER, *args]
        key_reason = (f"the worker API key reaches the router as {API_KEY_ENV} in its environment "
                      "(0600 environment file), never on its command line")
    else:
        argv = [python, "-m", "sglang_router.launch_router", *args]
        key_reason = "no API key"
    env = {str(k): str(v) for k, v in (spec.get("env") or {}).items()}
    base = f"http://{url_host(host)}:{port}"
    return {
        "backend": "router",
        "argv": argv,
        "router_args": args,
        "env": env,
        "host": host,
        "port": port,
        "metrics_host": metrics_host,
        "metrics_port": metrics_port,
        "serves_api": True,
        "endpoint": base,
        "api_base": base + "/v1",
        "readiness": {"method": "GET", "path": "/health"},
        "worker_urls": urls,
        "policy": policy,
        "config_hash": config_hash(argv, env),
        "command_line": shell_join(argv),
        "env_redacted": redact_env(env),
        "explain": [f"worker_urls={' '.join(urls)}", f"policy={policy}",
                    f"metrics={metrics_host}:{metrics_port} (sglang_server_router_metrics_host/_port)",
                    f"api_key: {key_reason}"],
        "warnings": warnings,
    }


# --------------------------------------------------------------------------------------------------
# Rendering helpers
# --------------------------------------------------------------------------------------------------


_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.I)


def redact_env(env):
    """The environment as it may be recorded: values of secret-looking names masked."""
    return {k: ("<redacted>" if _SECRET_NAME.search(k) else v) for k, v in sorted((env or {}).items())}


def config_hash(argv, env):
    """A stable fingerprint of what a restart would change (argv and environment, not secrets)."""
    doc = json.dumps({"argv": list(argv), "env": dict(sorted((env or {}).items()))}, sort_keys=True)
    return hashlib.sha256(doc.encode("utf-8")).hexdigest()


_SHELL_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")
_ENV_REF = re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*\}$")


def shell_join(argv):
    """argv as one line a person can paste into a shell (POSIX quoting; `${VAR}` left expandable)."""
    out = []
    for arg in argv:
        if arg and (_SHELL_SAFE.match(arg) or _ENV_REF.match(arg)):
            out.append(arg)
        else:
            out.append("'" + arg.replace("'", "'\"'\"'") + "'")
    return " ".join(out)


def systemd_quote(arg, expand_env=False):
    """One ExecStart= word: `%` doubled (specifiers), `$` doubled unless the word is an intended
    `${VAR}` reference, and quoted when it holds whitespace, quotes or backslashes."""
    text = arg.replace("%", "%%")
    if not (expand_env and _ENV_REF.match(arg)):
        text = text.replace("$", "$$")
    if text == "" or re.search(r"[\s\"'\\;]", text):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def systemd_exec(argv):
    """ExecStart= value: words quoted for systemd, `${REGEN_SERVING_API_KEY}` left for expansion."""
    return " ".join(systemd_quote(a, expand_env=(a == f"${{{API_KEY_ENV}}}")) for a in argv)


def systemd_env_line(name, value):
    """One Environment= assignment, quoted for systemd and with `%` escaped."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ServingPlanError(f"environment variable name {name!r} is not a valid identifier")
    text = (f"{name}={value}").replace("%", "%%").replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'
