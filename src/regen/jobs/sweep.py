"""The layout sweep's benchmark: measure one served layout, record one that failed, write the report.

    python -m regen.jobs.sweep measure --endpoint URL --model NAME --prompts PROMPTS --layout-json JSON
        --output FILE [--concurrency N ...] [--requests N] [--max-tokens N] [--client regen|sglang]
        [--sglang-python PY --tokenizer MODEL_DIR] [--chat-template-kwargs JSON] [--extra-body JSON]
        [--api-key-env-file FILE] [--estimate-json JSON] [--warmup N] [--timeout S]
    python -m regen.jobs.sweep failed --layout-json JSON --reason TEXT --output FILE
        [--status failed|infeasible] [--log-file FILE | --unit UNIT] [--estimate-json JSON]
    python -m regen.jobs.sweep report --results FILE [FILE ...] --output-dir DIR --inputs-json JSON
        --inputs-digest HEX [--max-ttft-ms MS] [--max-tpot-ms MS]

`measure` runs one fixed benchmark against a server that is up and passed the quality gate: the same
request mix (the first user turns of the prompt set, cycled to --requests per level, every answer capped
at --max-tokens, temperature 0) at each --concurrency. With `--client regen` (every server but SGLang) the
requests go through regen's generation client, streamed (`regen.serving.streaming`), so time to
first token is measured; with `--client sglang` SGLang's own `python -m sglang.benchmark.serving` runs
once per level on the same mix (its command lines are recorded). Each level records output tokens/s,
TTFT, TPOT and end-to-end latency percentiles (`regen.bench.stats`).
`failed` records a layout that could not be measured, with the diagnosis of its server log.
`report` joins the layout records into report.json, report.md and the PNG plots, with the recommended
layout and concurrency for the generate stage (`regen.bench.report`).

Each prints one JSON object on stdout (the role reads it). Exit codes: 0 done (a measured layout whose
requests all failed is still a record: `measure` exits 1); 2 bad arguments or input; 3 the endpoint did
not answer at all; 4 crashed; 5 the output cannot be written.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from regen.bench import report as report_mod
from regen.bench import sglang_bench
from regen.bench.stats import level_from_bench_serving, summarize_level
from regen.fsio import atomic_write_json, atomic_write_text
from regen.jobs._common import (
    EXIT_FAILED_RECORDS,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    JobError,
    decode_json_line,
    iter_lines,
    job_parser,
    run_main,
    serving_api_key,
    setup_logging,
)
from regen.jobs.generate.rows import BadRow, normalize_endpoint, parse_prompt_row, resolve_inputs, turn_plan
from regen.module_utils.regen_files import read_tail
from regen.serving.streaming import StreamError, stream_completion, streaming_body

# ------------------------------------------------------------------------------------------ inputs


def _json_arg(text: str | None, flag: str, default: Any = None) -> Any:
    if text is None or text == "":
        return default
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise JobError(f"{flag} is not valid JSON: {exc.msg}") from None


def _layout(text: str) -> dict[str, Any]:
    layout = _json_arg(text, "--layout-json")
    if not isinstance(layout, dict) or not isinstance(layout.get("name"), str) or not layout["name"]:
        raise JobError('--layout-json must be an object with a non-empty "name", e.g. {"name": "tp8-ep8"}')
    return layout


BUILTIN_DEMO = "builtin:demo"


def _prompt_files(paths: list[str]) -> list[Path]:
    """Files of the request mix; `builtin:demo` is the prompt set packaged with regen."""
    files: list[Path] = []
    for path in paths:
        if path == BUILTIN_DEMO:
            from importlib.resources import files as package_files

            files.append(Path(str(package_files("regen.data") / "demo_prompts.jsonl")))
        else:
            files.extend(resolve_inputs([path]))
    return files


def request_mix(paths: list[str], count: int) -> list[list[dict[str, str]]]:
    """The fixed request mix: each prompt's context up to its first assistant turn, cycled to `count`.

    The same rows in the same order every run, so two layouts (and two sweeps) answer the same requests.
    """
    mixes: list[list[dict[str, str]]] = []
    for path in _prompt_files(paths):
        for number, raw in iter_lines(path):
            obj, error = decode_json_line(raw)
            if error:
                raise JobError(f"{path}:{number}: {error}")
            if obj is None:
                continue
            try:
                _, conv = parse_prompt_row(obj)
            except BadRow as exc:
                raise JobError(f"{path}:{number}: {exc}") from None
            first = turn_plan(conv)[0]
            mixes.append([dict(turn) for turn in conv[:first]])
            if len(mixes) >= count:
                break
        if len(mixes) >= count:
            break
    if not mixes:
        raise JobError("the prompts hold no usable row; build the prompt set first (playbooks/prompts.yml)")
    return [mixes[i % len(mixes)] for i in range(count)]


# ------------------------------------------------------------------------------------------ measure


async def _run_level(
    url: str,
    headers: dict[str, str],
    base_body: dict[str, Any],
    mix: list[list[dict[str, str]]],
    concurrency: int,
    timeout: float,
) -> dict[str, Any]:
    import aiohttp

    records: list[dict[str, Any]] = []
    failures: list[str] = []
    queue = list(enumerate(mix))

    async def worker(session) -> None:
        while queue:
            _, messages = queue.pop(0)
            try:
                records.append(
                    await stream_completion(
                        session, url, streaming_body(base_body, messages), headers, timeout
                    )
                )
            except (StreamError, aiohttp.ClientError, OSError, TimeoutError) as exc:
                failures.append(f"{type(exc).__name__}: {exc}"[:300])

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, len(mix)))))
        duration = time.perf_counter() - started
    level = summarize_level(concurrency, records, duration, failures)
    level["tokens_counted_by"] = sorted({r["tokens_counted_by"] for r in records})
    return level


def _measure_regen(a: argparse.Namespace, mix, base_body, headers) -> tuple[list[dict[str, Any]], list[str]]:
    url = normalize_endpoint(a.endpoint)
    if a.warmup:
        # A fresh server's first requests pay for lazy initialization; they are not the layout's speed.
        asyncio.run(_run_level(url, headers, base_body, mix[: a.warmup], 1, a.timeout))
    levels = [asyncio.run(_run_level(url, headers, base_body, mix, c, a.timeout)) for c in a.concurrency]
    return levels, []


def _measure_sglang(a: argparse.Namespace, mix) -> tuple[list[dict[str, Any]], list[str]]:
    if not a.sglang_python or not a.tokenizer:
        raise JobError("--client sglang needs --sglang-python (the serving venv's python) and --tokenizer")
    levels, command_lines = [], []
    with tempfile.TemporaryDirectory(prefix="regen-sweep-") as tmp:
        dataset = Path(tmp) / "requests.sharegpt.json"
        sglang_bench.write_dataset(dataset, mix)
        for concurrency in a.concurrency:
            out = Path(tmp) / f"c{concurrency}.jsonl"
            argv = sglang_bench.bench_serving_argv(
                python=a.sglang_python,
                base_url=a.endpoint.rstrip("/"),
                served_model=a.model,
                tokenizer=a.tokenizer,
                dataset=str(dataset),
                num_prompts=len(mix),
                max_tokens=a.max_tokens,
                concurrency=concurrency,
                output_file=str(out),
            )
            command_lines.append(" ".join(argv))
            env = dict(os.environ)
            if a.api_key:
                env["OPENAI_API_KEY"] = a.api_key  # bench_serving sends it as the Bearer token
            done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
            if done.returncode != 0 or not out.exists():
                tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
                raise JobError(
                    f"sglang.benchmark.serving exited {done.returncode} at concurrency "
                    f"{concurrency}: {' | '.join(tail)}"
                )
            records = sglang_bench.read_results(out)
            level = level_from_bench_serving(records[-1])
            level["requests"] = len(mix)
            level["failed"] = max(0, len(mix) - level["completed"])
            levels.append(level)
    return levels, command_lines


def cmd_measure(a: argparse.Namespace) -> int:
    layout = _layout(a.layout_json)
    if not a.concurrency or any(c < 1 for c in a.concurrency):
        raise JobError("--concurrency must be given at least once, each >= 1")
    if a.requests < 1 or a.max_tokens < 1:
        raise JobError("--requests and --max-tokens must be >= 1")
    mix = request_mix(a.prompts, a.requests)
    a.api_key = serving_api_key(a.api_key_env_file)
    headers = {"Content-Type": "application/json"}
    if a.api_key:
        headers["Authorization"] = f"Bearer {a.api_key}"
    base_body: dict[str, Any] = {"model": a.model, "max_tokens": a.max_tokens, "temperature": 0.0}
    kwargs = _json_arg(a.chat_template_kwargs, "--chat-template-kwargs", {})
    if kwargs:
        base_body["chat_template_kwargs"] = kwargs
    base_body.update(_json_arg(a.extra_body, "--extra-body", {}) or {})
    if a.client == "sglang":
        levels, command_lines = _measure_sglang(a, mix)
        client = sglang_bench.MODULE
    else:
        levels, command_lines = _measure_regen(a, mix, base_body, headers)
        client = "regen.jobs.generate (streamed)"
    completed = sum(level["completed"] for level in levels)
    result = {
        "name": layout["name"],
        "settings": {k: v for k, v in layout.items() if k != "name"},
        "status": "measured" if completed else "failed",
        "reason": None
        if completed
        else "no request completed: "
        + "; ".join(sorted({f for level in levels for f in level.get("failures", [])})[:3]),
        "client": client,
        "command_lines": command_lines,
        "levels": levels,
        "estimate": _json_arg(a.estimate_json, "--estimate-json"),
    }
    atomic_write_json(a.output, result)
    print(
        json.dumps(
            {
                "output": str(a.output),
                "status": result["status"],
                "levels": [
                    {
                        "concurrency": lv["concurrency"],
                        "output_tokens_per_s": lv["output_tokens_per_s"],
                        "ttft_p50_ms": lv["ttft_ms"]["p50"],
                        "failed": lv["failed"],
                    }
                    for lv in levels
                ],
            }
        )
    )
    if not completed:
        return (
            EXIT_UNAVAILABLE
            if all(level["failed"] == level["requests"] for level in levels)
            else EXIT_FAILED_RECORDS
        )
    return EXIT_OK


# ------------------------------------------------------------------------------------------ failed


def _log_text(a: argparse.Namespace) -> str:
    if a.log_file and os.path.exists(a.log_file):
        return read_tail(a.log_file)
    if a.unit and shutil.which("journalctl"):
        done = subprocess.run(
            ["journalctl", "-u", a.unit, "-n", "400", "--no-pager", "-o", "cat"],
            capture_output=True,
            text=True,
            check=False,
        )
        return done.stdout if done.returncode == 0 else ""
    return ""


def cmd_failed(a: argparse.Namespace) -> int:
    from regen.serving.diagnose import diagnose, tail

    layout = _layout(a.layout_json)
    text = _log_text(a)
    cause = diagnose(text) if text else None
    result = {
        "name": layout["name"],
        "settings": {k: v for k, v in layout.items() if k != "name"},
        "status": a.status,
        "reason": " ".join(a.reason.split())[:2000],
        "diagnosis": (
            {"kind": cause.kind, "summary": cause.summary, "hint": cause.hint, "line": cause.line}
            if cause
            else None
        ),
        "log_tail": tail(text, 20) if text else [],
        "levels": [],
        "estimate": _json_arg(a.estimate_json, "--estimate-json"),
    }
    atomic_write_json(a.output, result)
    print(
        json.dumps(
            {
                "output": str(a.output),
                "status": a.status,
                "diagnosis": result["diagnosis"]["summary"] if cause else None,
            }
        )
    )
    return EXIT_OK


# ------------------------------------------------------------------------------------------ report


LAYOUT_STATUSES = ("measured", "failed", "infeasible")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def layout_record_problem(doc: Any) -> str | None:
    """What makes `doc` not a layout record `measure` or `failed` writes (None when it is one): the fields
    the report reads, with their types, so a damaged record is refused by name, never half-reported."""
    if not isinstance(doc, dict):
        return f"a JSON {type(doc).__name__}, not an object"
    if not isinstance(doc.get("name"), str) or not doc["name"]:
        return "no layout 'name'"
    if doc.get("status") not in LAYOUT_STATUSES:
        return f"'status' is {doc.get('status')!r}, not one of {', '.join(LAYOUT_STATUSES)}"
    if not isinstance(doc.get("levels"), list):
        return "'levels' is not a list"
    if doc.get("estimate") is not None and not isinstance(doc["estimate"], dict):
        return "'estimate' is neither an object nor null"
    for i, level in enumerate(doc["levels"]):
        if not isinstance(level, dict):
            return f"level {i} is not an object"
        concurrency = level.get("concurrency")
        if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
            return f"level {i}: 'concurrency' is {concurrency!r}, not a positive integer"
        if not _number(level.get("output_tokens_per_s")) or level["output_tokens_per_s"] < 0:
            rate = level.get("output_tokens_per_s")
            return f"level {i}: 'output_tokens_per_s' is {rate!r}, not a number >= 0"
        for key in ("completed", "failed"):
            if key in level and not (isinstance(level[key], int) and not isinstance(level[key], bool)):
                return f"level {i}: {key!r} is {level[key]!r}, not a count"
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            dist = level.get(key)
            if dist is not None and not (
                isinstance(dist, dict) and all(v is None or _number(v) for v in dist.values())
            ):
                return f"level {i}: {key!r} is not an object of numbers"
    return None


def cmd_report(a: argparse.Namespace) -> int:
    layouts = []
    for path in a.results:
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, RecursionError, ValueError) as exc:
            raise JobError(
                f"--results {path}: not a layout record ({type(exc).__name__}: {exc}); run `measure` or "
                "`failed` first"
            ) from None
        problem = layout_record_problem(doc)
        if problem:
            raise JobError(
                f"--results {path}: not a layout record ({problem}); measure that layout again (remove the "
                "file and run the sweep)"
            )
        layouts.append(doc)
    inputs = _json_arg(a.inputs_json, "--inputs-json", {})
    doc = report_mod.build_report(
        layouts,
        inputs=inputs,
        inputs_digest=a.inputs_digest,
        max_ttft_ms=a.max_ttft_ms,
        max_tpot_ms=a.max_tpot_ms,
    )
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = report_mod.write_plots(doc, out)
    atomic_write_text(out / "report.md", report_mod.render_markdown(doc))
    # report.json last: its presence says the report is whole (the role and the plan read it).
    atomic_write_json(out / "report.json", doc)
    print(
        json.dumps(
            {
                "output_dir": str(out),
                "files": ["report.json", "report.md", *files],
                "recommended": doc["recommended"],
            }
        )
    )
    return EXIT_OK


# ------------------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    p = job_parser("python -m regen.jobs.sweep", __doc__, status=False, progress=False)
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("measure", help="benchmark one served layout")
    m.add_argument("--endpoint", required=True, help="the server's base URL, e.g. http://127.0.0.1:30000")
    m.add_argument("--model", required=True, help="the served model name")
    m.add_argument(
        "--prompts",
        required=True,
        action="append",
        help="normalized prompts (file or the prompts job's directory); the first rows are the mix",
    )
    m.add_argument("--layout-json", required=True, help='the layout: {"name": ..., settings...}')
    m.add_argument("--output", required=True, type=Path, help="where the layout's record goes (JSON)")
    m.add_argument("--concurrency", type=int, action="append", help="requests in flight (repeat per level)")
    m.add_argument("--requests", type=int, default=8, help="requests per level (default 8)")
    m.add_argument("--max-tokens", type=int, default=256, help="answer budget per request (default 256)")
    m.add_argument("--warmup", type=int, default=1, help="requests sent before measuring (default 1)")
    m.add_argument("--timeout", type=float, default=1800.0, help="seconds per request (default 1800)")
    m.add_argument(
        "--client",
        choices=("regen", "sglang"),
        default="regen",
        help="regen: the generation client, streamed; sglang: python -m sglang.benchmark.serving",
    )
    m.add_argument("--sglang-python", help="python with SGLang (for --client sglang)")
    m.add_argument("--tokenizer", help="model directory bench_serving counts tokens with (--client sglang)")
    m.add_argument("--chat-template-kwargs", help="JSON object sent as chat_template_kwargs (the plan's)")
    m.add_argument("--extra-body", help="JSON object merged into every request body")
    m.add_argument("--api-key-env-file", help="KEY=VALUE file holding REGEN_SERVING_API_KEY")
    m.add_argument("--estimate-json", help="the simulator's estimate for this layout, recorded beside it")
    m.set_defaults(func=cmd_measure)

    f = sub.add_parser("failed", help="record a layout that could not be measured")
    f.add_argument("--layout-json", required=True)
    f.add_argument("--reason", required=True, help="what went wrong (the failed task's message)")
    f.add_argument("--output", required=True, type=Path)
    f.add_argument("--status", choices=("failed", "infeasible"), default="failed")
    f.add_argument("--log-file", help="the server's log file (process mode; read when it exists)")
    f.add_argument("--unit", help="the server's systemd unit (its journal is read when there is no log file)")
    f.add_argument("--estimate-json")
    f.set_defaults(func=cmd_failed)

    r = sub.add_parser("report", help="write report.json, report.md and the plots")
    r.add_argument("--results", required=True, nargs="+", help="the layout records, in sweep order")
    r.add_argument("--output-dir", required=True)
    r.add_argument("--inputs-json", help="what the sweep measured with, recorded in the report")
    r.add_argument("--inputs-digest", required=True, help="digest of those inputs (reuse key)")
    r.add_argument("--max-ttft-ms", type=float, help="recommend only levels whose p90 TTFT is within this")
    r.add_argument("--max-tpot-ms", type=float, help="recommend only levels whose p90 TPOT is within this")
    r.set_defaults(func=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    setup_logging(a.log_level, a.log_format)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(run_main(main))
