"""Acceptance from SGLang's own per-request metadata, on responses quoted from public threads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from regen.evaluate.sglang_acceptance import AcceptanceError, parse_meta_info, summarize_requests

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sglang" / "spec_meta_info.json"
RECORDS = {r["id"]: r for r in json.loads(FIXTURE.read_text())["records"]}


def _parse(name: str):
    record = RECORDS[name]
    return parse_meta_info(record["meta_info"], completion_tokens=record["completion_tokens"])


def test_the_sm120_response_gives_sglangs_figures_and_per_position_rates() -> None:
    request = _parse("sglang-33518-sm120-dspark")
    assert request.verify_steps == 43 and request.drafts_per_step == 5
    assert request.acceptance_length == pytest.approx(106 / 43)  # what SGLang reported: 2.4651...
    block = summarize_requests([request], block_size=request.drafts_per_step + 1)
    # Hand-computed from the histogram [11, 14, 11, 4, 0, 3] over 43 steps: P(accepted >= k).
    assert block["acceptance_length"] == round(106 / 43, 4)
    assert block["acceptance_by_position"] == [round(x / 43, 4) for x in (32, 18, 7, 3, 3)]
    assert block["steps"] == 43 and block["prompts"] == 1
    assert block["source"].endswith("(spec_correct_drafts_histogram)")


def test_an_older_release_without_a_histogram_gives_the_totals_only() -> None:
    request = _parse("sglang-13754-ngram")
    assert request.acceptance_length == pytest.approx(200 / 188)
    assert (request.correct_drafts, request.proposed_drafts) == (11, 940)  # the old key names
    with pytest.raises(AcceptanceError, match="histogram"):
        request.trace()
    block = summarize_requests([request], block_size=6)
    assert block["acceptance_length"] == round(200 / 188, 4) and block["acceptance_length_ci95"] is None
    assert block["acceptance_by_position"] == [None] * 5 and "totals only" in block["source"]


def test_several_requests_weigh_steps_as_sglang_does() -> None:
    one, two = _parse("sglang-33518-sm120-dspark"), _parse("sglang-33518-sm120-dspark")
    block = summarize_requests([one, two], block_size=6)
    assert block["steps"] == 86 and block["acceptance_length"] == round(212 / 86, 4)
    low, high = block["acceptance_length_ci95"]
    assert low == high == block["acceptance_length"]  # identical prompts: no spread to resample


def test_metadata_that_does_not_add_up_or_is_missing_is_refused() -> None:
    meta = dict(RECORDS["sglang-33518-sm120-dspark"]["meta_info"])
    with pytest.raises(AcceptanceError, match="did not decode speculatively"):
        parse_meta_info({"completion_tokens": 10})
    broken = dict(meta, spec_correct_drafts_histogram=[11, 14, 11, 4, 0, 4])
    with pytest.raises(AcceptanceError, match="counts 44 steps"):
        parse_meta_info(broken, completion_tokens=106)
    with pytest.raises(AcceptanceError, match="not completion_tokens / spec_verify_ct"):
        parse_meta_info(meta, completion_tokens=107)
    with pytest.raises(AcceptanceError, match="more than block_size"):
        summarize_requests([parse_meta_info(meta, completion_tokens=106)], block_size=4)
