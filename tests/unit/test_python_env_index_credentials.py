"""An index URL with credentials (``https://user:token@mirror/simple``) given to python_venv and wheelhouse:
pip must get it (through PIP_INDEX_URL), but no process's command line may show it while pip runs (``ps``),
and nothing the module returns may hold the password.

The index is a real HTTP server on loopback that records each request's Authorization header and serves
nothing (404), so pip asks it and then fails, as with a mirror that lacks the package.
"""

from __future__ import annotations

import base64
import http.server
import json
import sys
import threading
from pathlib import Path
from typing import ClassVar

import pytest

from tests.helpers.modules import run_module

PASSWORD = "s3cret-Zq9Wv3"
LOCK = "regen-no-such-package==1.0 --hash=sha256:" + "0" * 64 + "\n"


class _Index(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        _Index.seen.append(self.headers.get("Authorization"))
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def index():
    _Index.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://pipuser:{PASSWORD}@127.0.0.1:{server.server_address[1]}/simple"
    server.shutdown()


class _CommandLines:
    """Every process's command line, sampled from /proc while the module runs."""

    def __init__(self) -> None:
        self.leaks: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> _CommandLines:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    text = cmdline.read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
                except OSError:
                    continue
                if PASSWORD in text:
                    self.leaks.add(text)


def _assert_asked_with_credentials_and_never_shown(result: dict, ps: _CommandLines) -> None:
    expected = "Basic " + base64.b64encode(f"pipuser:{PASSWORD}".encode()).decode()
    assert expected in _Index.seen, f"pip never asked the index with its credentials: {_Index.seen}"
    assert ps.leaks == set(), ps.leaks
    assert PASSWORD not in json.dumps(result), result
    assert result["failed"] is True


def test_python_venv_passes_the_index_url_outside_the_command_line(
    tmp_path: Path, index: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = {
        "name": "credentials",
        "path": str(tmp_path / "venv"),
        "lock": LOCK,
        "python": sys.executable,
        "installer": "pip",
        "index_url": index,
        "min_free_mb": 1,
        "timeout": 300,
    }
    with _CommandLines() as ps:
        result = run_module("python_venv", args, capsys)
    _assert_asked_with_credentials_and_never_shown(result, ps)
    assert "***@127.0.0.1" in result["msg"], result["msg"]  # the index is still named, without its password


def test_wheelhouse_passes_the_index_url_outside_the_command_line(
    tmp_path: Path, index: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = {
        "name": "credentials",
        "lock": LOCK,
        "dest": str(tmp_path / "wheelhouse"),
        "pip": sys.executable,
        "index_url": index,
    }
    with _CommandLines() as ps:
        result = run_module("wheelhouse", args, capsys)
    _assert_asked_with_credentials_and_never_shown(result, ps)
