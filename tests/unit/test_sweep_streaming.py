"""Streaming: the SSE parser and timing on recorded demo-server streams, and the slow-tokenizer decoder.

The demo server is `transformers serve`, which streams only through a Rust tokenizer; the demo model's
tokenizer (like Kimi's) is tiktoken in Python, so regen.serving.transformers_serve gives its streamers an
`IncrementalDecoder`. The recorded streams in tests/fixtures/sweep are that server's real output.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from regen.serving.streaming import StreamError, StreamTiming, parse_sse_events, streaming_body
from regen.serving.transformers_serve import (
    REPLACEMENT,
    IncrementalDecoder,
    has_rust_backend,
    request_allowed,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sweep"


def test_a_recorded_stream_times_first_token_and_counts_tokens_from_usage() -> None:
    lines = (FIXTURES / "transformers_serve_stream.sse").read_bytes().splitlines()
    events = list(parse_sse_events(lines))
    assert len(events) == 7 and events[0]["choices"][0]["delta"] == {"role": "assistant"}
    timing = StreamTiming(started=0.0)
    for at, event in enumerate(events, 1):
        timing.feed(event, now=at * 0.1)
    result = timing.result(ended=1.0)
    # The role chunk carries no text: the first token is the second event.
    assert result["ttft_s"] == pytest.approx(0.2)
    assert result["output_tokens"] == 8 and result["tokens_counted_by"] == "usage"
    assert result["tpot_s"] == pytest.approx((1.0 - 0.2) / 7)
    assert result["finish_reason"] == "length"
    assert result["text"].startswith("007")


def test_a_stream_without_usage_is_counted_by_chunks_and_says_so() -> None:
    timing = StreamTiming(started=0.0)
    for at, piece in enumerate(["a", "", "b", "c"], 1):
        timing.feed({"choices": [{"delta": {"content": piece}}]}, now=float(at))
    result = timing.result(ended=5.0)
    assert (result["output_tokens"], result["tokens_counted_by"]) == (3, "chunks")
    assert result["ttft_s"] == 1.0


def test_the_servers_mid_stream_error_is_raised_with_its_words() -> None:
    lines = (FIXTURES / "transformers_serve_cb_error.sse").read_bytes().splitlines()
    with pytest.raises(StreamError, match="index_copy_"):
        list(parse_sse_events(lines))


def test_sse_edge_cases() -> None:
    assert list(parse_sse_events([b": keep-alive", b"event: x", b"data: [DONE]", b"data: {}"])) == [None]
    with pytest.raises(StreamError, match="not JSON"):
        list(parse_sse_events(["data: {oops"]))
    with pytest.raises(StreamError, match="without a single content token"):
        StreamTiming(started=0.0).result(ended=1.0)


def test_the_streamed_body_is_the_generation_jobs_body_plus_stream() -> None:
    body = streaming_body(
        {"model": "m", "max_tokens": 8, "temperature": 0.0}, [{"role": "user", "content": "x"}]
    )
    assert body == {
        "model": "m",
        "max_tokens": 8,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_model_dir), trust_remote_code=True)


def _pieces(tokenizer, ids, skip=True):
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip)
    return [piece for piece in (decoder.step(i) for i in ids) if piece is not None]


@pytest.mark.parametrize("text", ["Hello, world!", "naïve café — 数学 🙂 done", "a\n\n  b\tc"])
def test_incremental_decoding_of_real_text_equals_decoding_it_whole(demo_tokenizer, text: str) -> None:
    ids = demo_tokenizer.encode(text, add_special_tokens=False)
    pieces = _pieces(demo_tokenizer, ids)
    assert "".join(pieces) == demo_tokenizer.decode(ids, skip_special_tokens=True) == text
    # Multi-byte characters split over byte tokens are held back until whole: no piece carries U+FFFD.
    assert not any(REPLACEMENT in piece for piece in pieces)


def test_incremental_decoding_of_random_ids_is_a_prefix_of_the_whole(demo_tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(demo_tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        whole = demo_tokenizer.decode(ids, skip_special_tokens=True)
        joined = "".join(_pieces(demo_tokenizer, ids))
        assert whole.startswith(joined)
        if not whole.endswith(REPLACEMENT):
            assert joined == whole


def test_the_demo_tokenizer_has_no_rust_backend_which_is_why_the_hook_exists(demo_tokenizer) -> None:
    assert not has_rust_backend(demo_tokenizer)


def test_installed_hooks_let_transformers_streamer_decode_a_python_tokenizer(demo_model_dir: Path) -> None:
    # In a child process: install() changes transformers' serving classes for the whole interpreter.
    script = f"""
import asyncio, json
from transformers import AutoTokenizer
from regen.serving import transformers_serve as ts
ts.install()
from transformers.cli.serving import utils
tok = AutoTokenizer.from_pretrained({str(demo_model_dir)!r}, trust_remote_code=True)
view = ts._StreamingView(tok)
# What GenerateManager.generate_streaming resolves for the view the hook passes it.
handle = getattr(view, "tokenizer", view)._tokenizer
loop = asyncio.new_event_loop()
queue = asyncio.Queue()
streamer = utils.DirectStreamer(handle, loop, queue)
import torch
ids = tok.encode("naïve café 数学", add_special_tokens=False)
streamer.put(torch.tensor([1, 2]))  # the prompt: skipped
streamer.put(torch.tensor(ids))
loop.run_until_complete(asyncio.sleep(0))
out = []
while not queue.empty():
    out.append(queue.get_nowait())
print(json.dumps(["".join(out), tok.decode(ids)]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    streamed, whole = json.loads(done.stdout.strip().splitlines()[-1])
    assert streamed == whole == "naïve café 数学"


@pytest.mark.parametrize(
    ("method", "path", "authorization", "allowed"),
    [
        ("GET", "/health", None, True),  # probes read these without a secret
        ("GET", "/health_generate", None, True),
        ("GET", "/metrics", None, True),
        ("OPTIONS", "/v1/chat/completions", None, True),  # a CORS preflight carries no credentials
        ("GET", "/v1/models", None, False),
        ("POST", "/v1/chat/completions", "Bearer other", False),
        ("POST", "/v1/chat/completions", "Basic s3cret", False),
        ("POST", "/v1/chat/completions", "Bearer s3cret", True),
        ("POST", "/v1/chat/completions", "bearer s3cret", True),
        ("POST", "/load_model", "Bearer s3cret-and-more", False),
        ("GET", "/v1/models/../health", None, False),  # a prefix match on the path as given, not a guess
    ],
)
def test_the_cpu_servers_api_key_guards_all_but_the_probes(method, path, authorization, allowed):
    assert request_allowed(method, path, authorization, "s3cret") is allowed
