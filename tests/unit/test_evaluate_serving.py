"""The GPU evaluation's pure parts on recorded answers: request bodies, response parsing, the lossless check
with its near-tie probe, and the merge of both servers into the CPU reference's report.

The speculative answers carry SGLang's own per-request metadata as recorded in public threads
(tests/fixtures/sglang/spec_meta_info.json, sgl-project/sglang#33518 on 2x RTX PRO 6000); the tie probe is a
recorded /generate answer with the two likeliest tokens per position (generate_logprobs.json); the OpenAI
answer is what the CPU demo's server really sent (tests/fixtures/serving/transformers_completion.json). The
token ids of the speculative answers are made up (the threads quote no ids); what is checked against them is
only whether the two servers agree.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from regen.evaluate import serving as S
from regen.evaluate.report import headline, render_markdown
from regen.evaluate.sglang_acceptance import AcceptanceError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SPEC = {r["id"]: r for r in json.loads((FIXTURES / "sglang" / "spec_meta_info.json").read_text())["records"]}
PROBE = json.loads((FIXTURES / "sglang" / "generate_logprobs.json").read_text())
COMPLETION = json.loads((FIXTURES / "serving" / "transformers_completion.json").read_text())
# 106 tokens, 43 verification steps, histogram [11, 14, 11, 4, 0, 3]
SM120 = SPEC["sglang-33518-sm120-dspark"]


def _ids(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50000 + 10 for i in range(n)]


def _spec_answer(ids: list[int]) -> dict:
    """A /generate answer of the speculative server: SGLang's recorded metadata, these output ids."""
    meta = dict(SM120["meta_info"], completion_tokens=SM120["completion_tokens"], e2e_latency=1.25)
    meta["finish_reason"] = {"type": "length", "length": SM120["completion_tokens"]}
    return {"text": "...", "output_ids": ids, "meta_info": meta}


def _plain_answer(ids: list[int]) -> dict:
    return {
        "text": "...",
        "output_ids": ids,
        "meta_info": {"completion_tokens": len(ids), "finish_reason": None},
    }


# -- requests -----------------------------------------------------------------------------------------------


def test_generate_body_is_sglangs_native_greedy_request() -> None:
    body = S.generate_body([5, 6, 7], max_new_tokens=32, stop_ids=[163586, 2, 2])
    assert body == {
        "input_ids": [5, 6, 7],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 32, "stop_token_ids": [2, 163586]},
        "stream": False,
    }
    probe = S.generate_body([5], max_new_tokens=4, stop_ids=[], top_logprobs=2)
    assert (probe["return_logprob"], probe["top_logprobs_num"], probe["logprob_start_len"]) == (True, 2, -1)
    with pytest.raises(ValueError, match="input_ids"):
        S.generate_body([], max_new_tokens=4, stop_ids=[])
    with pytest.raises(ValueError, match="max_new_tokens"):
        S.generate_body([1], max_new_tokens=0, stop_ids=[])


def test_endpoint_url_takes_a_base_or_a_route() -> None:
    for base in ("http://127.0.0.1:30020", "http://127.0.0.1:30020/", "http://127.0.0.1:30020/v1"):
        assert S.endpoint_url(base, "native") == "http://127.0.0.1:30020/generate"
        assert S.endpoint_url(base, "openai") == "http://127.0.0.1:30020/v1/completions"
    assert S.endpoint_url("http://h:1/generate", "openai") == "http://h:1/v1/completions"
    with pytest.raises(ValueError, match="api"):
        S.endpoint_url("http://h:1", "grpc")


# -- responses ----------------------------------------------------------------------------------------------


def test_a_speculative_answer_keeps_sglangs_metadata_and_its_ids() -> None:
    ids = _ids(106)
    record = S.parse_generate_response(_spec_answer(ids))
    assert record["output_ids"] == ids and record["completion_tokens"] == 106
    assert record["finish_reason"] == "length" and record["server_latency_s"] == 1.25
    assert record["spec"]["spec_verify_ct"] == 43
    assert record["spec"]["spec_correct_drafts_histogram"] == [11, 14, 11, 4, 0, 3]
    assert S.trace({"spec": record["spec"]}) == sorted(S.trace({"spec": record["spec"]}))  # histogram order
    assert len(S.trace({"spec": record["spec"]})) == 43


def test_a_plain_answer_has_no_speculative_metadata() -> None:
    record = S.parse_generate_response([_plain_answer([1, 2, 3])])  # a batch of one, as /generate may answer
    assert record["spec"] is None and record["output_ids"] == [1, 2, 3] and record["completion_tokens"] == 3


def test_answers_that_cannot_be_used_say_why() -> None:
    broken = _spec_answer(_ids(106))
    broken["meta_info"]["spec_correct_drafts_histogram"] = [11, 14, 11, 4, 0, 4]
    with pytest.raises(S.ResponseError, match="counts 44 steps"):
        S.parse_generate_response(broken)
    with pytest.raises(S.ResponseError, match="output_ids"):
        S.parse_generate_response({"text": "x", "meta_info": {"completion_tokens": 1}})
    with pytest.raises(S.ResponseError, match="meta_info"):
        S.parse_generate_response(COMPLETION["response"])  # an OpenAI answer is not a /generate one
    with pytest.raises(S.ResponseError, match="boom"):
        S.parse_generate_response({"error": {"message": "boom"}})


def test_the_tie_probe_reads_the_two_likeliest_tokens_per_position() -> None:
    answer = copy.deepcopy(PROBE["response"])
    tokens = [t for _, t, _ in answer["meta_info"]["output_token_logprobs"]]
    answer.update(output_ids=tokens)
    answer["meta_info"]["completion_tokens"] = len(tokens)
    record = S.parse_generate_response(answer, want_top=True)
    assert record["output_ids"] == [12095, 13, 1084, 374, 7407, 304]
    assert record["top2"] == [
        [[-0.73046875, 12095], [-2.734375, 2130]],
        [[-0.9765625, 13], [-1.7265625, 58883]],
        [[-1.3984375, 1084], [-2.21875, 576]],
    ]


def test_an_openai_completion_gives_text_and_counted_tokens() -> None:
    record = S.parse_completion_response(COMPLETION["response"])
    assert record["output_ids"] is None and record["text"] == "in the old one of a list and"
    assert record["completion_tokens"] == 8 and record["spec"] is None and record["finish_reason"] == "length"
    with pytest.raises(S.ResponseError, match=r"usage\.completion_tokens"):
        S.parse_completion_response({"choices": [{"text": "x"}]})


# -- the lossless check -------------------------------------------------------------------------------------


def _probe_record() -> dict:
    answer = copy.deepcopy(PROBE["response"])
    tokens = [t for _, t, _ in answer["meta_info"]["output_token_logprobs"]]
    answer.update(output_ids=tokens)
    answer["meta_info"]["completion_tokens"] = len(tokens)
    return S.parse_generate_response(answer, want_top=True)


def test_a_difference_at_a_near_tie_is_known_nondeterminism_and_any_other_is_a_failure() -> None:
    probe = _probe_record()
    plain = {"output_ids": [12095, 13, 1084, 374]}
    assert S.compare(plain, {"output_ids": [12095, 13, 1084, 374]}, probe).verdict == "identical"
    # Position 1: the plain server's runner-up (58883) is 0.75 nats behind its choice (13).
    spec = {"output_ids": [12095, 58883, 11, 9]}
    strict = S.compare(plain, spec, probe, tie_tolerance=0.1)
    assert (strict.verdict, strict.position, strict.plain_token, strict.spec_token) == (
        "differs",
        1,
        13,
        58883,
    )
    assert strict.gap == pytest.approx(0.75) and not strict.lossless
    loose = S.compare(plain, spec, probe, tie_tolerance=1.0)
    assert loose.verdict == "near_tie" and loose.lossless
    # A token the probe does not rank second is no tie, whatever the tolerance.
    assert S.compare(plain, {"output_ids": [12095, 11]}, probe, tie_tolerance=5.0).verdict == "differs"
    # Without a probe nothing can be called a tie; one output cut short is a failure too.
    assert S.compare(plain, spec).reason == "no tie probe answer for this position"
    short = S.compare(plain, {"output_ids": [12095, 13]}, probe, tie_tolerance=5.0)
    assert short.verdict == "differs" and "prefix" in short.reason
    # A probe whose own output left the speculative path earlier says nothing about this position.
    spec_late = {"output_ids": [12095, 13, 1084, 999]}
    assert (
        "another path"
        in S.compare(
            {"output_ids": [12095, 13, 1084, 374]},
            spec_late,
            dict(
                probe, output_ids=[12095, 14, 1084, 374], top2=[*probe["top2"], [[-1.0, 374], [-1.01, 999]]]
            ),
            tie_tolerance=1.0,
        ).reason
    )
    assert S.compare({"text": "ab"}, {"text": "ab"}).compared_as == "text"
    assert S.compare({"text": "ab"}, {"text": "ac"}).verdict == "differs"


# -- the merge ----------------------------------------------------------------------------------------------

PROMPTS = [("p0", "code"), ("p1", "chat"), ("p2", "chat")]


def _records(*, differ_at: tuple[str, str] | None = None) -> tuple[list[dict], list[dict]]:
    """Both servers' records for three prompts at concurrency 1 and 4, as the client writes them."""
    records, segments = [], []
    for server in ("plain", "dflash"):
        for setting, seconds in (("c1", None), ("c4", None)):
            for i, (pid, category) in enumerate(PROMPTS):
                ids = _ids(106, seed=i)
                if (server, setting) == ("dflash", "c1") and differ_at == (pid, setting):
                    ids = [*ids[:50], ids[50] + 1, *ids[51:]]
                answer = _spec_answer(ids) if server == "dflash" else _plain_answer(ids)
                record = S.parse_generate_response(answer)
                # plain: 2.0 s per request at c1; dflash: 1.0 s (a 2x speedup at concurrency 1).
                seconds = (2.0 if server == "plain" else 1.0) * (1 + i)
                records.append(
                    {
                        "kind": "request",
                        "server": server,
                        "setting": setting,
                        "prompt_id": pid,
                        "turn_kind": "default",
                        "category": category,
                        "seconds": seconds,
                        **record,
                    }
                )
        # The batch level: 318 tokens in 3.0 s (plain) and in 2.0 s (dflash): 1.5x.
        segments.append(
            {
                "kind": "segment",
                "server": server,
                "setting": "c4",
                "concurrency": 4,
                "requests": 3,
                "tokens": 318,
                "seconds": 3.0 if server == "plain" else 2.0,
                "complete": True,
            }
        )
    return records, segments


def test_merge_gives_sglangs_acceptance_the_speedups_and_a_clean_lossless_check() -> None:
    records, segments = _records()
    merged = S.merge(records, segments, block_size=16, concurrencies=[1, 4])
    assert [r["prompt_id"] for r in merged["rows"]] == ["p0", "p1", "p2"]
    spec_p0 = next(r for r in records if S.request_key(r) == ("dflash", "c1", "p0", "default"))
    assert merged["rows"][0]["accepted"] == S.trace(spec_p0) and merged["rows"][0]["lossless"]
    assert merged["batch"]["measured"] and merged["batch"]["concurrency"] == 4
    assert merged["batch"]["value"] == 1.5 and merged["batch"]["spec_tokens_per_s"] == 159.0
    assert merged["batch"]["acceptance_length"] == round(3 * 106 / (3 * 43), 4)
    check = merged["lossless"]
    assert check["value"] is True and check["exact"] is True and check["differences"] == []
    assert check["settings"] == {
        "c1": {"concurrency": 1, "identical": 3, "near_tie": 0, "differs": 0},
        "c4": {"concurrency": 4, "identical": 3, "near_tie": 0, "differs": 0},
    }
    report = S.gpu_report(
        merged,
        block_size=16,
        settings={"backend": "sglang", "concurrencies": [1, 4], "max_new_tokens": 106},
        inputs={"servers": {"plain": {"command_line": "python -m sglang.launch_server ..."}}},
    )
    trained = report["drafters"]["trained"]
    assert trained["acceptance_length"] == round(106 / 43, 4)  # SGLang's own spec_accept_length
    assert trained["acceptance_by_position"][:5] == [round(x / 43, 4) for x in (32, 18, 7, 3, 3)]
    # Block 16: the positions the histogram never reached.
    assert trained["acceptance_by_position"][5:] == [0.0] * 10
    low, high = trained["acceptance_length_ci95"]
    assert low == high == trained["acceptance_length"]  # the same histogram on every prompt: no spread
    assert report["speedup"]["value"] == 2.0 and report["speedup"]["concurrency"] == 1
    assert report["speedup"]["batch"]["value"] == 1.5
    assert set(report["drafters"]) == {"trained"} and "untrained" in report["drafters_not_measured"]
    assert set(trained["categories"]) == {"code", "chat"} and report["block_size"] == 16
    assert report["lossless"] is True and report["tree"]["measured"] is False
    line = headline(report)
    assert "speedup 2.00x at concurrency 1, 1.50x at concurrency 4; lossless" in line
    text = render_markdown(report, [])
    assert "## Lossless check" in text and "| c4 | 3 | 0 | 0 |" in text
    assert "Batch setting, concurrency 4: speedup 1.50" in text and "sglang.launch_server" in text


def test_merge_reports_a_speculative_output_that_differs() -> None:
    records, segments = _records(differ_at=("p1", "c1"))
    merged = S.merge(records, segments, block_size=16, concurrencies=[1, 4])
    assert merged["lossless"]["value"] is False
    (diff,) = merged["lossless"]["differences"]
    assert (diff["setting"], diff["prompt_id"], diff["position"], diff["verdict"]) == (
        "c1",
        "p1",
        50,
        "differs",
    )
    assert [r["lossless"] for r in merged["rows"]] == [True, False, True]
    report = S.gpu_report(merged, block_size=16, settings={"backend": "sglang"}, inputs={})
    assert report["lossless"] is False and "NOT lossless" in headline(report)
    assert "| c1 | p1 | default | 50 |" in render_markdown(report, [])


def test_merge_refuses_what_it_cannot_report() -> None:
    records, segments = _records()
    with pytest.raises(AcceptanceError, match="no plain answer at concurrency 4"):
        S.merge(
            [
                r
                for r in records
                if not (r["server"] == "plain" and r["setting"] == "c4" and r["prompt_id"] == "p2")
            ],
            segments,
            block_size=16,
            concurrencies=[1, 4],
        )
    with pytest.raises(ValueError, match="concurrency 1"):
        S.merge(records, segments, block_size=16, concurrencies=[4])
    without_meta = [dict(r, spec=None) if r["server"] == "dflash" else r for r in records]
    with pytest.raises(AcceptanceError, match="speculative metadata"):
        S.merge(without_meta, segments, block_size=16, concurrencies=[1, 4])
    # No batch level was timed: the report says so instead of inventing a figure.
    merged = S.merge(records, [], block_size=16, concurrencies=[1, 4])
    assert merged["batch"]["measured"] is False and "no timed segment" in merged["batch"]["reason"]
