"""The CPU server behind sglang-router: the SGLang fields a router adds to every chat completion.

The body is the one sglang-router 0.3.2 really forwarded (tests/fixtures/serving/router-forwarded-chat.json);
the validator is transformers' own (`ChatCompletionHandler._validate_request`), so these tests fail if
transformers starts or stops refusing a field. The whole path (router process, CPU server) runs in
tests/integration/test_serve_role.py and the molecule scenario `serve`.
"""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path

import pytest

from regen.serving.transformers_serve import (
    SGLANG_CHAT_DEFAULTS,
    SGLangFieldsMiddleware,
    UnsupportedField,
    strip_sglang_defaults,
)

RECORDED = json.loads(
    (Path(__file__).resolve().parents[1] / "fixtures" / "serving" / "router-forwarded-chat.json").read_text()
)


def _transformers_validate(body: dict) -> None:
    """transformers 5.24's own check of a chat completion's fields (raises its HTTPException on 422)."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler

    ChatCompletionHandler._validate_request(ChatCompletionHandler.__new__(ChatCompletionHandler), body)


def test_transformers_refuses_what_the_router_forwards_and_accepts_it_without_the_defaults() -> None:
    from fastapi import HTTPException

    forwarded = RECORDED["forwarded_body"]
    with pytest.raises(HTTPException) as refused:
        _transformers_validate(forwarded)
    assert refused.value.status_code == 422
    # transformers names the fields it refuses as a set; each is one this module knows SGLang's default of.
    refused_fields = ast.literal_eval(refused.value.detail.partition(": ")[2])
    assert refused_fields and refused_fields <= set(SGLANG_CHAT_DEFAULTS)
    stripped = strip_sglang_defaults(forwarded)
    _transformers_validate(stripped)
    assert stripped == {k: v for k, v in forwarded.items() if k not in SGLANG_CHAT_DEFAULTS}
    assert forwarded == RECORDED["forwarded_body"]  # the caller's body is left as it was


def test_a_body_without_sglang_fields_is_returned_as_it_is() -> None:
    body = dict(RECORDED["client_body"])
    assert strip_sglang_defaults(body) is body


@pytest.mark.parametrize("name", sorted(SGLANG_CHAT_DEFAULTS))
def test_an_sglang_field_set_otherwise_is_refused_naming_it(name: str) -> None:
    body = {**RECORDED["forwarded_body"], name: not SGLANG_CHAT_DEFAULTS[name]}
    with pytest.raises(UnsupportedField) as refused:
        strip_sglang_defaults(body)
    assert f"{name}={json.dumps(body[name])}" in str(refused.value)
    assert "default" in str(refused.value)


def _call(app, method: str, path: str, body: bytes, chunks: int = 1) -> tuple[int, bytes, list[dict]]:
    """Runs one request through an ASGI app; the body arrives in `chunks` parts."""
    size = -(-len(body) // chunks) if body else 0
    parts = [body[i : i + size] for i in range(0, len(body), size)] if body else [b""]
    messages = [{"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
                for i, part in enumerate(parts)]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b"",
             "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
             "root_path": ""}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), sent


def _app():
    """A FastAPI app whose chat completion route checks its body with transformers' validator, as the CPU
    server's route does, and echoes what it received."""
    from fastapi import FastAPI

    app = FastAPI()
    seen: list[dict] = []

    @app.post("/v1/chat/completions")
    async def chat(body: dict) -> dict:
        _transformers_validate(body)
        seen.append(body)
        return {"received": body}

    @app.post("/v1/other")
    async def other(body: dict) -> dict:
        seen.append(body)
        return {"received": body}

    return app, seen


@pytest.mark.parametrize("chunks", [1, 3])
def test_the_middleware_lets_a_routed_chat_completion_through(chunks: int) -> None:
    app, seen = _app()
    raw = json.dumps(RECORDED["forwarded_body"]).encode()
    assert _call(app, "POST", "/v1/chat/completions", raw)[0] == 422  # the server alone refuses it
    status, body, _ = _call(SGLangFieldsMiddleware(app), "POST", "/v1/chat/completions", raw, chunks)
    assert status == 200, body
    assert seen[-1] == strip_sglang_defaults(RECORDED["forwarded_body"])


def test_the_middleware_answers_400_naming_a_field_it_cannot_honour() -> None:
    app, seen = _app()
    raw = json.dumps({**RECORDED["forwarded_body"], "ignore_eos": True}).encode()
    status, body, _ = _call(SGLangFieldsMiddleware(app), "POST", "/v1/chat/completions", raw)
    assert status == 400 and seen == []
    assert "ignore_eos=true" in json.loads(body)["error"]["message"]


def test_the_middleware_leaves_other_paths_and_bodies_that_are_not_json_to_the_server() -> None:
    app, seen = _app()
    raw = json.dumps({"ignore_eos": True}).encode()
    assert _call(SGLangFieldsMiddleware(app), "POST", "/v1/other", raw)[0] == 200
    assert seen == [{"ignore_eos": True}]
    status, _, _ = _call(SGLangFieldsMiddleware(app), "POST", "/v1/chat/completions", b"{not json")
    assert status == 422  # FastAPI's own answer to a body that is not JSON
