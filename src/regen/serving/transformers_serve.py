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
                body = json.dumps({"error": "Unauthorized: send the API key as 'Authorization: Bearer KEY'"})
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body.encode()})
                return
        await self.app(scope, receive, send)


def _wrap_build_server(build_server, api_key: str):
    @functools.wraps(build_server)
    def wrapped(*args, **kwargs):
        app = build_server(*args, **kwargs)
        app.add_middleware(BearerKeyMiddleware, api_key=api_key)
        return app

    return wrapped


def require_api_key(api_key: str) -> None:
    """Make every server transformers builds from now on ask for `api_key` (see the module docstring)."""
    import transformers
    from transformers.cli.serving import server

    if not hasattr(server, "build_server"):
        raise SystemExit(
            f"regen.serving.transformers_serve: transformers {transformers.__version__} has no "
            "transformers.cli.serving.server.build_server, where the API key is enforced; this hook was "
            f"written for transformers {WRITTEN_FOR} (the version the locks pin): install that"
        )
    if getattr(server, "_regen_api_key_installed", False):
        return
    server.build_server = _wrap_build_server(server.build_server, api_key)
    server._regen_api_key_installed = True


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
    api_key = os.environ.pop(API_KEY_ENV, "")
    if api_key:
        require_api_key(api_key)
    from transformers.cli.transformers import main as transformers_main

    sys.argv = ["transformers", *(sys.argv[1:] if argv is None else argv)]
    transformers_main()


if __name__ == "__main__":
    main()
