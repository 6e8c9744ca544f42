"""The rendered launch lines parse with the pinned SGLang release's own argument parser.

What this needed (the flags must exist in sglang==0.5.23, the serving lock's pin, and nothing here may
need a GPU):

* A throwaway venv, `.cache/sglang-argv-0.5.23/`, built once (tests/fixtures/serving/sglang_venv.py)
  from `tests/fixtures/serving/sglang-argv.requirements.txt` with `pip install --no-deps -r`: sglang
  0.5.23 and sglang-router 0.3.2 without any of their GPU dependencies (flashinfer, sgl-kernel,
  deep-ep, nvidia-* wheels), plus the ~40 packages `import sglang.srt.server_args` and the router's
  launcher really touch. SGLang's `utils/common.py` imports torch and triton at module level, so the
  venv gets the CPU build of torch 2.13.0 (the project's own pin, on this machine's disk) and triton
  3.8.0 from PyPI, which imports fine without a GPU. The sglang wheel is cp311, so the venv is built
  with a Python 3.11 interpreter. A marker holds the requirements' hash; edit the file and the venv is
  rebuilt (about two minutes, 2.3 GB under .cache/).
* The lines are parsed as `sglang serve` parses them: `ServerArgs.add_cli_args`, SGLang's
  `ConfigArgumentMerger` for `--config FILE` (how the role passes the API key), `parse_args`, then
  `ServerArgs.from_cli_args`. Server-args *resolution* (which reads the model's config.json and probes
  the hardware) is not run. The router lines go through `RouterArgs.add_cli_args/from_cli_args`.
* Parsing must also give back the values the plan meant (tp 8 parses as 8, the API key comes out of the
  config file), and a made-up flag must be rejected, so the check can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "serving"

from ansible.module_utils import regen_serving
from ansible.module_utils.regen_families import FAMILIES

CASES = sorted(p.name[: -len(".spec.json")] for p in FIXTURES.glob("*.spec.json"))
sys.path.insert(0, str(FIXTURES))

from sglang_venv import SGLANG_VERSION, VenvError, sglang_venv_python


def _venv_python() -> Path:
    assert SGLANG_VERSION == regen_serving.SGLANG_VERSION, "the venv must hold the release the role targets"
    try:
        return sglang_venv_python()
    except VenvError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def sglang_parse():
    """Callable: list of (kind, argv) -> list of parse results from SGLang's own parsers."""
    python = _venv_python()

    def parse(items):
        proc = subprocess.run(
            [str(python), str(FIXTURES / "sglang_parse_argv.py")],
            input=json.dumps([{"kind": k, "argv": a} for k, a in items]),
            capture_output=True, text=True, check=False, timeout=300,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)

    return parse


def _plan(case):
    doc = json.loads((FIXTURES / f"{case}.spec.json").read_text())
    spec = dict(doc["spec"])
    if doc.get("facts_file"):
        spec["facts"] = json.loads((FIXTURES / doc["facts_file"]).read_text())
    return doc["kind"], spec


def _args_after_module(argv):
    # argv = [python, "-m", module, *args] or, for a router with an API key, [python, "-c", launcher, *args]
    assert argv[1] in ("-m", "-c")
    return argv[3:]


def test_golden_lines_parse_and_mean_what_the_plan_says(sglang_parse, tmp_path):
    secret = tmp_path / "secret.yaml"
    secret.write_text('api-key: "test-key-123"\n')
    items, plans = [], []
    for case in CASES:
        kind, spec = _plan(case)
        if kind == "router":
            plan = regen_serving.plan_router(spec)
            # The launcher parses these args with the router's own parse_router_args, then sets
            # RouterArgs.api_key from the environment (tests/unit/test_serving_router.py runs it for real).
            args = _args_after_module(plan["argv"])
            assert args == plan["router_args"]
        else:
            if spec.get("api_key_set"):
                spec["secret_config_path"] = str(secret)
            plan = regen_serving.plan_server(spec)
            args = _args_after_module(plan["argv"])
        items.append((kind, args))
        plans.append((case, kind, plan))
    results = sglang_parse(items)
    for (case, kind, plan), result in zip(plans, results, strict=True):
        assert result["ok"], f"{case}: SGLang rejected the line: {result['error']}\n{plan['command_line']}"
        values = result["values"]
        if kind == "router":
            assert values["worker_urls"] == plan["worker_urls"]
            assert values["policy"] == plan["policy"]
            assert values["api_key"] is None, "the key must not be on the router's command line"
            assert (values["host"], values["port"]) == (plan["host"], plan["port"])
            assert (values["prometheus_host"], values["prometheus_port"]) == ("127.0.0.1", 29000)
            continue
        settings = {k: v["value"] for k, v in plan["settings"].items()}
        assert values["model_path"] == plan["argv"][plan["argv"].index("--model-path") + 1]
        for key in ("tp_size", "ep_size", "pp_size", "dp_size", "attn_dp_size"):
            assert values[key] == settings[key], (case, key)
        assert values["moe_a2a_backend"] == settings["moe_a2a_backend"]
        assert values["attention_backend"] == settings["attention_backend"], case
        assert values["reasoning_parser"] == settings["reasoning_parser"]
        assert values["tool_call_parser"] == settings["tool_call_parser"]
        assert values["context_length"] == settings["context_length"]
        assert values["mem_fraction_static"] == pytest.approx(settings["mem_fraction_static"])
        assert values["trust_remote_code"] is bool(settings["trust_remote_code"])
        assert values["enable_metrics"] is bool(settings["enable_metrics"])
        assert (values["host"], values["port"]) == (plan["host"], plan["port"])
        assert values["served_model_name"] == plan["served_model_name"]
        assert (values["nnodes"], values["node_rank"]) == (plan["nnodes"], plan["node_rank"])
        if plan["nnodes"] > 1:
            assert values["dist_init_addr"] == plan["argv"][plan["argv"].index("--dist-init-addr") + 1]
        if "--config" in plan["argv"]:
            assert values["api_key"] == "test-key-123", "the key must come out of the --config file"
        else:
            assert values["api_key"] is None
    extra = dict(zip([c for c, _, _ in plans], results, strict=True))["qwen3-8b-tp1"]["values"]
    assert extra["chunked_prefill_size"] == 8192


def test_the_parser_rejects_what_sglang_does_not_know(sglang_parse):
    # Without this the test above could pass against a parser that accepts anything.
    results = sglang_parse([
        ("server", ["--model-path", "/m", "--bogus-flag"]),
        ("server", ["--model-path", "/m", "--reasoning-parser", "no_such_parser"]),
        ("server", ["--model-path", "/m", "--moe-a2a-backend", "no_such_backend"]),
        ("router", ["--worker-urls", "http://a:1", "--policy", "no_such_policy"]),
    ])
    assert [r["ok"] for r in results] == [False, False, False, False]


def test_parser_choices_match_what_the_planner_assumes(sglang_parse):
    # The model-family registry's parser names (the plan's and the launch line's) and the a2a backends
    # must be choices of the pinned release.
    reasoning = sorted({row.reasoning_parser for row in FAMILIES.values() if row.reasoning_parser})
    tools = sorted({row.tool_call_parser for row in FAMILIES.values() if row.tool_call_parser})
    parsers = set(reasoning) | set(tools)
    items = [("server", ["--model-path", "/m", "--reasoning-parser", r]) for r in reasoning]
    items += [("server", ["--model-path", "/m", "--tool-call-parser", t]) for t in tools]
    items += [("server", ["--model-path", "/m", "--moe-a2a-backend", b])
              for b in regen_serving.MOE_A2A_BACKENDS]
    items += [("router", ["--worker-urls", "http://a:1", "--policy", p])
              for p in regen_serving.ROUTER_POLICIES]
    results = sglang_parse(items)
    bad = [(kind, args[-1], r["error"])
           for (kind, args), r in zip(items, results, strict=True) if not r["ok"]]
    assert not bad, bad
    assert parsers  # the table is not empty


def test_attention_backend_choices_are_the_pinned_releases():
    # regen_serving.ATTENTION_BACKENDS (the plan's check) and the role's typed choices
    # (meta/argument_specs.yml) must be exactly SGLang 0.5.23's --attention-backend choices.
    import yaml

    python = _venv_python()
    code = (
        "import json; from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES as c; "
        "print(json.dumps(list(c)))"
    )
    proc = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=False, timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(regen_serving.ATTENTION_BACKENDS) == json.loads(proc.stdout.strip().splitlines()[-1])
    specs = yaml.safe_load((ROOT / "roles" / "sglang_server" / "meta" / "argument_specs.yml").read_text())
    choices = specs["argument_specs"]["main"]["options"]["sglang_server_attention_backend"]["choices"]
    assert choices == ["", *regen_serving.ATTENTION_BACKENDS]


def test_target_plus_drafter_lines_pass_sglangs_own_dflash_checks(sglang_parse):
    """The evaluation/serving line of the target with the trained drafter: SGLang's parser and its DFLASH
    validator (`_handle_dflash`) accept what regen writes, and reject what SGLang 0.5.23 cannot serve."""
    from ansible.module_utils.regen_drafter import DrafterPlanError, sglang_dflash_args

    _, spec = _plan("kimi-k2.6-ep8")
    plan = regen_serving.plan_server(spec)
    target = _args_after_module(plan["argv"])
    with_drafter = target + sglang_dflash_args("/root/regen/drafter/export", 8, {"pp_size": 1})
    attn_dp = ["--model-path", "/m", "--tp-size", "8", "--attn-dp-size", "8"]
    results = sglang_parse([
        ("dflash", with_drafter),
        ("dflash", attn_dp + sglang_dflash_args("/d", 8, {"attn_dp_size": 8})),
        # What the flags avoid: SGLang itself refuses these.
        ("dflash", attn_dp + sglang_dflash_args("/d", 8)),
        ("dflash", ["--model-path", "/m", "--pp-size", "2", *sglang_dflash_args("/d", 8)]),
    ])
    assert results[0]["ok"], results[0]["error"]
    values = results[0]["values"]
    assert values["speculative_algorithm"] == "DFLASH" and values["speculative_num_draft_tokens"] == 8
    assert values["speculative_draft_model_path"] == "/root/regen/drafter/export"
    assert (values["tp_size"], values["ep_size"]) == (8, 8)
    assert results[1]["ok"], results[1]["error"]
    assert "--enable-dp-lm-head" in results[2]["error"]
    assert "pp_size == 1" in results[3]["error"]
    with pytest.raises(DrafterPlanError, match="pp_size 1"):
        sglang_dflash_args("/d", 8, {"pp_size": 2})
