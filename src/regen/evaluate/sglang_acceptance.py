"""Acceptance figures from what SGLang itself reports per request (standard library only).

On GPUs the evaluation serves the target with the trained drafter (``--speculative-algorithm DFLASH``) and
reads acceptance from SGLang, not from a model of it: the native ``/generate`` response's ``meta_info``
carries, per request, in SGLang 0.5.23 (``TokenizerManager``'s speculative metrics):

  spec_verify_ct                  verification steps
  spec_accept_length              completion_tokens / spec_verify_ct (the bonus token included)
  spec_num_correct_drafts         draft tokens the target accepted
  spec_num_proposed_drafts        draft tokens proposed
  spec_accept_rate                correct / proposed
  spec_correct_drafts_histogram   [steps that accepted exactly j drafts for j = 0, 1, ...]

Older releases name the counts ``spec_accept_token_num`` / ``spec_draft_token_num`` and send no histogram.
The histogram is a trace with its order forgotten, so the same statistics as the CPU reference apply
(``regen.evaluate.stats``): mean acceptance length, its bootstrap interval over prompts, and the share of
steps whose k-th draft was accepted. Every record is checked against SGLang's own identities (``sum(h) ==
verify_ct``, ``sum(j * h[j]) == correct``, ``accept_length == completion_tokens / verify_ct``), so a field
renamed or redefined in a later release fails loudly instead of skewing the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from regen.evaluate.stats import summarize

# Relative tolerance of the identities (the floats SGLang sends are exact ratios of its counters).
_TOLERANCE = 1e-9


class AcceptanceError(ValueError):
    """A response without usable speculative metadata; the message says what was missing and why."""


@dataclass(frozen=True)
class RequestAcceptance:
    verify_steps: int
    completion_tokens: int | None
    correct_drafts: int | None
    proposed_drafts: int | None
    histogram: tuple[int, ...] | None

    @property
    def acceptance_length(self) -> float | None:
        if self.completion_tokens is None:
            return None
        return self.completion_tokens / self.verify_steps

    @property
    def drafts_per_step(self) -> int | None:
        """Draft tokens proposed per verification step (the block size less its anchor token)."""
        if not self.proposed_drafts or self.proposed_drafts % self.verify_steps:
            return None
        return self.proposed_drafts // self.verify_steps

    def trace(self) -> list[int]:
        """Accepted drafts per verification step (order unknown: histogram order)."""
        if self.histogram is None:
            raise AcceptanceError(
                "this response has no spec_correct_drafts_histogram: per-step figures need it"
            )
        return [j for j, count in enumerate(self.histogram) for _ in range(count)]


def _int(meta: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = meta.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def parse_meta_info(meta: dict[str, Any], completion_tokens: int | None = None) -> RequestAcceptance:
    """One request's acceptance from SGLang's ``meta_info`` (``completion_tokens`` from the response's
    usage when the metadata lacks it)."""
    if not isinstance(meta, dict):
        raise AcceptanceError(f"meta_info must be an object, got {type(meta).__name__}")
    steps = _int(meta, "spec_verify_ct")
    if not steps:
        raise AcceptanceError(
            "the response carries no spec_verify_ct: the server did not decode speculatively (is "
            "--speculative-algorithm DFLASH on its command line, and was the native /generate endpoint used?)"
        )
    tokens = _int(meta, "completion_tokens")
    tokens = completion_tokens if tokens is None else tokens
    correct = _int(meta, "spec_num_correct_drafts", "spec_accept_token_num")
    proposed = _int(meta, "spec_num_proposed_drafts", "spec_draft_token_num")
    raw = meta.get("spec_correct_drafts_histogram")
    histogram = None
    if raw is not None:
        if not isinstance(raw, list) or not all(isinstance(c, int) and c >= 0 for c in raw):
            raise AcceptanceError(f"spec_correct_drafts_histogram must be a list of counts, got {raw!r}")
        histogram = tuple(raw)
    request = RequestAcceptance(steps, tokens, correct, proposed, histogram)
    _check(meta, request)
    return request


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _TOLERANCE * max(1.0, abs(a), abs(b))


def _check(meta: dict[str, Any], r: RequestAcceptance) -> None:
    """SGLang's own identities; a mismatch means the fields changed meaning."""
    problems = []
    if r.histogram is not None:
        if sum(r.histogram) != r.verify_steps:
            problems.append(
                f"the histogram counts {sum(r.histogram)} steps, spec_verify_ct says {r.verify_steps}"
            )
        weighted = sum(j * c for j, c in enumerate(r.histogram))
        if r.correct_drafts is not None and weighted != r.correct_drafts:
            problems.append(
                f"the histogram accepts {weighted} drafts, spec_num_correct_drafts says {r.correct_drafts}"
            )
    reported = meta.get("spec_accept_length")
    length = r.acceptance_length
    if isinstance(reported, int | float) and length is not None and not _close(float(reported), length):
        problems.append(
            f"spec_accept_length {reported} is not completion_tokens / spec_verify_ct "
            f"({r.completion_tokens} / {r.verify_steps})"
        )
    rate = meta.get("spec_accept_rate")
    if (
        isinstance(rate, int | float)
        and r.correct_drafts is not None
        and r.proposed_drafts
        and not _close(float(rate), r.correct_drafts / r.proposed_drafts)
    ):
        problems.append(f"spec_accept_rate {rate} is not correct / proposed drafts")
    if problems:
        raise AcceptanceError("SGLang's speculative metadata does not add up: " + "; ".join(problems))


def summarize_requests(requests: Sequence[RequestAcceptance], block_size: int) -> dict[str, Any]:
    """The report's per-drafter block (as the CPU reference writes it) from SGLang's per-request figures.

    With histograms: the trace statistics of regen.evaluate.stats. Without (older SGLang): the mean
    acceptance length as SGLang counts it (total completion tokens over total verification steps), no
    interval and no per-position rates, and ``source`` says so.
    """
    if not requests:
        raise AcceptanceError("no request to summarize")
    if all(r.histogram is not None for r in requests):
        width = max(len(r.histogram or ()) for r in requests)
        if width > block_size:
            raise AcceptanceError(
                f"a histogram has {width} buckets: more than block_size {block_size} allows; is the "
                "server's --speculative-num-draft-tokens the drafter's block size?"
            )
        block = summarize([r.trace() for r in requests], block_size)
        block["source"] = "sglang meta_info (spec_correct_drafts_histogram)"
        return block
    tokens = [r.completion_tokens for r in requests]
    if any(t is None for t in tokens):
        raise AcceptanceError("completion_tokens missing from a response: the acceptance length needs it")
    steps = sum(r.verify_steps for r in requests)
    return {
        "acceptance_length": round(sum(tokens) / steps, 4),  # type: ignore[arg-type]
        "acceptance_length_ci95": None,
        "acceptance_by_position": [None] * (block_size - 1),
        "steps": steps,
        "prompts": len(requests),
        "source": "sglang meta_info (totals only: this release sends no histogram)",
    }
