"""Pure parts of the generation job: rows, turn plans, responses, endpoints, retry timing, inputs."""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time

import pytest

from regen.jobs import generate as G
from regen.jobs._common import JobError, Reservoir


def turns(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_parse_prompt_row_accepts_the_normalized_schema():
    rid, conv = G.parse_prompt_row(
        {
            "id": 12,
            "conversations": turns(("system", "s"), ("user", "q"), ("assistant", "old"), ("user", "q2")),
        }
    )
    assert rid == "12"
    # the source's assistant text is never sent: it is replaced by the regenerated one
    assert conv == turns(("system", "s"), ("user", "q"), ("assistant", ""), ("user", "q2"))
    assert G.parse_prompt_row({"id": "x", "messages": turns(("user", "q"))})[1] == turns(("user", "q"))


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ("text", "expected an object"),
        ({"conversations": turns(("user", "q"))}, "no usable 'id'"),
        ({"id": True, "conversations": turns(("user", "q"))}, "no usable 'id'"),
        ({"id": "x"}, "no 'conversations'"),
        ({"id": "x", "conversations": [{"role": "tool", "content": "r"}]}, "role 'tool'"),
        ({"id": "x", "conversations": turns(("assistant", "a"))}, "before any user turn"),
        (
            {"id": "x", "conversations": turns(("user", "q"), ("assistant", "a"), ("assistant", "b"))},
            "consecutive",
        ),
        ({"id": "x", "conversations": [{"role": "user", "content": None}]}, "content of type NoneType"),
        ({"id": "x", "conversations": turns(("system", "s"))}, "no user turn"),
        ({"id": "x", "conversations": turns(("user", "q"), ("system", "s"))}, "system turn after"),
    ],
)
def test_parse_prompt_row_rejects(row, reason):
    with pytest.raises(G.BadRow, match=reason):
        G.parse_prompt_row(row)


def test_turn_plan_regenerates_every_assistant_turn_and_answers_a_trailing_user_turn():
    assert G.turn_plan(turns(("user", "q"))) == [1]
    assert G.turn_plan(turns(("system", "s"), ("user", "q"), ("assistant", ""))) == [2]
    assert G.turn_plan(turns(("user", "a"), ("assistant", ""), ("user", "b"))) == [1, 3]
    assert G.turn_plan(turns(("user", "a"), ("assistant", ""), ("user", "b"), ("assistant", ""))) == [1, 3]


def chat_doc(message, finish="stop", usage=None, model="m"):
    return json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage or {"prompt_tokens": 3, "completion_tokens": 5},
        }
    ).encode()


def test_parse_completion_reads_sglang_vllm_and_transformers_serve_shapes():
    sg = G.parse_completion(chat_doc({"role": "assistant", "content": "A", "reasoning_content": "R"}))
    assert (sg.content, sg.reasoning, sg.finish_reason, sg.prompt_tokens, sg.completion_tokens, sg.model) == (
        "A",
        "R",
        "stop",
        3,
        5,
        "m",
    )
    vl = G.parse_completion(
        chat_doc({"role": "assistant", "content": "A", "reasoning": "R2"}, finish="length")
    )
    assert (vl.reasoning, vl.finish_reason) == ("R2", "length")
    # transformers serve: content may be null with reasoning only, and extra fields are ignored
    ts = G.parse_completion(
        chat_doc(
            {"role": "assistant", "content": None, "tool_calls": None, "reasoning_content": "only thinking"}
        )
    )
    assert (ts.content, ts.reasoning) == ("", "only thinking")
    no_usage = json.loads(chat_doc({"role": "assistant", "content": "x"}))
    del no_usage["usage"]
    assert G.parse_completion(json.dumps(no_usage).encode()).completion_tokens == 0


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"choices": [', "not JSON"),
        (b"[]", "not a JSON object"),
        (b'{"error": {"message": "boom"}}', "no choices: {'message': 'boom'}"),
        (b'{"choices": [{"finish_reason": "stop"}]}', "no message"),
        (b'{"choices": [{"message": {"content": 3}}]}', "content is a int"),
    ],
)
def test_parse_completion_malformed(body, reason):
    with pytest.raises(G.MalformedResponse, match=reason):
        G.parse_completion(body)


def test_assistant_message_reasoning_modes():
    c = G.Completion("answer", "thoughts", "stop", 1, 2, None)
    assert G.assistant_message(c, "field") == {
        "role": "assistant",
        "content": "answer",
        "reasoning_content": "thoughts",
    }
    assert G.assistant_message(c, "inline") == {
        "role": "assistant",
        "content": "<think>thoughts</think>answer",
    }
    plain = G.Completion("answer", None, "stop", 1, 2, None)
    assert G.assistant_message(plain, "field") == {"role": "assistant", "content": "answer"}
    assert G.assistant_message(plain, "inline") == {"role": "assistant", "content": "answer"}


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://h:1", "http://h:1/v1/chat/completions"),
        ("http://h:1/", "http://h:1/v1/chat/completions"),
        ("http://h:1/v1", "http://h:1/v1/chat/completions"),
        ("https://h/v1/", "https://h/v1/chat/completions"),
        ("http://h:1/v1/chat/completions", "http://h:1/v1/chat/completions"),
        ("http://router:30100/proxy", "http://router:30100/proxy/v1/chat/completions"),
    ],
)
def test_normalize_endpoint(url, expected):
    assert G.normalize_endpoint(url) == expected


def test_normalize_endpoint_rejects_non_http():
    with pytest.raises(JobError, match="not an http"):
        G.normalize_endpoint("127.0.0.1:30000")


def test_retry_after_seconds_and_http_dates():
    assert G.parse_retry_after("2") == 2.0
    assert G.parse_retry_after("0.5") == 0.5
    assert G.parse_retry_after("-3") == 0.0
    assert G.parse_retry_after(None) is None
    assert G.parse_retry_after("soon") is None
    date = email.utils.formatdate(1000.0 + 30, usegmt=True)
    assert G.parse_retry_after(date, now=1000.0) == pytest.approx(30, abs=1)


def test_backoff_grows_is_capped_and_jittered():
    rng = random.Random(0)
    for attempt, nominal in [(1, 1.0), (2, 2.0), (3, 4.0), (10, 30.0)]:
        values = [G.backoff_delay(attempt, 1.0, 30.0, rng) for _ in range(200)]
        assert nominal / 2 <= min(values) and max(values) <= nominal
        assert max(values) - min(values) > nominal / 4  # really jittered


def test_resolve_inputs(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("")
    assert G.resolve_inputs([str(f)]) == [f]
    d = tmp_path / "set"
    d.mkdir()
    (d / "b.jsonl").write_text("")
    (d / "a.jsonl").write_text("")
    assert [p.name for p in G.resolve_inputs([str(d)])] == ["a.jsonl", "b.jsonl"]
    (d / "manifest.json").write_text(json.dumps({"shards": [{"path": "b.jsonl"}]}))
    assert [p.name for p in G.resolve_inputs([str(d)])] == ["b.jsonl"]
    with pytest.raises(JobError, match="build the prompt set first"):
        G.resolve_inputs([str(tmp_path / "nope.jsonl")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(JobError, match="holds no"):
        G.resolve_inputs([str(tmp_path / "empty")])


def test_request_body_holds_only_what_was_asked_for():
    s = G.Settings(inputs=[], output_dir=None, endpoints=[], model="m", concurrency=1, max_tokens=9)
    assert s.base_body() == {"model": "m", "max_tokens": 9}
    s.temperature, s.top_p, s.chat_template_kwargs, s.extra_body = (
        0.6,
        0.95,
        {"thinking": True},
        {"top_k": 20},
    )
    assert s.base_body() == {
        "model": "m",
        "max_tokens": 9,
        "temperature": 0.6,
        "top_p": 0.95,
        "chat_template_kwargs": {"thinking": True},
        "top_k": 20,
    }
    assert s.provenance()["sampling"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_reservoir_quantiles_exact_while_small():
    r = Reservoir(size=1000)
    for v in range(1, 101):
        r.add(float(v))
    assert r.quantile(0.5) == 50.0
    assert r.quantile(0.99) == 99.0
    big = Reservoir(size=100, seed=1)
    for v in range(10_000):
        big.add(float(v))
    assert len(big.samples) == 100 and 2500 < big.quantile(0.5) < 7500


def test_endpoint_pool_circuit_probe_and_pause():
    async def main():
        ep = G.Endpoint("http://a", "http://a/v1/chat/completions", limit=2)
        pool = G.EndpointPool([ep], threshold=2, cooldown=0.05, cooldown_max=0.1, max_outage=10)
        pool.release(*(await pool.acquire()), "down")
        assert ep.state == "closed"
        pool.release(*(await pool.acquire()), "down")
        assert ep.state == "open" and pool.outage_since is not None
        # while open nobody gets the endpoint; after the cooldown exactly one probe does
        first = asyncio.create_task(pool.acquire())
        second = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0.01)
        assert not first.done()
        got, probe = await asyncio.wait_for(first, 1)
        assert probe and ep.state == "half_open"
        await asyncio.sleep(0.1)
        assert not second.done()  # one probe at a time
        pool.release(got, probe, "ok")
        assert ep.state == "closed" and pool.outage_since is None
        got, probe = await asyncio.wait_for(second, 1)
        assert not probe
        # a 429 pauses the endpoint for Retry-After without opening the circuit
        t0 = time.monotonic()
        pool.release(got, probe, "paused", retry_after=0.1)
        got, probe = await asyncio.wait_for(pool.acquire(), 1)
        assert time.monotonic() - t0 >= 0.09 and ep.state == "closed"
        pool.close()

    asyncio.run(main())


def test_endpoint_pool_prefers_the_least_loaded_and_keeps_affinity():
    async def main():
        a = G.Endpoint("http://a", "http://a/v1/chat/completions", limit=4)
        b = G.Endpoint("http://b", "http://b/v1/chat/completions", limit=4)
        pool = G.EndpointPool([a, b], threshold=3, cooldown=1, cooldown_max=1, max_outage=10)
        taken = [await pool.acquire() for _ in range(4)]
        assert (a.in_flight, b.in_flight) == (2, 2)
        # a multi-turn conversation goes back to its endpoint while that one has room
        pool.release(*taken[0], "ok")
        ep, _ = await pool.acquire(taken[0][0])
        assert ep is taken[0][0]
        pool.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("rid", "reason"),
    [("a\x00b", "holds the control character '\\x00'"), ("x\ud800", "holds a lone surrogate (\\ud800")],
)
def test_ids_with_control_characters_or_lone_surrogates_are_invalid_rows(rid, reason):
    from regen.jobs.generate import BadRow, parse_prompt_row

    with pytest.raises(BadRow) as caught:
        parse_prompt_row({"id": rid, "conversations": [{"role": "user", "content": "hi"}]})
    assert reason in str(caught.value)
