"""The STUB fault-injection proxy of the fault campaign, in front of the STUB OpenAI server (both on
loopback): forwarding, injected errors, a hang released by clear(), a dead upstream, loopback only."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest

from tests.helpers.fault_proxy import FaultProxy
from tests.helpers.stub_openai_server import StubServer


def _get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_forwards_injects_holds_and_releases() -> None:
    with StubServer() as upstream, FaultProxy(upstream.url) as proxy:
        assert proxy.port != 0 and proxy.url.startswith("http://127.0.0.1:")
        status, body = _get(proxy.url + "/v1/models")
        assert status == 200 and body == _get(upstream.url + "/v1/models")[1]
        assert proxy.stats["forwarded"] == 1

        proxy.errors(1.0, (503,))
        status, body = _get(proxy.url + "/v1/models")
        assert status == 503 and b"injected HTTP 503" in body and proxy.stats["injected_503"] == 1

        proxy.clear()
        proxy.hang()
        answers: list[int] = []
        held = threading.Thread(target=lambda: answers.append(_get(proxy.url + "/v1/models")[0]))
        held.start()
        held.join(1.0)
        assert held.is_alive() and not answers, "a hung proxy answered"
        proxy.clear()
        held.join(10)
        assert answers == [200] and proxy.stats["held"] == 1


def test_a_dead_upstream_is_a_closed_connection() -> None:
    with StubServer() as upstream:
        dead = upstream.url
    with FaultProxy(dead) as proxy:
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(proxy.url + "/v1/models", timeout=10).read()
        assert proxy.stats["upstream_down"] == 1


def test_binds_loopback_only() -> None:
    with pytest.raises(ValueError, match="loopback only"):
        FaultProxy("http://127.0.0.1:1", host="0.0.0.0")
