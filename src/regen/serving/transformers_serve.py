"""`transformers serve` with streaming for Python tokenizers, and with an API key (the CPU demo server).

    python -m regen.serving.transformers_serve serve MODEL_DIR [transformers serve's own flags]

transformers 5.24's server streams a chat completion (`"stream": true`) by decoding each new token with
the `tokenizers` library's `DecodeStream`, which needs the Rust tokenizer behind a "fast" tokenizer
(`tokenizer._tokenizer`). A tokenizer written in Python, as Kimi's tiktoken tokenizer (and so the demo
model's) is, has none, and every streamed request fails with "TikTokenTokenizer has no attribute
_tokenizer" (the same attribute that huggingface/transformers#45362 and #45406 ran into for processors).
Non-streamed requests work. The layout sweep needs streaming: time to first token exists only there.

This launcher keeps transformers' server as it is and adds one thing: when the served tokenizer has no
Rust backend, its streamers decode with `IncrementalDecoder` below (the classic prefix/read-offset
method: decode a short window of ids and emit only the text that became final), and tokenizers that
have one keep `DecodeStream`. It then hands over to transformers' own CLI. The hooks name the
transformers internals they wrap and fail at start-up, with the pinned version, if those moved.

transformers' server has no authentication, so on its own it may only listen on loopback. When the
environment holds `REGEN_SERVING_API_KEY` (the serve stage's 0600 environment file, read by systemd or by
regen's supervisor; never on the command line), every request needs `Authorization: Bearer <key>`, as
SGLang's `--api-key` asks, except the health, readiness and metrics paths that probes read without a
secret. That is what lets a generation host elsewhere use the CPU server (docs/multi-host.md, layout 2).

sglang-router 0.3.2 parses each chat completion into SGLang's request type and forwards it with SGLang's
own fields filled in at their defaults (`skip_special_tokens: true`, `separate_reasoning: true`, ...,
`SGLANG_CHAT_DEFAULTS`). transformers' server refuses every field it does not know (422 "Unexpected
fields"), so without help no chat completion passes a router to the CPU server. `SGLangFieldsMiddleware`
takes those fields out of a chat completion when each holds SGLang's default, which is what transformers
does anyway; a field set to anything else asks for behaviour this server does not have, and is refused
with 400 naming it, rather than ignored.
"""

from __future__ import annotations

import functools
import hmac
import json
import os
import sys
from typing import Any

# Where the serve stage puts the key (the same variable the router and the jobs read).
from regen.module_utils.regen_secrets import API_KEY_ENV

REPLACEMENT = "\ufffd"
# Paths a probe reads without a secret (SGLang's own list: health, readiness, metrics; by prefix, so
# /health_generate too).
OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics")
# The transformers version these hooks were written against (the controller and demo-serving locks).
WRITTEN_FOR = "5.24.0"


class IncrementalDecoder:
    """Turns token ids, one at a time, into the text each one makes final (None while it is not yet).

    `step(token_id)` returns the new text, or None when the ids so far end inside a multi-byte
    character (their decoded tail is U+FFFD) or add no text. Only a few ids before the unread ones are
    decoded again, so a long answer costs O(1) per token. Joined, the pieces equal
    `tokenizer.decode(all_ids, skip_special_tokens=...)` whenever that ends on a complete character.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # where the window that re-establishes context starts
        self._read_offset = 0  # ids before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str | None:
        self._ids.append(int(token_id))
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return None
        # The prefix decodes the same inside the longer window (byte-level BPE joins bytes, never rewrites
        # them), so what follows it is new.
        new_text = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text


class PythonTokenizerHandle:
    """Stands where transformers' streamers expect the Rust tokenizer, for a tokenizer that has none."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer


class _StreamingView:
    """The served tokenizer as the streaming code reads it: everything delegated, plus `_tokenizer`.

    `generate_streaming` resolves `getattr(processor, "tokenizer", processor)._tokenizer`; this view answers
    that with a `PythonTokenizerHandle` and passes every other attribute (generate's stop strings, the chat
    template) to the real tokenizer.
    """

    def __init__(self, tokenizer: Any):
        object.__setattr__(self, "_wrapped", tokenizer)
        object.__setattr__(self, "_tokenizer", PythonTokenizerHandle(tokenizer))

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_wrapped"), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return object.__getattribute__(self, "_wrapped")(*args, **kwargs)

    def __len__(self) -> int:
        return len(object.__getattribute__(self, "_wrapped"))


def has_rust_backend(processor: Any) -> bool:
    """Whether transformers' streaming path can find a Rust tokenizer behind `processor`."""
    tokenizer = getattr(processor, "tokenizer", processor)
    try:
        getattr(tokenizer, "_tokenizer")  # noqa: B009 - a PreTrainedTokenizer raises from __getattr__
    except AttributeError:
        return False
    return True


def _wrap_generate_streaming(method):
    @functools.wraps(method)
    def generate_streaming(self, model, processor, *args, **kwargs):
        if not has_rust_backend(processor):
            processor = _StreamingView(getattr(processor, "tokenizer", processor))
        return method(self, model, processor, *args, **kwargs)

    return generate_streaming


def _wrap_streamer_init(init, tokenizer_position: int):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        handle = args[tokenizer_position] if len(args) > tokenizer_position else kwargs.get("tokenizer")
        if isinstance(handle, PythonTokenizerHandle):
            # The same choice as transformers' own streamers: keep special tokens only for a response parser.
            decoder = IncrementalDecoder(handle.tokenizer, skip_special_tokens=self._parser is None)
            self._decode_stream = _DecodeStreamAdapter(decoder)

    return __init__


class _DecodeStreamAdapter:
    """`DecodeStream.step(tokenizer, id)`'s signature over an `IncrementalDecoder`."""

    def __init__(self, decoder: IncrementalDecoder):
        self._decoder = decoder

    def step(self, _tokenizer: Any, token_id: int) -> str | None:
        return self._decoder.step(token_id)


def request_allowed(method: str, path: str, authorization: str | None, api_key: str) -> bool:
    """Whether a request may reach the server: open paths and CORS preflights always, the rest with the key.

    The key is compared in constant time, so the answer's timing says nothing about how much of it matched.
    """
    if method == "OPTIONS" or path.startswith(OPEN_PATH_PREFIXES):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())


class BearerKeyMiddleware:
    """ASGI middleware: a request without the right bearer token gets 401 and never reaches transformers.

    Plain ASGI rather than an `@app.middleware("http")` function, so a streamed answer and a client's
    disconnect pass through untouched.
    """

    def __init__(self, app: Any, api_key: str):
        if not api_key:
            raise ValueError("BearerKeyMiddleware needs a non-empty API key")
        self.app = app
        self._api_key = api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            authorization = headers.get(b"authorization", b"").decode("latin-1") or None
            if not request_allowed(scope["method"], scope["path"], authorization, self._api_key):
                refusal = {"error": "Unauthorized: send the API key as 'Authorization: Bearer KEY'"}
                await _send_json(send, 401, refusal, [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


# SGLang 0.5.23's ChatCompletionRequest fields that sglang-router 0.3.2 always sends, with SGLang's default
# for each (sglang/srt/entrypoints/openai/protocol.py; the body a router forwards is recorded in
# tests/fixtures/serving/router-forwarded-chat.json). Each default is what transformers' server does.
SGLANG_CHAT_DEFAULTS: dict[str, Any] = {
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"


class UnsupportedField(ValueError):
    """A request sets an SGLang field to a value this server cannot honour."""


def strip_sglang_defaults(body: dict[str, Any]) -> dict[str, Any]:
    """`body` without the SGLang-only fields that hold SGLang's default; refuses any other value of them."""
    changed = {name: body[name] for name in SGLANG_CHAT_DEFAULTS if name in body}
    refused = sorted(name for name, value in changed.items() if value != SGLANG_CHAT_DEFAULTS[name])
    if refused:
        detail = ", ".join(f"{name}={json.dumps(body[name])} (SGLang's default: "
                           f"{json.dumps(SGLANG_CHAT_DEFAULTS[name])})" for name in refused)
        raise UnsupportedField(
            f"the CPU server (transformers serve) cannot honour {detail}; send SGLang's default or leave "
            "the field out"
        )
    if not changed:
        return body
    return {key: value for key, value in body.items() if key not in changed}


class SGLangFieldsMiddleware:
    """ASGI middleware: a chat completion loses the SGLang fields at their defaults before transformers
    validates it (see the module docstring); one that sets them otherwise gets 400 naming them.

    Only POST /v1/chat/completions is read; every other request, and every response, passes untouched.
    """

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != CHAT_COMPLETIONS_PATH:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending its body
                await self.app(scope, _replay([message]), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None  # transformers answers a body that is not JSON in its own words
        if isinstance(body, dict):
            try:
                stripped = strip_sglang_defaults(body)
            except UnsupportedField as exc:
                await _send_json(send, 400, {"error": {"message": str(exc), "type": "invalid_request_error"}})
                return
            if stripped is not body:
                raw = json.dumps(stripped).encode()
                headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-length"]
                scope = {**scope, "headers": [*headers, (b"content-length", str(len(raw)).encode())]}
        await self.app(scope, _replay([{"type": "http.request", "body": raw, "more_body": False}], receive),
                       send)


def _replay(messages: list[dict], then: Any = None) -> Any:
    """An ASGI `receive` that returns `messages` first, then defers to `then` (a disconnect, later)."""
    pending = list(messages)

    async def receive() -> dict:
        if pending:
            return pending.pop(0)
        if then is None:
            return {"type": "http.disconnect"}
        return await then()

    return receive


async def _send_json(send: Any, status: int, payload: dict, headers: list | tuple = ()) -> None:
    """An ASGI JSON answer that never reaches transformers (a refusal of the middlewares here)."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *headers]})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


def _wrap_build_server(build_server, api_key: str):
    @functools.wraps(build_server)
    def wrapped(*args, **kwargs):
        app = build_server(*args, **kwargs)
        # Starlette runs the middleware added last first: the key is checked before a body is read.
        app.add_middleware(SGLangFieldsMiddleware)
        if api_key:
            app.add_middleware(BearerKeyMiddleware, api_key=api_key)
        return app

    return wrapped


def wrap_server(api_key: str) -> None:
    """Make every server transformers builds from now on accept a router's SGLang fields (see the module
    docstring) and, with a non-empty `api_key`, ask for that key."""
    import transformers
    from transformers.cli.serving import server

    if not hasattr(server, "build_server"):
        raise SystemExit(
            f"regen.serving.transformers_serve: transformers {transformers.__version__} has no "
            "transformers.cli.serving.server.build_server, where the API key and the router's fields are "
            f"handled; this hook was written for transformers {WRITTEN_FOR} (the version the locks pin): "
            "install that"
        )
    if getattr(server, "_regen_server_wrapped", False):
        return
    server.build_server = _wrap_build_server(server.build_server, api_key)
    server._regen_server_wrapped = True


def install() -> None:
    """Teach transformers' serving streamers to decode with tokenizers written in Python."""
    import transformers
    from transformers.cli.serving import utils

    missing = [
        name
        for name in ("GenerateManager", "CBGenerateManager", "DirectStreamer", "CBStreamer")
        if not hasattr(utils, name)
    ]
    if missing:
        raise SystemExit(
            f"regen.serving.transformers_serve: transformers {transformers.__version__} has no "
            f"transformers.cli.serving.utils.{', '.join(missing)}; these hooks were written for transformers "
            f"{WRITTEN_FOR} (the version the locks pin): install that, or serve without streaming"
        )
    if getattr(utils, "_regen_streaming_installed", False):
        return
    for manager in (utils.GenerateManager, utils.CBGenerateManager):
        manager.generate_streaming = _wrap_generate_streaming(manager.generate_streaming)
    # Positional arguments after self: DirectStreamer(tokenizer, loop, queue, response_parser),
    # CBStreamer(cb_manager, request_id, tokenizer, loop, queue, response_parser).
    utils.DirectStreamer.__init__ = _wrap_streamer_init(utils.DirectStreamer.__init__, 0)
    utils.CBStreamer.__init__ = _wrap_streamer_init(utils.CBStreamer.__init__, 2)
    utils._regen_streaming_installed = True


def main(argv: list[str] | None = None) -> None:
    install()
    # Taken out of the environment, so nothing the server starts inherits it.
    wrap_server(os.environ.pop(API_KEY_ENV, ""))
    from transformers.cli.transformers import main as transformers_main

    sys.argv = ["transformers", *(sys.argv[1:] if argv is None else argv)]
    transformers_main()


if __name__ == "__main__":
    main()
