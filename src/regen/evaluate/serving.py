"""The GPU evaluation through a served target: requests, responses and the merge into the report (pure).

`regen.jobs.evaluate_serving` sends the held-out prompts to a running server twice over: once to the target
served alone (``plain``) and once to the target served with the trained drafter (``dflash``,
``--speculative-algorithm DFLASH``), with greedy decoding, the same prompt tokens, the same budget and the
same stop tokens, at concurrency 1 and at a batch setting. This module holds what needs no network:

* the request bodies: SGLang's native ``/generate`` (``input_ids`` rendered with the target's chat template
  exactly as the CPU reference renders them, ``sampling_params`` with temperature 0, ``max_new_tokens`` and
  ``stop_token_ids``) and, for servers without ``/generate`` (the CPU demo's ``transformers serve``), the
  OpenAI ``/v1/completions`` body with the rendered prompt text;
* the response parsers: output token ids, completion tokens, finish reason, SGLang's per-request
  speculative metadata (read by `regen.evaluate.sglang_acceptance`, checked against SGLang's own
  identities) and, for the tie probe, the two likeliest tokens at each output position;
* the lossless check: the speculative server's output against the plain server's, token for token, per
  setting; a difference whose first diverging position the plain server itself scored as a near tie (its
  two likeliest tokens within ``tie_tolerance`` nats, the speculative token being the runner-up) is
  reported as known numerical nondeterminism (the verify forward computes the same logits in another batch
  shape, so near ties may flip), any other difference as a failure;
* `merge`: the per-request records of both servers into the rows `regen.evaluate.report.build_report`
  takes, plus the batch-setting speedup and the lossless details, so the GPU report has the CPU reference's
  fields.

Acceptance comes only from SGLang's metadata; an OpenAI-compatible server gives outputs and timings, never
acceptance.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from regen.evaluate.sglang_acceptance import AcceptanceError, parse_meta_info, summarize_requests
from regen.evaluate.stats import throughput

# The keys of SGLang's meta_info that the records keep (everything acceptance needs, nothing bulky).
SPEC_KEYS = (
    "spec_verify_ct",
    "spec_accept_length",
    "spec_accept_rate",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
    "spec_accept_token_num",
    "spec_draft_token_num",
    "spec_correct_drafts_histogram",
    "completion_tokens",
)
DEFAULT_TIE_TOLERANCE = 0.1
APIS = ("native", "openai")


class ResponseError(ValueError):
    """A response the evaluation cannot use; the message says what was wrong with it."""


# --------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------


def generate_body(
    input_ids: Sequence[int], *, max_new_tokens: int, stop_ids: Sequence[int], top_logprobs: int = 0
) -> dict[str, Any]:
    """SGLang's native ``/generate`` request: the prompt as token ids, greedy, one answer, not streamed.

    ``top_logprobs`` > 0 (the tie probe) also asks for the likeliest tokens at every output position
    (``return_logprob``, ``top_logprobs_num``; ``logprob_start_len`` -1: none for the prompt).
    """
    if not input_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
        raise ValueError("input_ids must be a non-empty list of token ids")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    body: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": int(max_new_tokens),
            "stop_token_ids": sorted({int(t) for t in stop_ids}),
        },
        "stream": False,
    }
    if top_logprobs > 0:
        body.update(return_logprob=True, top_logprobs_num=int(top_logprobs), logprob_start_len=-1)
    return body


def completion_body(prompt_text: str, *, model: str, max_new_tokens: int) -> dict[str, Any]:
    """The OpenAI ``/v1/completions`` request for a server without ``/generate``: the rendered prompt as
    text (the server tokenizes it again), greedy, not streamed."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    return {"model": model, "prompt": prompt_text, "max_tokens": int(max_new_tokens), "temperature": 0.0}


def endpoint_url(base: str, api: str) -> str:
    """The route a request goes to: ``/generate`` (native) or ``/v1/completions`` (openai)."""
    if api not in APIS:
        raise ValueError(f"api must be one of {', '.join(APIS)}, not {api!r}")
    root = base.strip().rstrip("/")
    for suffix in ("/v1/completions", "/v1/chat/completions", "/generate", "/v1"):
        if root.endswith(suffix):
            root = root[: -len(suffix)]
            break
    return root + ("/generate" if api == "native" else "/v1/completions")


# --------------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------------


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def parse_generate_response(doc: Any, *, want_top: bool = False) -> dict[str, Any]:
    """One native ``/generate`` answer -> the record's fields.

    Returns {"output_ids", "completion_tokens", "finish_reason", "spec" (SGLang's speculative fields, or
    None when the server did not decode speculatively), "server_latency_s", "top2" (with ``want_top``: per
    output position the two likeliest [logprob, token id] pairs, or None where the server gave none)}.
    """
    if isinstance(doc, list):
        if len(doc) != 1:
            raise ResponseError(f"expected one answer, the server sent a list of {len(doc)}")
        doc = doc[0]
    if not isinstance(doc, dict):
        raise ResponseError(f"the answer is a JSON {type(doc).__name__}, expected an object")
    if "error" in doc or ("object" in doc and doc.get("object") == "error"):
        error = doc.get("error", doc.get("message"))
        message = error.get("message") if isinstance(error, dict) else error
        raise ResponseError(f"the server reported an error: {message}")
    meta = doc.get("meta_info")
    if not isinstance(meta, dict):
        raise ResponseError(
            "the answer has no meta_info: is this SGLang's native /generate? (an OpenAI-compatible server "
            "needs --api openai)"
        )
    output_ids = doc.get("output_ids")
    if not _ints(output_ids):
        raise ResponseError("the answer has no output_ids list: the token-for-token check needs the ids")
    tokens = meta.get("completion_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ResponseError(f"meta_info.completion_tokens is {tokens!r}, expected a count")
    if tokens != len(output_ids):
        # Tokens/s and the acceptance identities use the count, the lossless check the ids: a server whose
        # two disagree has not said what it generated.
        raise ResponseError(
            f"meta_info.completion_tokens is {tokens} but the answer has {len(output_ids)} output ids"
        )
    spec = {k: meta[k] for k in SPEC_KEYS if k in meta} if meta.get("spec_verify_ct") else None
    if spec is not None:
        try:
            parse_meta_info(spec)  # SGLang's own identities, checked now: a bad record is never stored
        except AcceptanceError as exc:
            raise ResponseError(str(exc)) from None
    finish = meta.get("finish_reason")
    latency = meta.get("e2e_latency")
    record: dict[str, Any] = {
        "output_ids": list(output_ids),
        "completion_tokens": tokens,
        "finish_reason": finish.get("type") if isinstance(finish, dict) else finish,
        "spec": spec,
        "server_latency_s": round(float(latency), 6) if isinstance(latency, int | float) else None,
    }
    if want_top:
        record["top2"] = _top2(meta.get("output_top_logprobs"), len(output_ids))
    return record


def _top2(raw: Any, length: int) -> list[list[list[float]] | None] | None:
    """SGLang's ``output_top_logprobs`` (per position a list of [logprob, token id, text]) -> per position
    the two likeliest [logprob, token id], best first."""
    if not isinstance(raw, list):
        return None
    out: list[list[list[float]] | None] = []
    for entry in raw[:length]:
        if not isinstance(entry, list):
            out.append(None)
            continue
        pairs = []
        for item in entry:
            if (
                isinstance(item, list | tuple)
                and len(item) >= 2
                and isinstance(item[0], int | float)
                and isinstance(item[1], int)
            ):
                pairs.append([float(item[0]), int(item[1])])
        pairs.sort(key=lambda p: -p[0])
        out.append(pairs[:2] if pairs else None)
    return out


def parse_completion_response(doc: Any) -> dict[str, Any]:
    """One OpenAI ``/v1/completions`` answer -> the record's fields (text instead of token ids)."""
    if not isinstance(doc, dict):
        raise ResponseError(f"the answer is a JSON {type(doc).__name__}, expected an object")
    if "error" in doc:
        error = doc["error"]
        raise ResponseError(
            f"the server reported an error: {error.get('message') if isinstance(error, dict) else error}"
        )
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ResponseError("the answer has no choices")
    text = choices[0].get("text")
    if not isinstance(text, str):
        raise ResponseError("the answer's first choice has no text")
    usage = doc.get("usage") or {}
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int) or isinstance(tokens, bool):
        raise ResponseError("the answer has no usage.completion_tokens: its tokens/s cannot be counted")
    return {
        "output_ids": None,
        "text": text,
        "completion_tokens": tokens,
        "finish_reason": choices[0].get("finish_reason"),
        "spec": None,
        "server_latency_s": None,
    }


# --------------------------------------------------------------------------------------------------
# The lossless check
# --------------------------------------------------------------------------------------------------


def first_divergence(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """Index of the first position where `a` and `b` differ (the shorter length when one is a prefix of
    the other), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class Comparison:
    """The speculative output against the plain one, for one prompt and setting."""

    verdict: str  # identical | near_tie | differs
    position: int | None = None
    plain_token: int | None = None
    spec_token: int | None = None
    gap: float | None = None  # the plain server's logprob gap between the two tokens at `position`
    compared_as: str = "token ids"
    reason: str = ""

    @property
    def lossless(self) -> bool:
        return self.verdict != "differs"

    def document(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, "")}


def compare(
    plain: Mapping[str, Any],
    spec: Mapping[str, Any],
    probe: Mapping[str, Any] | None = None,
    *,
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE,
) -> Comparison:
    """Whether the speculative output equals the plain one, and when not, whether the plain server's own
    tie probe shows a near tie at the first diverging position.

    ``probe``: the plain server's untimed answer to the same prompt with its two likeliest tokens per
    position (``top2``). It speaks for position p only when its own output agrees with the speculative
    output before p (same context) and, at p, its two likeliest tokens are the plain and the speculative
    token, less than ``tie_tolerance`` nats apart.
    """
    a, b = plain.get("output_ids"), spec.get("output_ids")
    if a is None or b is None:
        ta, tb = plain.get("text"), spec.get("text")
        if ta is None or tb is None:
            return Comparison("differs", reason="one of the two answers has neither token ids nor text")
        pos = first_divergence(ta, tb)
        if pos is None:
            return Comparison("identical", compared_as="text")
        return Comparison("differs", position=pos, compared_as="text", reason="the texts differ")
    pos = first_divergence(a, b)
    if pos is None:
        return Comparison("identical")
    plain_token = a[pos] if pos < len(a) else None
    spec_token = b[pos] if pos < len(b) else None
    base = {"position": pos, "plain_token": plain_token, "spec_token": spec_token}
    if plain_token is None or spec_token is None:
        return Comparison("differs", reason="one output is a prefix of the other (one stopped early)", **base)
    top = (probe or {}).get("top2")
    probe_ids = (probe or {}).get("output_ids")
    if not top or not probe_ids or pos >= len(top) or not top[pos]:
        return Comparison("differs", reason="no tie probe answer for this position", **base)
    if list(probe_ids[:pos]) != list(b[:pos]):
        return Comparison("differs", reason="the tie probe's own output took another path before it", **base)
    pair = top[pos]
    ids = [p[1] for p in pair]
    if len(pair) < 2 or set(ids) != {plain_token, spec_token}:
        return Comparison(
            "differs", reason="the plain server's two likeliest tokens there are not these two", **base
        )
    gap = abs(pair[0][0] - pair[1][0])
    if gap <= tie_tolerance:
        return Comparison(
            "near_tie",
            gap=round(gap, 6),
            reason=f"the plain server scores both tokens within {tie_tolerance} nats",
            **base,
        )
    return Comparison("differs", gap=round(gap, 6), reason=f"a gap of {gap:.3f} nats is no tie", **base)


# --------------------------------------------------------------------------------------------------
# The merge
# --------------------------------------------------------------------------------------------------

NOT_ON_GPU_DRAFTERS = (
    "the GPU path serves the trained drafter only: an untrained drafter or an oracle would each need an "
    "SGLang server of their own (the CPU reference brackets the harness with both)"
)
TREE_NOT_ON_GPU = (
    "not measured: SGLang 0.5.23's DFLASH verifies the drafter's chain; DDTree budgets are scored by the CPU "
    "reference only (drafter_evaluation_backend: reference)"
)
STEPS_NOT_ON_GPU = (
    "not measured on the GPU path: each earlier checkpoint would need an SGLang server of its own; the CPU "
    "reference draws acceptance against training step"
)
BATCH_NOTE = (
    "every held-out request sent at once through a client-side limit of this many requests in flight, the "
    "same requests to both servers; tokens/s is the level's output tokens over its wall time"
)


def request_key(record: Mapping[str, Any]) -> tuple[str, str, str, str]:
    return (record["server"], record["setting"], record["prompt_id"], record.get("turn_kind") or "default")


def trace(record: Mapping[str, Any]) -> list[int]:
    """Accepted drafts per verification step, from SGLang's histogram (order unknown)."""
    spec = record.get("spec")
    if not spec and int(record.get("completion_tokens") or 0) <= 1:
        return []  # the answer ended with the prefill's own token: no verification step ran
    if not spec:
        raise AcceptanceError(
            f"request {record.get('prompt_id')} ({record.get('setting')}) carries no speculative metadata"
        )
    return parse_meta_info(spec).trace()


def _level_throughput(
    segments: Iterable[Mapping[str, Any]], server: str, setting: str
) -> tuple[float | None, dict[str, Any]]:
    picked = [s for s in segments if s["server"] == server and s["setting"] == setting]
    value = throughput([(int(s["tokens"]), float(s["seconds"])) for s in picked])
    return value, {
        "segments": len(picked),
        "requests": sum(int(s["requests"]) for s in picked),
        "tokens": sum(int(s["tokens"]) for s in picked),
        "seconds": round(sum(float(s["seconds"]) for s in picked), 6),
        "complete": all(s.get("complete", True) for s in picked),
    }


def merge(
    records: Sequence[Mapping[str, Any]],
    segments: Sequence[Mapping[str, Any]],
    *,
    block_size: int,
    concurrencies: Sequence[int],
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE,
) -> dict[str, Any]:
    """The plain and the speculative server's records -> {"rows", "batch", "lossless"} for the report.

    ``rows``: one per prompt and turn kind at concurrency 1, in `build_report`'s shape (the trained drafter:
    its acceptance trace from SGLang's histogram, its tokens and seconds, the plain server's, and whether
    both outputs agree). ``batch``: the speedup at the largest other concurrency, from each level's wall
    time. ``lossless``: the comparison per setting, with every difference and its verdict.
    Raises AcceptanceError when a speculative record lacks the metadata or a plain one is missing.
    """
    by_key = {request_key(r): r for r in records}
    levels = sorted({int(c) for c in concurrencies})
    if 1 not in levels:
        raise ValueError("concurrency 1 must be among the levels: the report's speedup is at concurrency 1")
    prompts = sorted(
        {(r["prompt_id"], r.get("turn_kind") or "default") for r in records if r["server"] == "dflash"}
    )
    if not prompts:
        raise AcceptanceError("no request of the speculative server (dflash) to report")
    _require_evidence(records, levels)
    rows: list[dict[str, Any]] = []
    checks: dict[str, dict[str, Any]] = {}
    differences: list[dict[str, Any]] = []
    for level in levels:
        setting = f"c{level}"
        counts = {"identical": 0, "near_tie": 0, "differs": 0}
        for pid, kind in prompts:
            spec = by_key.get(("dflash", setting, pid, kind))
            plain = by_key.get(("plain", setting, pid, kind))
            if spec is None or plain is None:
                missing = "dflash" if spec is None else "plain"
                raise AcceptanceError(
                    f"prompt {pid} ({kind}) has no {missing} answer at concurrency {level}: run that "
                    "server's client again (it resumes)"
                )
            probe = by_key.get(("plain", "probe", pid, kind))
            result = compare(plain, spec, probe, tie_tolerance=tie_tolerance)
            counts[result.verdict] += 1
            if result.verdict != "identical":
                differences.append(
                    {"setting": setting, "prompt_id": pid, "turn_kind": kind, **result.document()}
                )
            if level == 1:
                rows.append(
                    {
                        "drafter": "trained",
                        "prompt_id": pid,
                        "turn_kind": kind,
                        "category": spec.get("category"),
                        "accepted": trace(spec),
                        "tokens": int(spec["completion_tokens"]),
                        "seconds": float(spec["seconds"]),
                        "plain_tokens": int(plain["completion_tokens"]),
                        "plain_seconds": float(plain["seconds"]),
                        "lossless": result.lossless,
                    }
                )
        checks[setting] = {"concurrency": level, **counts}
    batch = _batch(records, segments, levels, block_size)
    lossless = all(c["differs"] == 0 for c in checks.values())
    return {
        "rows": rows,
        "batch": batch,
        "lossless": {
            "value": lossless,
            "exact": lossless and all(c["near_tie"] == 0 for c in checks.values()),
            "method": "Greedy decoding: the speculative server's output token ids against the plain "
            "server's, per setting",
            "tie_tolerance": tie_tolerance,
            "settings": checks,
            "differences": differences,
            "speculative_answers": {
                f"c{level}": sum(
                    1
                    for r in records
                    if r["server"] == "dflash" and r["setting"] == f"c{level}" and r.get("spec")
                )
                for level in levels
            },
        },
    }


def _require_evidence(records: Sequence[Mapping[str, Any]], levels: Sequence[int]) -> None:
    """Refuse a verdict the records cannot support: both servers' answers must be comparable token for
    token, and the speculative server must have shown (SGLang's metadata) that it decoded speculatively."""
    timed = [r for r in records if r["setting"] in {f"c{level}" for level in levels}]
    kinds = {r["server"]: set() for r in timed}
    for r in timed:
        kinds[r["server"]].add("ids" if r.get("output_ids") is not None else "text")
    if kinds.get("plain", set()) | kinds.get("dflash", set()) != {"ids"}:
        raise AcceptanceError(
            "the two servers' answers are not comparable: the lossless check compares output token ids, and "
            f"the plain server's answers hold {sorted(kinds.get('plain', set()))}, the dflash server's "
            f"{sorted(kinds.get('dflash', set()))}; run both through SGLang's native /generate (--api native)"
        )
    if not any(r.get("spec") for r in timed if r["server"] == "dflash"):
        raise AcceptanceError(
            "no answer of the dflash server carries speculative metadata (spec_verify_ct): nothing "
            "speculative was checked, so there is no lossless verdict, acceptance or speedup to report; is "
            "the server launched with --speculative-algorithm DFLASH, and do its answers run longer than "
            "one token?"
        )


def _batch(
    records: Sequence[Mapping[str, Any]],
    segments: Sequence[Mapping[str, Any]],
    levels: Sequence[int],
    block_size: int,
) -> dict[str, Any]:
    others = [c for c in levels if c > 1]
    if not others:
        return {"measured": False, "reason": "no batch setting was run (only concurrency 1)"}
    level = max(others)
    setting = f"c{level}"
    spec_tps, spec_info = _level_throughput(segments, "dflash", setting)
    plain_tps, plain_info = _level_throughput(segments, "plain", setting)
    spec_records = [r for r in records if r["server"] == "dflash" and r["setting"] == setting]
    acceptance = (
        summarize_requests([parse_meta_info(r["spec"]) for r in spec_records], block_size)
        if spec_records and all(r.get("spec") for r in spec_records)
        else None
    )
    notes = [BATCH_NOTE]
    for name, info in (("dflash", spec_info), ("plain", plain_info)):
        if info["segments"] > 1 or not info["complete"]:
            notes.append(
                f"the {name} server's level was interrupted and resumed: its tokens/s joins "
                f"{info['segments']} runs, the last with fewer requests in flight"
            )
    value = spec_tps / plain_tps if spec_tps and plain_tps else None
    return {
        "measured": value is not None,
        "concurrency": level,
        "value": _round(value),
        "spec_tokens_per_s": _round(spec_tps),
        "plain_tokens_per_s": _round(plain_tps),
        "acceptance_length": acceptance["acceptance_length"] if acceptance else None,
        "levels": {"dflash": spec_info, "plain": plain_info},
        "note": "; ".join(notes),
        **({} if value is not None else {"reason": "a level has no timed segment: run its client again"}),
    }


def gpu_report(
    merged: Mapping[str, Any], *, block_size: int, settings: dict[str, Any], inputs: dict[str, Any]
) -> dict[str, Any]:
    """report.json of the GPU path: the CPU reference's fields (`build_report`), with the batch setting,
    the lossless check over every setting, and what this path does not measure saying why."""
    from regen.evaluate.report import build_report

    report = build_report(
        merged["rows"], block_size=block_size, settings=settings, inputs=inputs, batch=dict(merged["batch"])
    )
    check = dict(merged["lossless"])
    report["lossless"] = bool(check["value"])
    report["lossless_check"] = check
    trained = report["drafters"]["trained"]
    trained["lossless"] = bool(check["value"])
    trained["source"] = "sglang meta_info (spec_correct_drafts_histogram)"
    report["drafters_not_measured"] = {"untrained": NOT_ON_GPU_DRAFTERS, "oracle": NOT_ON_GPU_DRAFTERS}
    report["tree"] = {"measured": False, "reason": TREE_NOT_ON_GPU}
    report["training_steps"] = {"measured": False, "reason": STEPS_NOT_ON_GPU}
    return report


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, digits)


__all__ = [
    "APIS",
    "DEFAULT_TIE_TOLERANCE",
    "Comparison",
    "ResponseError",
    "compare",
    "completion_body",
    "endpoint_url",
    "first_divergence",
    "generate_body",
    "gpu_report",
    "merge",
    "parse_completion_response",
    "parse_generate_response",
    "request_key",
    "trace",
]
