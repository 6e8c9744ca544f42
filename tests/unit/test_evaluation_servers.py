"""The GPU evaluation's two servers (module_utils/regen_evaluation.py): the launch lines the serving role
renders for the target alone and with the drafter, parsed by SGLang 0.5.23's own parser, the speculative
one also checked by SGLang's own DFLASH validator (`speculative_hook._handle_dflash`), in the throwaway
CPU-only venv of tests/unit/test_serving_argv.py (tests/fixtures/serving/sglang_venv.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ansible.module_utils import regen_serving
from ansible.module_utils.regen_evaluation import EvaluationPlanError, evaluation_servers

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "serving"
sys.path.insert(0, str(FIXTURES))

from sglang_venv import VenvError, sglang_venv_python

DRAFTER = "/root/regen/drafter/runs/dflash-0123/export"
KIMI = json.loads((FIXTURES / "kimi-k2.6-ep8.spec.json").read_text())
KIMI_FACTS = json.loads((FIXTURES / "facts-kimi-k2.6.json").read_text())
PLAIN_SERVING = {"device": "cuda", "tp_size": 8, "ep_size": 8, "pp_size": 1, "attn_dp_size": 1}
# SGLang fields that name the drafter: the only ones the two servers may differ in.
SPECULATIVE_FIELDS = {
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_draft_tokens",
}


@pytest.fixture(scope="module")
def sglang_parse():
    """Callable: list of (kind, argv) -> SGLang's own parse results (see sglang_parse_argv.py)."""
    try:
        python = sglang_venv_python()
    except VenvError as exc:
        pytest.fail(str(exc))

    def parse(items):
        proc = subprocess.run(
            [str(python), str(FIXTURES / "sglang_parse_argv.py")],
            input=json.dumps([{"kind": k, "argv": a} for k, a in items]),
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)

    return parse


def _launch(extra_args, overrides=None):
    """The serving role's launch line (plan_server) for CT200's Kimi K2.6, with the evaluation's flags."""
    spec = dict(KIMI["spec"], facts=KIMI_FACTS, port=30020, extra_args=extra_args)
    spec["overrides"] = dict(spec["overrides"], **(overrides or {}))
    argv = regen_serving.plan_server(spec)["argv"]
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    return argv[3:]


def test_both_launch_lines_pass_sglangs_parser_and_differ_only_by_the_drafter(sglang_parse) -> None:
    servers = evaluation_servers(PLAIN_SERVING, DRAFTER, 16, 16, train_args=[])
    plain, dflash = _launch(servers["plain"]["extra_args"]), _launch(servers["dflash"]["extra_args"])
    results = sglang_parse([("server", plain), ("dflash", dflash), ("server", [*plain, "--no-such-flag"])])
    assert results[0]["ok"], results[0]["error"]
    assert results[1]["ok"], results[1]["error"]
    assert not results[2]["ok"]  # the parser does reject what 0.5.23 lacks
    p, d = results[0]["values"], results[1]["values"]
    assert p["speculative_algorithm"] is None
    assert (d["speculative_algorithm"], d["speculative_num_draft_tokens"]) == ("DFLASH", 16)
    assert d["speculative_draft_model_path"] == DRAFTER
    assert p["max_running_requests"] == d["max_running_requests"] == 16
    assert (d["tp_size"], d["ep_size"], d["pp_size"]) == (8, 8, 1)
    # Same layout: every other field SGLang parsed is the same on both servers.
    # (The DFLASH check sets the device to CUDA itself, so that a CPU-only venv can judge a GPU line.)
    assert d.pop("device") == "cuda" and p.pop("device") is None
    differing = {k for k in p if p[k] != d.get(k)}
    assert differing <= SPECULATIVE_FIELDS, differing
    assert "overlap scheduler on for both servers" in " ".join(servers["constraints"])


def test_with_dp_attention_both_servers_get_the_dp_lm_head_dflash_needs(sglang_parse) -> None:
    serving = dict(PLAIN_SERVING, attn_dp_size=8)
    servers = evaluation_servers(serving, DRAFTER, 16, 8)
    assert servers["plain"]["extra_args"][0] == "--enable-dp-lm-head"
    assert servers["dflash"]["extra_args"][0] == "--enable-dp-lm-head"
    plain = _launch(servers["plain"]["extra_args"], {"attn_dp_size": 8})
    dflash = _launch(servers["dflash"]["extra_args"], {"attn_dp_size": 8})
    assert "--attn-dp-size" in dflash
    without = [a for a in dflash if a != "--enable-dp-lm-head"]
    results = sglang_parse([("server", plain), ("dflash", dflash), ("dflash", without)])
    assert results[0]["ok"], results[0]["error"]
    assert results[1]["ok"], results[1]["error"]
    assert results[1]["values"]["enable_dp_lm_head"] is True
    # What the flag avoids: SGLang's own DFLASH check refuses the line without it.
    assert "--enable-dp-lm-head" in results[2]["error"]
    assert any("--enable-dp-lm-head" in c for c in servers["constraints"])


def test_what_dflash_cannot_serve_is_refused_with_the_fix() -> None:
    with pytest.raises(EvaluationPlanError, match="pp_size 1"):
        evaluation_servers(dict(PLAIN_SERVING, pp_size=2), DRAFTER, 16, 16)
    with pytest.raises(EvaluationPlanError, match="only on CUDA"):
        evaluation_servers(dict(PLAIN_SERVING, device="cpu"), DRAFTER, 16, 16)
    with pytest.raises(EvaluationPlanError, match="decode speculatively too"):
        evaluation_servers(PLAIN_SERVING, DRAFTER, 16, 16, extra_args=["--speculative-algorithm", "EAGLE"])
    with pytest.raises(EvaluationPlanError, match="below the batch setting"):
        evaluation_servers(PLAIN_SERVING, DRAFTER, 16, 32, extra_args=["--max-running-requests", "24"])
    attn_dp = dict(PLAIN_SERVING, attn_dp_size=8)
    with pytest.raises(EvaluationPlanError, match="COORDINATION=0"):
        evaluation_servers(
            attn_dp, DRAFTER, 16, 16, environment={"SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION": "1"}
        )
    with pytest.raises(EvaluationPlanError, match="context parallelism"):
        evaluation_servers(attn_dp, DRAFTER, 16, 16, extra_args=["--attn-cp-size", "2"])
    with pytest.raises(EvaluationPlanError, match="block_size"):
        evaluation_servers(PLAIN_SERVING, DRAFTER, 1, 16)


def test_the_inventorys_cap_and_the_train_stage_flags_are_used_when_they_fit() -> None:
    capped = evaluation_servers(PLAIN_SERVING, DRAFTER, 16, 16, extra_args=["--max-running-requests=32"])
    assert capped["plain"]["extra_args"] == []  # the inventory's cap already reaches both servers
    assert "--max-running-requests 32 from the inventory" in " ".join(capped["constraints"])
    wrote = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", DRAFTER]
    wrote += ["--speculative-num-draft-tokens", "16"]
    same = evaluation_servers(PLAIN_SERVING, DRAFTER, 16, 16, train_args=wrote)
    assert (
        same["drafter_args"] == wrote
        and same["drafter_args_source"] == "the train stage's sglang_dflash.args"
    )
    stale = evaluation_servers(dict(PLAIN_SERVING, attn_dp_size=8), DRAFTER, 16, 16, train_args=wrote)
    assert (
        stale["drafter_args"][-1] == "--enable-dp-lm-head"
        and "no longer matches" in stale["drafter_args_source"]
    )
    # A new drafter changes the speculative server's identity only: the plain records stay valid.
    other = evaluation_servers(PLAIN_SERVING, "/other/export", 16, 16)
    assert other["plain"]["identity"] == same["plain"]["identity"]
    assert other["dflash"]["identity"] != same["dflash"]["identity"]


# What SGLang 0.5.23's /generate takes: GenerateReqInput's fields (read from its source: importing
# io_struct needs transformers, which the throwaway venv does not carry) and SamplingParams itself.
_BODY_CHECK = r"""
import ast, json, sys
from pathlib import Path
import sglang
from sglang.srt.sampling.sampling_params import SamplingParams

body = json.loads(sys.argv[1])
source = Path(sglang.__file__).parent / "srt" / "managers" / "io_struct.py"
tree = ast.parse(source.read_text())
cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
params = SamplingParams(**body["sampling_params"])
params.verify(163840)
print(json.dumps({"unknown": sorted(set(body) - fields), "top_k": params.top_k,
                  "max_new_tokens": params.max_new_tokens, "stop_token_ids": sorted(params.stop_token_ids)}))
"""


def test_the_request_bodies_are_what_sglangs_generate_takes() -> None:
    from regen.evaluate.serving import generate_body

    try:
        python = sglang_venv_python()
    except VenvError as exc:
        pytest.fail(str(exc))
    for top in (0, 2):
        body = generate_body([163584, 1008, 163585], max_new_tokens=256, stop_ids=[163586], top_logprobs=top)
        proc = subprocess.run(
            [str(python), "-c", _BODY_CHECK, json.dumps(body)],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
        assert seen["unknown"] == []  # every key is a GenerateReqInput field
        # Temperature 0 is greedy in SGLang: top-k 1.
        assert (seen["top_k"], seen["max_new_tokens"], seen["stop_token_ids"]) == (1, 256, [163586])
