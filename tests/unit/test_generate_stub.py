"""The STUB OpenAI-compatible server: every fault switch does what the generation tests rely on."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request

import pytest

from tests.helpers.stub_openai_server import StubConfig, StubServer, spawn


@pytest.fixture
def stub():
    with StubServer(StubConfig(record=True)) as s:
        yield s


def post(url: str, body: dict, timeout: float = 5.0, headers: dict | None = None):
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def chat(stub, messages=None, **extra):
    body = {"model": "m", "messages": messages or [{"role": "user", "content": "hello there"}], **extra}
    return post(stub.url + "/v1/chat/completions", body)


def test_answers_like_an_openai_server(stub):
    status, _, data = chat(stub, max_tokens=100)
    doc = json.loads(data)
    assert status == 200 and doc["object"] == "chat.completion" and doc["model"] == "m"
    choice = doc["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"].startswith("stub reply 1 to: hello there")
    assert "reasoning_content" not in choice["message"]
    assert doc["usage"]["completion_tokens"] == 16
    # the base path without /v1 works too, and /v1/models lists the model
    assert post(stub.url + "/chat/completions", {"messages": [{"role": "user", "content": "x"}]})[0] == 200
    models = json.loads(urllib.request.urlopen(stub.url + "/v1/models", timeout=5).read())
    assert models["data"][0]["id"] == "stub-model"


def test_turn_number_follows_the_conversation(stub):
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    content = json.loads(chat(stub, msgs)[2])["choices"][0]["message"]["content"]
    assert content.startswith("stub reply 2 to: c")


def test_length_finish_from_max_tokens_and_switch(stub):
    doc = json.loads(chat(stub, max_tokens=4)[2])
    assert doc["choices"][0]["finish_reason"] == "length" and doc["usage"]["completion_tokens"] == 4
    stub.configure(length_rate=1.0)
    assert json.loads(chat(stub)[2])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("never", {"thinking": True}, False),
        ("always", {}, True),
        ("when_thinking", {}, False),
        ("when_thinking", {"thinking": True}, True),
        ("when_thinking", {"enable_thinking": True}, True),
        ("when_thinking", {"enable_thinking": False}, False),
    ],
)
def test_reasoning_content_switch(stub, mode, kwargs, expected):
    stub.configure(reasoning=mode)
    msg = json.loads(chat(stub, chat_template_kwargs=kwargs)[2])["choices"][0]["message"]
    assert ("reasoning_content" in msg) is expected


@pytest.mark.parametrize("status", [429, 500, 503])
def test_http_errors(stub, status):
    stub.configure(error_rate=1.0, error_status=[status], retry_after=2)
    code, headers, data = chat(stub)
    assert code == status and f"HTTP {status}" in json.loads(data)["error"]["message"]
    assert (headers.get("Retry-After") == "2") is (status == 429)


def test_connection_reset(stub):
    stub.configure(reset_rate=1.0)
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError, urllib.error.URLError)):
        chat(stub)
    assert stub.stats["fault_reset"] == 1


def test_stall_holds_the_answer_back(stub):
    stub.configure(stall_rate=1.0, stall_seconds=30)
    with pytest.raises((TimeoutError, socket.timeout, urllib.error.URLError)):
        post(stub.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, timeout=0.3)


def test_malformed_json(stub):
    stub.configure(malformed_rate=1.0)
    status, _, data = chat(stub)
    assert status == 200
    with pytest.raises(ValueError):
        json.loads(data)


def test_fail_first_fails_each_distinct_request_n_times(stub):
    stub.configure(fail_first=2, fail_kind="500")
    a = [{"role": "user", "content": "a"}]
    b = [{"role": "user", "content": "b"}]
    assert [chat(stub, a)[0] for _ in range(3)] == [500, 500, 200]
    assert [chat(stub, b)[0] for _ in range(3)] == [500, 500, 200]


def test_fail_match_poisons_matching_prompts_only(stub):
    stub.configure(fail_match="POISON", fail_kind="500")
    assert chat(stub, [{"role": "user", "content": "a POISON pill"}])[0] == 500
    assert chat(stub, [{"role": "user", "content": "a POISON pill"}])[0] == 500
    assert chat(stub, [{"role": "user", "content": "healthy"}])[0] == 200


def test_down_switch_and_runtime_config(stub):
    stub.configure(down=True)
    assert chat(stub)[0] == 503
    stub.configure(down_mode="reset")
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError, urllib.error.URLError)):
        chat(stub)
    # the control endpoint changes switches of a running stub (used from other processes)
    assert post(stub.url + "/stub/config", {"down": False})[0] == 200
    assert chat(stub)[0] == 200
    code, _, data = post(stub.url + "/stub/config", {"nonsense": 1})
    assert code == 400 and "unknown stub setting" in json.loads(data)["error"]


def test_records_requests_and_rejects_bad_bodies(stub):
    post(
        stub.url + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_p": 0.9},
        headers={"Authorization": "Bearer k"},
    )
    assert stub.requests[-1]["authorization"] == "Bearer k"
    assert stub.requests[-1]["body"]["top_p"] == 0.9
    assert post(stub.url + "/v1/chat/completions", {"model": "m"})[0] == 400


def test_refuses_non_loopback_addresses():
    with pytest.raises(SystemExit, match="only binds loopback"):
        StubServer(host="0.0.0.0")


def test_runs_as_its_own_process():
    proc, url = spawn(["--delay", "0", "--model-name", "other"])
    try:
        models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=5).read())
        assert models["data"][0]["id"] == "other"
    finally:
        proc.terminate()
        proc.wait(10)
