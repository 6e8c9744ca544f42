"""Command line of the generation job (`python -m regen.jobs.generate`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from pathlib import Path

from regen.jobs._common import (
    EXIT_OK,
    JobError,
    job_parser,
    json_object_arg,
    serving_api_key,
    setup_logging,
    stop_on_sigterm,
    want_progress,
)
from regen.jobs.generate.job import GenerateJob, Settings, dry_run
from regen.jobs.generate.rows import RESERVED_BODY_KEYS, normalize_endpoint
from regen.quality.detector import add_rolling_arguments, rolling_from_args

log = logging.getLogger("regen.jobs.generate")

# ==================================================================================================
# CLI
# ==================================================================================================


def _package_doc() -> str | None:
    from regen.jobs import generate

    return generate.__doc__


def build_parser() -> argparse.ArgumentParser:
    p = job_parser("python -m regen.jobs.generate", _package_doc(), status=True, progress=True)
    io = p.add_argument_group("input and output")
    io.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="PROMPTS",
        help="normalized prompt JSONL file or the prompts job's directory (repeatable)",
    )
    io.add_argument("--output-dir", required=True, type=Path)
    io.add_argument("--shard-records", type=int, default=100_000, help="records per output shard")
    io.add_argument(
        "--no-fsync",
        dest="fsync",
        action="store_false",
        help="skip fsync (survives a killed process, not a power loss)",
    )
    io.add_argument(
        "--dry-run",
        action="store_true",
        help="print what a run would do (JSON: pending, done, config_matches) and write nothing",
    )
    io.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume an output directory made with other settings: completions made with another model, "
        "max tokens, sampling, chat-template kwargs or reasoning mode move to superseded.jsonl and are "
        "generated again; a changed --truncated policy applies to new completions",
    )

    srv = p.add_argument_group("server")
    srv.add_argument(
        "--endpoint",
        action="append",
        metavar="URL",
        help="server base URL, with or without /v1 (repeatable; or one router URL)",
    )
    srv.add_argument(
        "--endpoints-file",
        type=Path,
        metavar="PATH",
        help="file with more endpoint URLs, one a line (mode 0600: for URLs that carry a password, which "
        "a command line would show to every user)",
    )
    srv.add_argument("--model", required=True, help="model name the server serves")
    key = srv.add_mutually_exclusive_group()
    key.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API key")
    key.add_argument(
        "--api-key-env-file",
        type=Path,
        metavar="PATH",
        help="0600 KEY=VALUE file holding REGEN_SERVING_API_KEY, as the serve stage writes it (the way the "
        "pipeline hands every job the key)",
    )
    key.add_argument(
        "--api-key-file",
        type=Path,
        metavar="PATH",
        help="file holding the API key (mode 0600; kept off the command line and out of the environment)",
    )
    srv.add_argument("--concurrency", type=int, default=64, help="requests in flight per endpoint")
    srv.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    srv.add_argument(
        "--stop-grace",
        type=float,
        default=30.0,
        metavar="S",
        help="after SIGTERM/SIGINT, seconds requests in flight may take to finish before they are cut "
        "(their prompts stay pending); a second signal cuts them at once (default 30)",
    )

    gen = p.add_argument_group("generation")
    gen.add_argument("--max-tokens", type=int, default=4096)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument(
        "--extra-body",
        default="{}",
        metavar="JSON",
        help="more request fields, e.g. '{\"top_k\": 20}' (only what the server accepts)",
    )
    gen.add_argument(
        "--chat-template-kwargs",
        default="{}",
        metavar="JSON",
        help="sent as chat_template_kwargs, e.g. '{\"thinking\": true}' (Kimi) or "
        "'{\"enable_thinking\": false}' (Qwen3); take it from the model facts",
    )
    gen.add_argument(
        "--reasoning",
        choices=("field", "inline"),
        default="field",
        help="keep the server's reasoning_content in its own field, or inline as <think>...</think>",
    )
    gen.add_argument(
        "--truncated",
        choices=("keep", "drop"),
        default="keep",
        help="finish_reason=length completions: keep (flagged truncated) or move to dropped-*.jsonl",
    )
    gen.add_argument("--keep-truncated", dest="truncated", action="store_const", const="keep")
    gen.add_argument("--drop-truncated", dest="truncated", action="store_const", const="drop")
    gen.add_argument("--seed", type=int, help="seed for retry jitter (tests)")

    f = p.add_argument_group("faults")
    f.add_argument("--max-retries", type=int, default=8, help="retries per request (circuit pauses are free)")
    f.add_argument("--backoff-base", type=float, default=1.0)
    f.add_argument("--backoff-max", type=float, default=60.0)
    f.add_argument("--retry-after-max", type=float, default=300.0, help="cap on a server's Retry-After")
    f.add_argument(
        "--circuit-threshold", type=int, default=3, help="consecutive failures that open a circuit"
    )
    f.add_argument(
        "--circuit-cooldown", type=float, default=2.0, help="first pause of an open circuit (doubles)"
    )
    f.add_argument("--circuit-cooldown-max", type=float, default=60.0)
    f.add_argument(
        "--max-outage",
        type=float,
        default=1800.0,
        help="stop (exit 3) when every endpoint has been down this long",
    )
    add_rolling_arguments(p)
    p.add_argument(
        "--judge-workers",
        type=int,
        default=1,
        help="worker processes that run the degeneration checks of the answers, off the event loop "
        "(0: in the event loop; default 1)",
    )
    return p


def settings_from_args(a: argparse.Namespace) -> Settings:
    if a.concurrency < 1:
        raise JobError("--concurrency must be at least 1")
    if a.max_tokens < 1:
        raise JobError("--max-tokens must be at least 1")
    if a.stop_grace < 0:
        raise JobError("--stop-grace must be 0 or more seconds")
    if a.judge_workers < 0:
        raise JobError("--judge-workers must be 0 (the checks run in the event loop) or more")
    try:
        rolling_from_args(a)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    api_key = source = None
    if a.api_key_env:
        api_key = os.environ.get(a.api_key_env)
        source = f"the environment variable {a.api_key_env} (--api-key-env)"
        if not api_key:
            raise JobError(
                f"environment variable {a.api_key_env} (named by --api-key-env) is not set or empty"
            )
    elif a.api_key_env_file and not a.dry_run:  # the dry run sends nothing (check mode writes no file)
        source = f"{a.api_key_env_file} (--api-key-env-file)"
        api_key = serving_api_key(str(a.api_key_env_file))
    elif a.api_key_file and not a.dry_run:  # the dry run sends nothing (and check mode writes no key file)
        source = f"{a.api_key_file} (--api-key-file)"
        try:
            api_key = a.api_key_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise JobError(f"--api-key-file {a.api_key_file} cannot be read: {exc.strerror or exc}") from None
        if not api_key:
            raise JobError(f"--api-key-file {a.api_key_file} is empty; write the server's API key into it")
    extra = json_object_arg(a.extra_body, "--extra-body")
    clash = RESERVED_BODY_KEYS & set(extra)
    if clash:
        raise JobError(f"--extra-body may not set {sorted(clash)}; use the dedicated flags")
    endpoints = list(a.endpoint or [])
    if (
        a.endpoints_file is not None and not a.dry_run
    ):  # the dry run sends nothing (check mode writes no file)
        try:
            text = a.endpoints_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise JobError(
                f"--endpoints-file {a.endpoints_file} cannot be read: {exc.strerror or exc}"
            ) from None
        endpoints += [line.strip() for line in text.splitlines() if line.strip()]
    # The dry run asks no server: the generate role's pending step runs it before the serve stage has
    # started (or recorded) one.
    if not endpoints and not a.dry_run:
        raise JobError("no server to ask: give at least one --endpoint URL (or an --endpoints-file)")
    for url in endpoints:
        normalize_endpoint(url)
    return Settings(
        inputs=a.input,
        output_dir=a.output_dir,
        endpoints=endpoints,
        model=a.model,
        concurrency=a.concurrency,
        max_tokens=a.max_tokens,
        api_key=api_key,
        api_key_source=source,
        temperature=a.temperature,
        top_p=a.top_p,
        extra_body=extra,
        chat_template_kwargs=json_object_arg(a.chat_template_kwargs, "--chat-template-kwargs"),
        reasoning=a.reasoning,
        truncated=a.truncated,
        max_retries=a.max_retries,
        request_timeout=a.request_timeout,
        backoff_base=a.backoff_base,
        backoff_max=a.backoff_max,
        retry_after_max=a.retry_after_max,
        circuit_threshold=a.circuit_threshold,
        circuit_cooldown=a.circuit_cooldown,
        circuit_cooldown_max=a.circuit_cooldown_max,
        max_outage=a.max_outage,
        status_file=a.status_file or (a.output_dir / "status.json"),
        status_interval=a.status_interval,
        progress=want_progress(a.progress),
        shard_records=a.shard_records,
        fsync=a.fsync,
        allow_config_change=a.allow_config_change,
        seed=a.seed,
        stop_grace=a.stop_grace,
        degenerate_window=a.degenerate_window,
        degenerate_threshold=a.degenerate_threshold,
        degenerate_min_samples=a.degenerate_min_samples,
        judge_workers=a.judge_workers,
    )


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    # SIGTERM before the run loop takes it over (while the inputs are checked and the ledger opened)
    # unwinds like Ctrl-C: exit 143, status.json `interrupted`, instead of dying with the last run's status
    stop_on_sigterm()
    setup_logging(a.log_level, a.log_format)
    s = settings_from_args(a)
    if a.dry_run:
        print(json.dumps(dry_run(s)))
        return EXIT_OK
    return asyncio.run(GenerateJob(s).run())
