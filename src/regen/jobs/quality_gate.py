"""Does the served model answer sensibly? Probe it and fail with the probes that went wrong.

    python -m regen.jobs.quality_gate --endpoint URL --model NAME [--probes FILE]
        [--not-applicable-reason TEXT] [--api-key-env-file FILE] [--log-file FILE | --unit UNIT]
        [--compute-capability X.Y --ep-size N --quantization Q] [--report FILE]

Runs the probe set (default: regen/quality/default_probes.jsonl; arithmetic, a capital city,
repeat-this-string) against an OpenAI-compatible server on this machine, checks each answer and its text
for degeneration (empty, U+FFFD, one token repeated, n-gram loops, whitespace runs, and with
--tokenizer a tokenizer round-trip), and prints the verdict as one JSON document on stdout (the
serving role reads it); the reasons go to stderr too. When the probes fail, the verdict carries the
server's log tail (--log-file or --unit), what public reports found for this setup (--compute-capability,
--ep-size, --quantization; regen.serving.known_failures) and any known failure in the log.

Exit codes: 0 pass, or not applicable (--not-applicable-reason: the probes ran, their failures are
reported, not enforced); 1 some probe failed; 2 bad arguments or probe file; 3 the endpoint did not answer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..module_utils.regen_files import read_tail
from ..quality.gate import GateError, run_probes
from ..quality.probes import ProbeError, load_probes, parse_probes
from ..serving.diagnose import diagnose, tail
from ..serving.known_failures import match_log, suggest_for_output
from ._common import (
    EXIT_FAILED_RECORDS,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    JobError,
    atomic_write_json,
    run_main,
    serving_api_key,
)

LOG_TAIL_LINES = 40


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m regen.jobs.quality_gate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--endpoint",
        required=True,
        help="server base URL on this machine (loopback or its own address), e.g. http://127.0.0.1:30000",
    )
    p.add_argument("--model", required=True, help="the served model name (what /v1/models lists)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--probes", help="probe file (JSON list, JSON lines or YAML); default: the packaged set")
    src.add_argument(
        "--probes-json", help="the probes inline, as a JSON list (what the role passes for a list)"
    )
    p.add_argument("--not-applicable-reason", default="", help="run and report, but do not fail: why not")
    p.add_argument("--api-key-env-file", help="KEY=VALUE file holding the server's API key (systemd style)")
    p.add_argument("--api-key-var", default="REGEN_SERVING_API_KEY", help="the key's name in that file")
    p.add_argument("--api-key-env", help="environment variable holding the API key")
    p.add_argument("--max-tokens", type=int, default=256, help="answer budget per probe (default 256)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per probe request (default 300)")
    p.add_argument(
        "--extra-body", default="", help="JSON object merged into every request (chat_template_kwargs)"
    )
    p.add_argument(
        "--tokenizer", help="model directory: also check that the tokenizer round-trips each answer"
    )
    logs = p.add_mutually_exclusive_group()
    logs.add_argument("--log-file", help="the server's log file, for the tail shown on failure")
    logs.add_argument("--unit", help="the server's systemd unit, for the tail shown on failure (journalctl)")
    p.add_argument(
        "--compute-capability", default="", help="GPU compute capability, e.g. 12.0 (for suggestions)"
    )
    p.add_argument(
        "--ep-size", type=int, default=None, help="expert-parallel size of the launch (for suggestions)"
    )
    p.add_argument(
        "--quantization", default="", help="checkpoint quantization, e.g. nvfp4, int4 (for suggestions)"
    )
    p.add_argument("--report", help="also write the verdict JSON to this file (atomically)")
    return p


def _api_key(a: argparse.Namespace) -> str | None:
    if a.api_key_env:
        value = os.environ.get(a.api_key_env)
        if not value:
            raise JobError(f"--api-key-env {a.api_key_env}: that environment variable is empty or unset")
        return value
    return serving_api_key(a.api_key_env_file, a.api_key_var)


def _probes(a: argparse.Namespace):
    try:
        if a.probes_json:
            try:
                data = json.loads(a.probes_json)
            except json.JSONDecodeError as exc:
                raise JobError(f"--probes-json is not valid JSON: {exc.msg}") from None
            return parse_probes(data, "--probes-json")
        return load_probes(a.probes)
    except ProbeError as exc:
        raise JobError(str(exc)) from None


def _tokenizer(path: str | None) -> Any:
    if not path:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise JobError("--tokenizer needs transformers in this venv (the job venv has it)") from None
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    except (OSError, ValueError) as exc:
        raise JobError(f"--tokenizer {path}: the tokenizer does not load: {exc}") from None


def read_log(a: argparse.Namespace) -> str:
    """The end of the server's log (file or journal); empty when there is none to read."""
    if a.log_file:
        return read_tail(a.log_file)
    if a.unit:
        try:
            out = subprocess.run(
                ["journalctl", "-u", a.unit, "-o", "cat", "--no-pager", "-n", "400"],
                capture_output=True,
                text=True,
                check=False,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout
    return ""


def explain_failure(verdict: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """Add the log tail, a known log failure and the suggestions for this setup to a failed verdict."""
    text = read_log(a)
    known = match_log(text) or diagnose(text)
    verdict["log_tail"] = tail(text, LOG_TAIL_LINES)
    verdict["log_cause"] = (
        {"kind": known.kind, "summary": known.summary, "hint": known.hint, "line": known.line}
        if known
        else None
    )
    suggestions = suggest_for_output(a.compute_capability or None, a.ep_size, a.quantization or None)
    verdict["suggestions"] = suggestions
    if suggestions:
        verdict["suggestion"] = "; ".join(f"{s['suggestion']} (reported: {s['source']})" for s in suggestions)
    else:
        verdict["suggestion"] = (
            "no public report matches this setup: compare with a layout known to answer well (another "
            "tp/ep size, a different quantization) and read the server log"
        )
    return verdict


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    extra: dict[str, Any] = {}
    if a.extra_body:
        try:
            extra = json.loads(a.extra_body)
        except json.JSONDecodeError as exc:
            raise JobError(f"--extra-body is not valid JSON: {exc.msg}") from None
        if not isinstance(extra, dict):
            raise JobError("--extra-body must be a JSON object")
    if a.max_tokens < 1:
        raise JobError("--max-tokens must be at least 1")
    probes = _probes(a)
    try:
        verdict = run_probes(
            a.endpoint,
            a.model,
            probes,
            api_key=_api_key(a),
            max_tokens=a.max_tokens,
            timeout=a.timeout,
            extra_body=extra,
            tokenizer=_tokenizer(a.tokenizer),
            not_applicable_reason=a.not_applicable_reason.strip() or None,
        )
    except GateError as exc:
        raise JobError(str(exc)) from None
    if verdict["verdict"] in ("fail", "unavailable"):
        verdict = explain_failure(verdict, a)
    if a.report:
        atomic_write_json(Path(a.report), verdict)
    print(json.dumps(verdict, ensure_ascii=False))
    head = {
        "pass": f"quality gate: pass ({verdict.get('passed')}/{verdict.get('total')} probes)",
        "not_applicable": f"quality gate: not applicable ({verdict['not_applicable_reason']})",
        "fail": f"quality gate: FAILED probes {', '.join(verdict['failed'])}",
        "unavailable": "quality gate: the endpoint did not answer",
    }[verdict["verdict"]]
    print(head, file=sys.stderr)
    for reason in verdict["reasons"]:
        print(f"  {reason}", file=sys.stderr)
    if verdict["verdict"] == "unavailable":
        return EXIT_UNAVAILABLE
    return EXIT_FAILED_RECORDS if verdict["verdict"] == "fail" else EXIT_OK


if __name__ == "__main__":
    sys.exit(run_main(main, own_process=True))
