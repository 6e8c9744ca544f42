"""Evaluate a DFlash drafter through served targets: the same report as the CPU reference, from SGLang.

    python -m regen.jobs.evaluate_serving plan   INPUTS
    python -m regen.jobs.evaluate_serving run    INPUTS --server plain|dflash --endpoint URL
        [--api native|openai] [--model NAME] [--api-key-env-file FILE] [--launch-json JSON]
        [--warmup N] [--timeout S]
    python -m regen.jobs.evaluate_serving report INPUTS [--tie-tolerance NATS] [--force]

    INPUTS: --target-model DIR --checkpoint DRAFTER_DIR --prompts PATH --output-dir DIR
        [--max-prompts N] [--max-new-tokens N] [--prompt-max-tokens N] [--chat-template-kwargs JSON]
        [--thinking-switch NAME --turn-kinds thinking,non-thinking] [--seed S]
        [--concurrency 1 --concurrency 16] [--servers-json JSON] [--no-tie-probe]

The evaluate role (drafter_evaluation_backend: sglang) serves the target twice through the serving role,
one server after the other in the same layout: alone (`plain`), then with the trained drafter (`dflash`,
`--speculative-algorithm DFLASH`). Against each it runs `run`, which sends the held-out prompts (the same
seeded selection and chat-template rendering as `regen.jobs.evaluate`) to SGLang's native `/generate`:
the prompt as token ids, greedy, `--max-new-tokens`, the target's stop tokens; first one request at a time
(concurrency 1, each request timed), then every prompt at once through a limit of the batch
`--concurrency` (the level's wall time). Each answer's output token ids, timing and SGLang's speculative
metadata (`spec_verify_ct`, `spec_correct_drafts_histogram`, ...) go to `results.jsonl` as it arrives,
once per server, setting and prompt (and turn kind): a killed run resumes with what is missing. On the
plain server an untimed tie probe follows (the same prompts with the two likeliest tokens per position),
which tells a near tie from a real difference when an output differs.

`report` merges both servers' records into `report.json`/`report.md` (`regen.evaluate.report`, the CPU
reference's fields): the trained drafter's acceptance length with its 95% interval and by position from
SGLang's histograms, the speedup at concurrency 1 and at the batch setting, and `lossless` from the
token-for-token comparison at every setting. `plan` only reads: which server still has requests to send,
and whether the report is up to date (the role's `changed=0`).

Each server's records carry a digest of what decides them (settings, target and drafter files, prompts,
the server's launch settings, `--servers-json`); records of another digest are redone. Acceptance comes
only from SGLang's metadata: `--api openai` (`/v1/completions`, for servers without `/generate`, such as
the CPU demo's `transformers serve`) records outputs and timings, never acceptance, and `report` refuses a
speculative run made that way.

Exit codes: 0 done; 1 some requests failed (run again to retry them) or, for `report`, a speculative
output differed from the plain one (see report.md); 2 bad input; 3 the endpoint did not answer; 4 crashed;
5 the output cannot be written.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from regen.status import RUNNING_STATES, Status

from .. import __version__
from ..evaluate import serving as S
from ..fsio import atomic_write_bytes, atomic_write_json
from ..module_utils.regen_net import redact_url
from ._common import (
    EXIT_FAILED_RECORDS,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    DirectoryLock,
    JobError,
    StatusFile,
    canonical_json,
    decode_json_line,
    iter_lines,
    job_parser,
    kv,
    make_progress,
    prepare_output_dir,
    run_main,
    serving_api_key,
    setup_logging,
    want_progress,
)
from ._evaluation import add_evaluation_inputs, load_prompts
from .evaluate import exit_if_report_current, files_digest, load_json_object, turn_kinds

log = logging.getLogger("regen.jobs.evaluate_serving")

# Bumped when what a record means changes, so old records are not mixed with new ones.
METHOD = "sglang-native-generate/1"
SERVERS = ("plain", "dflash")
TOP_LOGPROBS = 2


class EndpointDown(JobError):
    """The server did not answer at all."""

    exit_code = EXIT_UNAVAILABLE


# --------------------------------------------------------------------------------------------------
# Inputs and digests
# --------------------------------------------------------------------------------------------------


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError as exc:
        raise JobError(f"{flag} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise JobError(f"{flag} must be a JSON object")
    return value


def drafter_summary(checkpoint: Path) -> dict[str, Any]:
    """The exported drafter's block size and shape, from its config.json (no torch needed)."""
    path = checkpoint / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise JobError(
            f"{path} cannot be read ({exc}): pass the drafter directory `specforge export --to hf` wrote "
            "(the train stage's <run>/export), or -e evaluate_checkpoint=PATH"
        ) from None
    block = config.get("block_size") if isinstance(config, dict) else None
    if not isinstance(block, int) or block < 2:
        raise JobError(f"{path} has no block_size of 2 or more: it is not a DFlash drafter config")
    dflash = config.get("dflash_config") or {}
    return {
        "block_size": block,
        "num_hidden_layers": config.get("num_hidden_layers"),
        "target_layer_ids": dflash.get("target_layer_ids"),
        "mask_token_id": dflash.get("mask_token_id"),
    }


class Inputs:
    """Everything `plan`, `run` and `report` agree on: prompts, settings, and one digest per server."""

    def __init__(self, a: argparse.Namespace):
        if a.max_prompts < 1 or a.max_new_tokens < 1 or a.prompt_max_tokens < 1:
            raise JobError("--max-prompts, --max-new-tokens and --prompt-max-tokens must be at least 1")
        levels = sorted(set(a.concurrency or [1]))
        if levels[0] < 1 or 1 not in levels:
            raise JobError("--concurrency: give 1 (the report's speedup) and the batch setting, each >= 1")
        if not (a.target_model / "config.json").is_file():
            raise JobError(
                f"{a.target_model} has no config.json: pass the target model directory (--target-model)"
            )
        self.args = a
        self.levels = levels
        self.drafter = drafter_summary(a.checkpoint)
        self.block_size = int(self.drafter["block_size"])
        self.prompts = load_prompts(a.prompts, a.max_prompts, a.seed)
        self.kinds = turn_kinds(a.chat_template_kwargs, a.thinking_switch, a.turn_kinds)
        self.servers = _json_object(a.servers_json, "--servers-json")
        unknown = sorted(set(self.servers) - set(SERVERS))
        if unknown:
            raise JobError(f"--servers-json names {', '.join(unknown)}: only plain and dflash are served")
        self.settings = {
            "method": METHOD,
            "backend": "sglang",
            "max_prompts": a.max_prompts,
            "max_new_tokens": a.max_new_tokens,
            "prompt_max_tokens": a.prompt_max_tokens,
            "seed": a.seed,
            "turn_kinds": self.kinds,
            "concurrencies": levels,
            "tie_probe": a.tie_probe,
            "prompts_source": str(a.prompts),
        }
        prompts_digest = hashlib.sha256(canonical_json(self.prompts)).hexdigest()
        target_digest = files_digest(
            a.target_model, ("config.json", "*.safetensors", "*.py", "*.model", "*.json")
        )
        checkpoint_digest = files_digest(a.checkpoint, ("config.json", "*.safetensors"))
        self.inputs = {
            "target_model": str(a.target_model),
            "target_digest": target_digest,
            "checkpoint": str(a.checkpoint),
            "checkpoint_digest": checkpoint_digest,
            "drafter": self.drafter,
            "prompts_digest": prompts_digest,
            "prompt_ids": [p["id"] for p in self.prompts],
            "servers": self.servers,
        }
        common = {k: v for k, v in self.settings.items() if k != "prompts_source"}
        self.digests = {
            name: hashlib.sha256(
                canonical_json(
                    {
                        "settings": common,
                        "target": target_digest,
                        "prompts": prompts_digest,
                        "server": name,
                        "identity": self.servers.get(name) or {},
                        "checkpoint": checkpoint_digest if name == "dflash" else None,
                    }
                )
            ).hexdigest()
            for name in SERVERS
        }

    def expected(self, server: str) -> list[tuple[str, str, str, str]]:
        """Every (server, setting, prompt, turn kind) the server's run must record."""
        settings = [f"c{c}" for c in self.levels]
        if server == "plain" and self.args.tie_probe:
            settings.append("probe")
        return [(server, s, p["id"], k) for s in settings for k in self.kinds for p in self.prompts]

    def report_digest(self, tie_tolerance: float) -> str:
        return hashlib.sha256(
            canonical_json({"digests": self.digests, "tie_tolerance": tie_tolerance, "method": METHOD})
        ).hexdigest()


# --------------------------------------------------------------------------------------------------
# The results file
# --------------------------------------------------------------------------------------------------


class Results:
    """results.jsonl: `request` lines (one per server, setting, prompt and turn kind), `segment` lines (the
    wall time of a level's run) and `server` lines (the launch line a run was made against), each with its
    server's digest. Opening it for one server drops that server's lines of another digest and a torn last
    line, and leaves the other server's lines as they are."""

    def __init__(self, path: Path, digests: dict[str, str], rewrite_for: str | None = None):
        self.path = path
        self.digests = digests
        self.lines: list[dict[str, Any]] = []
        if path.exists():
            for _, raw in iter_lines(path):
                row, err = decode_json_line(raw)
                if err or not isinstance(row, dict) or row.get("server") not in SERVERS:
                    continue
                if (
                    rewrite_for is not None
                    and row["server"] == rewrite_for
                    and row.get("digest") != digests[rewrite_for]
                ):
                    continue
                self.lines.append(row)
        if rewrite_for is not None:
            atomic_write_bytes(path, b"".join(json.dumps(r).encode() + b"\n" for r in self.lines))

    def current(self, kind: str) -> list[dict[str, Any]]:
        return [
            r for r in self.lines if r.get("kind") == kind and r.get("digest") == self.digests[r["server"]]
        ]

    def done(self) -> set[tuple[str, str, str, str]]:
        return {S.request_key(r) for r in self.current("request")}

    def add(self, row: dict[str, Any]) -> None:
        row = {**row, "digest": self.digests[row["server"]]}
        with open(self.path, "ab") as fh:
            fh.write(json.dumps(row).encode() + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.lines.append(row)


# --------------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------------


def cmd_plan(a: argparse.Namespace) -> int:
    inputs = Inputs(a)
    results = Results(a.output_dir / "results.jsonl", inputs.digests)
    done = results.done()
    pending = {name: sum(1 for k in inputs.expected(name) if k not in done) for name in SERVERS}
    report = load_json_object(a.output_dir / "report.json")
    up_to_date = bool(report) and report.get("inputs_digest") == inputs.report_digest(a.tie_tolerance)
    print(
        json.dumps(
            {
                "report_up_to_date": up_to_date and not a.force,
                "pending": pending,
                "requests": {name: len(inputs.expected(name)) for name in SERVERS},
                "block_size": inputs.block_size,
                "prompts": len(inputs.prompts),
                "digests": inputs.digests,
                "report": str(a.output_dir / "report.json"),
            }
        )
    )
    return EXIT_OK


# --------------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------------


class Renderer:
    """The prompts as the CPU reference renders them: the target's chat template with each turn kind's
    variables, the last --prompt-max-tokens tokens kept; and the target's stop tokens."""

    def __init__(self, model_dir: Path, limit: int, trust_remote_code: bool):
        from transformers import AutoTokenizer, GenerationConfig

        from .evaluate import stop_ids

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        try:
            eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
        except OSError:
            eos = None
        self.stop_ids = stop_ids(self.tokenizer, eos)
        self.limit = limit

    def render(self, turns: list[dict[str, str]], kwargs: dict[str, Any]) -> tuple[list[int], str]:
        from .evaluate import _tokenize

        ids = _tokenize(self.tokenizer, turns, self.limit, kwargs)
        text = self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **kwargs)
        full = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids, text if len(full) == len(ids) else self.tokenizer.decode(ids)


async def _post(session: Any, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float) -> Any:
    import aiohttp

    async with session.post(
        url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as resp:
        text = await resp.text()
        if resp.status == 404 and url.endswith("/generate"):
            raise JobError(
                f"{redact_url(url)} answers 404: this server has no SGLang native /generate. Acceptance "
                "and token ids come only from SGLang; for the plain baseline of an OpenAI-compatible server "
                "use --api openai"
            )
        if resp.status != 200:
            raise S.ResponseError(f"HTTP {resp.status}: {text[:300]}")
        try:
            return json.loads(text)
        except ValueError:
            raise S.ResponseError(f"the answer is not JSON: {text[:200]!r}") from None


class Client:
    """One server's requests: bodies, posting, parsing, and the checks that the server is what it claims."""

    def __init__(self, a: argparse.Namespace, renderer: Renderer):
        self.a = a
        self.renderer = renderer
        self.url = S.endpoint_url(a.endpoint, a.api)
        # What messages, logs and the 0644 status file show: a password in the URL never leaves memory.
        self.shown_url = redact_url(self.url)
        key = serving_api_key(a.api_key_env_file)
        self.headers = {
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {key}"} if key else {}),
        }

    def body(self, ids: list[int], text: str, *, probe: bool) -> dict[str, Any]:
        if self.a.api == "openai":
            return S.completion_body(text, model=self.a.model, max_new_tokens=self.a.max_new_tokens)
        return S.generate_body(
            ids,
            max_new_tokens=self.a.max_new_tokens,
            stop_ids=self.renderer.stop_ids,
            top_logprobs=TOP_LOGPROBS if probe else 0,
        )

    async def ask(self, session: Any, ids: list[int], text: str, *, probe: bool = False) -> dict[str, Any]:
        import aiohttp

        started = time.perf_counter()
        try:
            doc = await _post(
                session, self.url, self.body(ids, text, probe=probe), self.headers, self.a.timeout
            )
        except aiohttp.ClientConnectorError as exc:
            raise EndpointDown(
                f"nothing answers at {self.shown_url} ({exc}): is the {self.a.server} server up? (the "
                "evaluate role starts it through the serving role)"
            ) from None
        seconds = time.perf_counter() - started
        if self.a.api == "openai":
            record = S.parse_completion_response(doc)
        else:
            record = S.parse_generate_response(doc, want_top=probe)
        record["seconds"] = round(seconds, 6)
        self._check_kind(record)
        return record

    def _check_kind(self, record: dict[str, Any]) -> None:
        if self.a.api != "native":
            return
        if self.a.server == "plain" and record["spec"]:
            raise JobError(
                f"the server at {self.shown_url} decodes speculatively (its /generate answers carry "
                "spec_verify_ct): the plain baseline needs the target served without --speculative-algorithm"
            )
        if self.a.server == "dflash" and not record["spec"] and record["completion_tokens"] > 1:
            raise JobError(
                f"the server at {self.shown_url} does not decode speculatively (no spec_verify_ct in "
                "/generate's meta_info): is it the one launched with --speculative-algorithm DFLASH?"
            )


def cmd_run(a: argparse.Namespace) -> int:
    if a.server not in SERVERS:
        raise JobError(f"--server {a.server!r}: plain or dflash")
    if a.api == "openai" and not a.model:
        raise JobError("--api openai needs --model (the served model name /v1/models answers)")
    if a.api == "openai" and a.server == "plain" and a.tie_probe:
        raise JobError(
            "the tie probe asks for the two likeliest tokens per position, which only SGLang's /generate "
            "gives here: pass --no-tie-probe with --api openai (differences are then never called near ties)"
        )
    if a.api == "openai" and a.server == "dflash":
        raise JobError(
            "acceptance comes only from SGLang's metadata: the dflash server must be SGLang, asked through "
            "its native /generate (--api native)"
        )
    inputs = Inputs(a)
    out = prepare_output_dir(a.output_dir)
    with DirectoryLock(out, "evaluate_serving"):
        return _run(a, inputs, out)


def _run(a: argparse.Namespace, inputs: Inputs, out: Path) -> int:
    results = Results(out / "results.jsonl", inputs.digests, rewrite_for=a.server)
    expected = inputs.expected(a.server)
    todo = [k for k in expected if k not in results.done()]
    status = StatusFile(a.status_file or out / "status.json", interval=a.status_interval)
    began = time.monotonic()
    failures: list[str] = []

    def progress(state: str, error: str | None = None) -> dict[str, Any]:
        done = len([k for k in expected if k in results.done()])
        ended = state not in RUNNING_STATES
        return Status(
            job="evaluate_serving",
            state=state,
            item="request",
            line=f"evaluate_serving: server={a.server} state={state} requests={done}/{len(expected)}",
            done=done,
            total=len(expected),
            failed=len(failures),
            exit_code=(EXIT_OK if state == "done" else EXIT_FAILED_RECORDS) if ended else None,
            error=error,
        ).document(
            elapsed_s=round(time.monotonic() - began, 1), server=a.server, endpoint=redact_url(a.endpoint)
        )

    status.maybe_write(lambda: progress("starting"), force=True)
    status.arm()
    if a.launch_json:
        launch = _json_object(a.launch_json, "--launch-json")
        known = [r for r in results.current("server") if r["server"] == a.server]
        if not known or known[-1].get("launch") != launch:
            results.add({"kind": "server", "server": a.server, "launch": launch})
    if not todo:
        log.info("nothing to send: every request of this server is recorded", extra=kv(server=a.server))
        status.disarm()
        status.maybe_write(lambda: progress("done"), force=True, durable=True)
        print(json.dumps({"changed": False, "server": a.server, "sent": 0, "failed": 0}))
        return EXIT_OK

    renderer = Renderer(a.target_model, a.prompt_max_tokens, not a.no_trust_remote_code)
    client = Client(a, renderer)
    by_id = {p["id"]: p for p in inputs.prompts}
    rendered: dict[tuple[str, str], tuple[list[int], str]] = {}

    def prompt(pid: str, kind: str) -> tuple[list[int], str]:
        if (pid, kind) not in rendered:
            rendered[(pid, kind)] = renderer.render(by_id[pid]["turns"], inputs.kinds[kind])
        return rendered[(pid, kind)]

    bar = make_progress(want_progress(a.progress), len(todo), f"evaluate {a.server}", unit="req")
    sent = 0

    async def level(session: Any, setting: str, keys: list[tuple[str, str, str, str]], limit: int) -> None:
        nonlocal sent
        queue = list(keys)
        tokens = 0
        completed = 0

        async def worker() -> None:
            nonlocal tokens, completed, sent
            while queue:
                key = queue.pop(0)
                _, _, pid, kind = key
                ids, text = prompt(pid, kind)
                try:
                    record = await client.ask(session, ids, text, probe=setting == "probe")
                except (S.ResponseError, TimeoutError, OSError) as exc:
                    failures.append(f"{setting} {pid} {kind}: {exc}")
                    log.error(
                        "request failed",
                        extra=kv(server=a.server, setting=setting, prompt=pid, error=str(exc)),
                    )
                    continue
                except Exception as exc:
                    import aiohttp

                    if not isinstance(exc, aiohttp.ClientError):
                        raise
                    failures.append(f"{setting} {pid} {kind}: {type(exc).__name__}: {exc}")
                    continue
                tokens += int(record["completion_tokens"])
                completed += 1
                sent += 1
                results.add(
                    {
                        "kind": "request",
                        "server": a.server,
                        "setting": setting,
                        "concurrency": limit,
                        "prompt_id": pid,
                        "turn_kind": kind,
                        "category": by_id[pid]["category"],
                        "prompt_tokens": len(ids),
                        "api": a.api,
                        **record,
                    }
                )
                if bar is not None:
                    bar.update(1)
                status.maybe_write(lambda: progress("running"))

        started = time.perf_counter()
        try:
            await asyncio.gather(*(worker() for _ in range(min(limit, len(keys)))))
        finally:
            if setting != "probe" and completed:
                results.add(
                    {
                        "kind": "segment",
                        "server": a.server,
                        "setting": setting,
                        "concurrency": limit,
                        "requests": completed,
                        "tokens": tokens,
                        "seconds": round(time.perf_counter() - started, 6),
                        "complete": completed == len(keys),
                    }
                )
        log.info(
            "level done",
            extra=kv(server=a.server, setting=setting, requests=completed, of=len(keys), tokens=tokens),
        )

    async def everything() -> None:
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            # Untimed: a fresh server's first requests pay for lazy initialisation, not decoding.
            first = todo[0]
            for _ in range(a.warmup):
                try:
                    await client.ask(session, *prompt(first[2], first[3]))
                except (S.ResponseError, TimeoutError) as exc:
                    raise EndpointDown(f"the warm-up request to {client.shown_url} failed: {exc}") from None
            for c in inputs.levels:
                keys = [k for k in todo if k[1] == f"c{c}"]
                if keys:
                    await level(session, f"c{c}", keys, c)
            keys = [k for k in todo if k[1] == "probe"]
            if keys:
                await level(session, "probe", keys, max(inputs.levels))

    status.maybe_write(lambda: progress("running"), force=True)
    try:
        asyncio.run(everything())
    finally:
        if bar is not None:
            bar.close()
    status.disarm()
    state = "done" if not failures else "failed"
    error = f"{len(failures)} request(s) failed; run again to retry them: {failures[0]}" if failures else None
    status.maybe_write(lambda: progress(state, error), force=True, durable=True)
    line = {"changed": sent > 0, "server": a.server, "sent": sent, "failed": len(failures)}
    print(json.dumps(line))
    return EXIT_OK if not failures else EXIT_FAILED_RECORDS


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------


def cmd_report(a: argparse.Namespace) -> int:
    from ..evaluate.report import draw_plots, headline, render_markdown
    from ..evaluate.sglang_acceptance import AcceptanceError

    inputs = Inputs(a)
    out = prepare_output_dir(a.output_dir)
    digest = inputs.report_digest(a.tie_tolerance)
    report_path = out / "report.json"
    current = exit_if_report_current(report_path, digest, a.force)
    if current is not None:
        return current
    with DirectoryLock(out, "evaluate_serving"):
        results = Results(out / "results.jsonl", inputs.digests)
        done = results.done()
        for name in SERVERS:
            missing = [k for k in inputs.expected(name) if k not in done]
            if missing:
                raise JobError(
                    f"the {name} server's records are incomplete ({len(missing)} of "
                    f"{len(inputs.expected(name))} requests missing, e.g. {missing[0][1]} "
                    f"{missing[0][2]}): run `run --server {name}` against it first (it resumes)"
                )
        requests = results.current("request")
        if any(r.get("api") != "native" for r in requests if r["server"] == "dflash"):
            raise JobError(
                "the dflash records were not made through SGLang's /generate: acceptance needs its metadata"
            )
        try:
            merged = S.merge(
                requests,
                results.current("segment"),
                block_size=inputs.block_size,
                concurrencies=inputs.levels,
                tie_tolerance=a.tie_tolerance,
            )
        except AcceptanceError as exc:
            raise JobError(str(exc)) from None
        servers = {name: dict(ident) for name, ident in inputs.servers.items()}
        for row in results.current("server"):
            servers.setdefault(row["server"], {})["command_line"] = (row.get("launch") or {}).get(
                "command_line"
            )
        settings = dict(inputs.settings, notes=list(a.note or []))
        report = S.gpu_report(
            merged,
            block_size=inputs.block_size,
            settings=settings,
            inputs=dict(inputs.inputs, servers=servers),
        )
        report["inputs_digest"] = digest
        report["regen_version"] = __version__
        plots, note = draw_plots(report, out)
        atomic_write_bytes(out / "report.md", render_markdown(report, [str(p) for p in plots], note).encode())
        atomic_write_json(report_path, report)  # last: its digest marks the evaluation complete
    line = headline(report)
    log.info(line)
    print(
        json.dumps(
            {"changed": True, "report": str(report_path), "headline": line, "lossless": report["lossless"]}
        )
    )
    return EXIT_OK if report["lossless"] else EXIT_FAILED_RECORDS


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def _inputs_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("what is evaluated (the same in plan, run and report)")
    add_evaluation_inputs(
        g,
        max_prompts=64,
        max_new_tokens=256,
        seed_help="the seeded prompt selection (as regen.jobs.evaluate)",
        force_help="report: write the report again even when up to date",
    )
    g.add_argument(
        "--concurrency",
        type=int,
        action="append",
        help="a level: 1 (the report's speedup) and the batch setting",
    )
    g.add_argument(
        "--servers-json",
        default="{}",
        help='what each server was launched with, e.g. {"plain": {...}, "dflash": {...}}: part of its digest',
    )
    g.add_argument(
        "--no-tie-probe", dest="tie_probe", action="store_false", help="no untimed logprob pass on plain"
    )
    g.add_argument(
        "--tie-tolerance", type=float, default=S.DEFAULT_TIE_TOLERANCE, help="nats (report's near ties)"
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    p = job_parser(
        "python -m regen.jobs.evaluate_serving", __doc__.split("\n\n")[0], status=False, progress=False
    )
    sub = p.add_subparsers(dest="command", required=True)
    inputs = _inputs_parser()
    sub.add_parser(
        "plan", parents=[inputs], help="what is still to send, and whether the report is up to date"
    )
    run = sub.add_parser("run", parents=[inputs], help="send every missing request to one server")
    run.add_argument("--status-file", type=Path, help="status JSON (default: OUTPUT_DIR/status.json)")
    run.add_argument("--status-interval", type=float, default=2.0, help="seconds between status updates")
    bar = run.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None, help="progress bar")
    bar.add_argument("--no-progress", dest="progress", action="store_false")
    run.add_argument("--server", required=True, choices=SERVERS)
    run.add_argument("--endpoint", required=True, help="the server's base URL, e.g. http://127.0.0.1:30020")
    run.add_argument(
        "--api", default="native", choices=S.APIS, help="native: SGLang's /generate; openai: /v1/completions"
    )
    run.add_argument("--model", default="", help="the served model name (--api openai)")
    run.add_argument("--api-key-env-file", help="0600 file with REGEN_SERVING_API_KEY= (the serving role's)")
    run.add_argument(
        "--launch-json", default="", help="the launch record of this server (kept in the report)"
    )
    run.add_argument("--warmup", type=int, default=1, help="untimed requests before measuring")
    run.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    report = sub.add_parser("report", parents=[inputs], help="merge both servers' records into the report")
    report.add_argument("--note", action="append", help="a line for the report's settings (repeatable)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    if args.command == "plan":
        return cmd_plan(args)
    if args.command == "run":
        return cmd_run(args)
    return cmd_report(args)


if __name__ == "__main__":
    sys.exit(run_main(main, own_process=True))
