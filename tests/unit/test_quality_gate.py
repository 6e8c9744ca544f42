"""The probe checker and the `python -m regen.jobs.quality_gate` CLI against the fault-injection stub.

The stub (tests/helpers/stub_openai_server.py) is told which answers to give (`replies`): the right
ones, then the real garbage recorded in tests/fixtures/quality (sgl-project/sglang issues 21132 and
24321), then nothing at all (endpoint down). The known-failure table is checked against real log lines
from the same public threads.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from regen.quality.gate import GateError, check_local_endpoint, judge, run_probes
from regen.quality.probes import ProbeError, check_answer, load_probes, parse_probes
from regen.serving.known_failures import LOG_SIGNATURES, match_log, suggest_for_output
from tests.helpers.stub_openai_server import StubConfig, StubServer

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "quality"
OUTPUTS = json.loads((FIXTURES / "outputs.json").read_text(encoding="utf-8"))
GARBAGE = {e["id"]: e["text"] for e in OUTPUTS["garbage"]}
GOOD = {e["id"]: e["text"] for e in OUTPUTS["good"]}
LOGS = json.loads((FIXTURES / "server_logs.json").read_text(encoding="utf-8"))

# Right answers to the packaged probes, keyed by a substring of each prompt; the capital answer is a
# real one (truefoundry/models PR 1300, Hermes-3 405B).
RIGHT = {
    "17 * 23": "391",
    "128 + 256": "128 + 256 = 384",
    "capital of France": GOOD["truefoundry-1300-hermes3-capital"],
    "Repeat this string": "kettle-7Q4-violet-harbor",
}


@pytest.fixture
def stub():
    with StubServer(StubConfig(model_name="probe-model", record=True)) as server:
        yield server


def _run(stub, **kw):
    return run_probes(stub.url, "probe-model", load_probes(), timeout=10, **kw)


def test_right_answers_pass(stub):
    stub.configure(replies=RIGHT)
    verdict = _run(stub)
    assert verdict["verdict"] == "pass", verdict["reasons"]
    assert verdict["passed"] == verdict["total"] == 4
    body = stub.requests[0]["body"]
    assert body["temperature"] == 0 and body["model"] == "probe-model" and body["max_tokens"] == 256


def test_real_garbage_fails_with_the_probes_named(stub):
    stub.configure(
        replies={
            **RIGHT,
            "capital of France": GARBAGE["sglang-21132-ep8-capital"],
            "17 * 23": GARBAGE["sglang-24321-nvfp4-plus"],
        }
    )
    verdict = _run(stub)
    assert verdict["verdict"] == "fail"
    assert verdict["failed"] == ["arithmetic-multiply", "capital-france"]
    reasons = " | ".join(verdict["reasons"])
    assert "expected 'Paris' in the answer" in reasons
    assert "degenerate: one_token_repeated" in reasons


def test_filler_text_is_not_an_answer(stub):
    verdict = _run(stub)  # no replies: the stub's own filler text
    assert verdict["verdict"] == "fail" and len(verdict["failed"]) == 4


def test_not_applicable_runs_and_reports_but_does_not_fail(stub):
    verdict = _run(stub, not_applicable_reason="a model too small to answer")
    assert verdict["verdict"] == "not_applicable"
    assert verdict["reasons"][0] == "probes not applicable: a model too small to answer"
    assert all("(not enforced)" in r for r in verdict["reasons"][1:])
    assert len(verdict["probes"]) == 4


def test_extra_body_and_api_key_reach_the_server(stub):
    stub.configure(replies=RIGHT)
    verdict = _run(stub, api_key="k-123", extra_body={"chat_template_kwargs": {"thinking": False}})
    assert verdict["verdict"] == "pass"
    assert stub.requests[-1]["authorization"] == "Bearer k-123"
    assert stub.requests[-1]["body"]["chat_template_kwargs"] == {"thinking": False}
    with pytest.raises(GateError, match="may not set"):
        _run(stub, extra_body={"model": "other"})


def test_a_down_endpoint_is_unavailable(stub):
    stub.configure(down=True)
    verdict = _run(stub)
    assert verdict["verdict"] == "unavailable"
    assert "HTTP 503" in verdict["reasons"][0]


def _own_non_loopback_ipv4() -> str:
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    pytest.fail("this machine has no IPv4 address but loopback")


def test_only_endpoints_on_this_machine():
    assert check_local_endpoint("http://127.0.0.1:30000/v1/") == "http://127.0.0.1:30000"
    assert check_local_endpoint("http://[::1]:8000") == "http://[::1]:8000"
    # A server bound to this machine's cluster address: still next to the gate.
    own = _own_non_loopback_ipv4()
    assert check_local_endpoint(f"http://{own}:30000/v1") == f"http://{own}:30000"
    # TEST-NET-1 is nobody's address here; a name is not resolved; 0.0.0.0 is no server's address.
    for bad in ("http://192.0.2.1:30000", "http://example.com", "ftp://127.0.0.1", "http://0.0.0.0:30000"):
        with pytest.raises(GateError):
            check_local_endpoint(bad)


def test_judge_reasoning_budget_hint():
    probe = load_probes()[0]
    doc = {
        "choices": [
            {
                "message": {"content": "", "reasoning_content": "Let me compute 17 * 23 ..."},
                "finish_reason": "length",
            }
        ]
    }
    result = judge(probe, doc, 0.1)
    assert not result.passed
    assert "raise --max-tokens" in result.reasons[0]


def test_check_answer_kinds():
    probes = parse_probes(
        [
            {"id": "n", "prompt": "q", "expect": {"kind": "number", "value": 1024}},
            {"id": "c", "prompt": "q", "expect": {"kind": "contains", "value": "Paris"}},
            {"id": "e", "prompt": "q", "expect": {"kind": "exact", "value": "ok"}},
            {"id": "r", "prompt": "q", "expect": {"kind": "regex", "value": r"^\s*yes\b"}},
        ],
        "test",
    )
    n, c, e, r = probes
    assert check_answer(n, "It is 1,024.")[0] and not check_answer(n, "1023")[0]
    assert check_answer(c, "<think>maybe Lyon</think>The capital is paris.")[0]
    assert not check_answer(c, "Parisian")[0]
    assert check_answer(e, "  ok \n")[0] and not check_answer(e, "ok!")[0]
    assert check_answer(r, "Yes, it is")[0] and not check_answer(r, "no")[0]


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([], "non-empty list"),
        ([{"id": "a", "expect": {"kind": "number", "value": 1}}], "give 'prompt'"),
        ([{"id": "a", "prompt": "q", "expect": {"kind": "fuzzy", "value": 1}}], "kind one of"),
        ([{"id": "a", "prompt": "q", "expect": {"kind": "number", "value": "x"}}], "numeric value"),
        ([{"id": "a", "prompt": "q", "expect": {"kind": "regex", "value": "("}}], "bad regex"),
        ([{"id": "a", "prompt": "q", "expect": {"kind": "exact", "value": "x"}}] * 2, "appears twice"),
    ],
)
def test_bad_probe_files_say_what_is_wrong(items, message):
    with pytest.raises(ProbeError, match=message):
        parse_probes(items, "probes.json")


def test_probe_files_json_and_yaml(tmp_path):
    pytest.importorskip("yaml")
    (tmp_path / "p.json").write_text(
        json.dumps({"probes": [{"id": "a", "prompt": "q", "expect": {"kind": "exact", "value": "x"}}]})
    )
    (tmp_path / "p.yml").write_text("- id: b\n  prompt: q\n  expect: {kind: number, value: 2}\n")
    assert [p.id for p in load_probes(tmp_path / "p.json")] == ["a"]
    assert [p.id for p in load_probes(tmp_path / "p.yml")] == ["b"]
    with pytest.raises(ProbeError, match="cannot read"):
        load_probes(tmp_path / "missing.json")


@pytest.mark.parametrize("entry", LOGS, ids=[e["id"] for e in LOGS])
def test_known_log_failures(entry):
    log = f"[2026-05-07 10:00:00] Load weight end.\nTraceback (most recent call last):\n{entry['line']}\n"
    cause = match_log(log)
    assert cause is not None and cause.kind == entry["kind"]
    assert "source: https://" in cause.hint


def test_trtllm_mla_failure_names_the_table_fix():
    cause = match_log(LOGS[0]["line"])
    assert "--attention-backend flashinfer" in cause.hint
    assert match_log("INFO: The server is fired up and ready to roll!") is None
    assert all(sig.sources for sig in LOG_SIGNATURES)


def test_output_suggestions_fit_the_setup():
    assert [s["id"] for s in suggest_for_output("12.0", 8, "int4")] == ["sm120-ep8-garbage"]
    assert [s["id"] for s in suggest_for_output("12.0", 1, "nvfp4")] == [
        "sm120-nvfp4-garbage", "sm120-nvfp4-cutlass-moe-invalid"]
    assert [s["id"] for s in suggest_for_output("12.0", 8, None)] == [
        "sm120-ep8-garbage",
        "sm120-nvfp4-garbage",
        "sm120-nvfp4-cutlass-moe-invalid",
    ]
    assert suggest_for_output("9.0", 8, "nvfp4") == []
    assert suggest_for_output(None, None, None) == []


def test_the_trtllm_moe_crash_on_sm120_names_the_tables_fix():
    # The error FlashInfer's trtllm-gen batched GEMM runner raises when it has no kernel (quoted from
    # flashinfer-ai/flashinfer issue 3310; on sm_120 there are no trtllm-gen MoE cubins at all, PR 3670).
    line = ("RuntimeError: Error in function 'TrtllmGenBatchedGemmRunner' at "
            "/workspace/csrc/trtllm_batched_gemm_runner.cu:143: No kernel found for the given options: ...")
    cause = match_log("loading...\n" + line + "\n")
    assert cause.kind == "trtllm_gen_moe_no_kernel"
    assert "--quantization modelopt_fp4 --moe-runner-backend flashinfer_cutlass" in cause.hint
    assert "sm120-nvfp4" in cause.hint
    # The CUTLASS fused-MoE failure without a tactic (quoted from sgl-project/sglang PR 24692).
    cause = match_log("ValueError: No valid tactics available for fused moe op")
    assert cause.kind == "flashinfer_cutlass_moe_no_tactic" and "marlin" in cause.hint


# ---------------------------------------------------------------------------------------------- CLI


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "regen.jobs.quality_gate", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def test_cli_pass_and_report(stub, tmp_path):
    stub.configure(replies=RIGHT)
    report = tmp_path / "gate.json"
    proc = _cli("--endpoint", stub.url, "--model", "probe-model", "--report", str(report))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "pass"
    assert json.loads(report.read_text())["passed"] == 4
    assert "quality gate: pass (4/4 probes)" in proc.stderr


def test_cli_fails_with_probes_log_tail_and_suggestion(stub, tmp_path):
    stub.configure(replies={**RIGHT, "capital of France": GARBAGE["sglang-21132-ep8-capital"]})
    log = tmp_path / "main.log"
    log.write_text("[2026-03-22] Load weight end.\n[2026-03-22] The server is fired up and ready to roll!\n")
    proc = _cli(
        "--endpoint",
        stub.url,
        "--model",
        "probe-model",
        "--log-file",
        str(log),
        "--compute-capability",
        "12.0",
        "--ep-size",
        "8",
        "--quantization",
        "fp8",
    )
    assert proc.returncode == 1
    verdict = json.loads(proc.stdout)
    assert verdict["failed"] == ["capital-france"]
    assert verdict["log_tail"][-1].endswith("ready to roll!")
    assert "https://github.com/sgl-project/sglang/issues/21132" in verdict["suggestion"]
    assert "FAILED probes capital-france" in proc.stderr


def test_cli_inline_probes_and_not_applicable(stub):
    probes = [{"id": "only", "prompt": "What is 17 * 23?", "expect": {"kind": "number", "value": 391}}]
    proc = _cli(
        "--endpoint",
        stub.url,
        "--model",
        "probe-model",
        "--probes-json",
        json.dumps(probes),
        "--not-applicable-reason",
        "the demo model cannot answer",
    )
    assert proc.returncode == 0, proc.stderr
    verdict = json.loads(proc.stdout)
    assert verdict["verdict"] == "not_applicable" and verdict["total"] == 1
    assert "not applicable (the demo model cannot answer)" in proc.stderr


def test_cli_api_key_env_file(stub, tmp_path):
    stub.configure(replies=RIGHT)
    env_file = tmp_path / "serve.env"
    env_file.write_text("REGEN_SERVING_API_KEY=s3cret\n")
    proc = _cli("--endpoint", stub.url, "--model", "probe-model", "--api-key-env-file", str(env_file))
    assert proc.returncode == 0, proc.stderr
    assert stub.requests[-1]["authorization"] == "Bearer s3cret"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_exit_codes_for_bad_input_and_no_server(tmp_path):
    down = _cli("--endpoint", f"http://127.0.0.1:{_closed_port()}", "--model", "m")
    assert down.returncode == 3
    assert json.loads(down.stdout)["verdict"] == "unavailable"
    remote = _cli("--endpoint", "http://10.1.2.200:30000", "--model", "m")
    assert remote.returncode == 2 and "only talks to a server on its own machine" in remote.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('[{"id": 1}]')
    assert (
        "'id' must be a non-empty string"
        in _cli("--endpoint", "http://127.0.0.1:1", "--model", "m", "--probes", str(bad)).stderr
    )
