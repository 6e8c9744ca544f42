"""No verdict without evidence (issue 25): the GPU evaluation's report claims "lossless", acceptance or a
speedup only for what the servers proved they did.

The answers are built from the same recorded SGLang metadata as test_evaluate_serving.py (the records it
builds with `_records`); each case removes one piece of evidence, as a misconfigured or lying server would.
"""

from __future__ import annotations

import pytest

from regen.evaluate import serving as S
from regen.evaluate.sglang_acceptance import AcceptanceError
from tests.unit.test_evaluate_serving import _plain_answer, _records


def test_completion_tokens_must_count_the_output_ids() -> None:
    answer = _plain_answer(list(range(10, 20)))
    answer["meta_info"]["completion_tokens"] = 3
    with pytest.raises(S.ResponseError, match="completion_tokens is 3 but the answer has 10 output ids"):
        S.parse_generate_response(answer)


def test_a_dflash_server_that_never_decoded_speculatively_gives_no_verdict() -> None:
    records, segments = _records()
    # A "dflash" server that answers one token per request and no speculative metadata: each answer
    # passes the client's per-request check (one token needs no verification step), and both servers
    # agree token for token, yet nothing speculative was checked.
    one_token = []
    for r in records:
        one = dict(r, output_ids=r["output_ids"][:1], completion_tokens=1)
        if r["server"] == "dflash":
            one["spec"] = None
        one_token.append(one)
    with pytest.raises(AcceptanceError, match="no answer of the dflash server carries speculative metadata"):
        S.merge(one_token, segments, block_size=16, concurrencies=[1, 4])


def test_the_report_says_how_many_answers_were_verified_speculatively() -> None:
    records, segments = _records()
    merged = S.merge(records, segments, block_size=16, concurrencies=[1, 4])
    assert merged["lossless"]["speculative_answers"] == {"c1": 3, "c4": 3}


def test_text_answers_beside_token_ids_are_refused_not_called_different() -> None:
    records, segments = _records()
    # The plain baseline made through --api openai (text, no ids) beside a native dflash run: the two
    # cannot be compared token for token, so the report refuses instead of saying "NOT lossless".
    mixed = [
        dict(r, output_ids=None, text="...", api="openai") if r["server"] == "plain" else r for r in records
    ]
    with pytest.raises(AcceptanceError, match="not comparable"):
        S.merge(mixed, segments, block_size=16, concurrencies=[1, 4])
