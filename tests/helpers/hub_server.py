"""A minimal Hugging Face hub file server on loopback, for tests of the real `hf` client (HF_ENDPOINT).

It serves a directory the test wrote as one model repo at one commit, speaking only the endpoints
`hf download --revision <commit> --local-dir` and `hf cache verify` use (huggingface_hub 2.x):

- ``GET /api/models/<repo>/tree/<commit>?recursive=..``: the file list with git blob ids and, for
  ``*.safetensors`` (stored as LFS on the hub), ``lfs.oid`` = sha256 and ``lfs.size``;
- ``HEAD|GET /<repo>/resolve/<commit>/<path>``: ``X-Repo-Commit``, ``ETag`` (the sha256 for LFS files, the
  git blob id otherwise) and ``Content-Length``; ``Range: bytes=N-`` answered with 206, as the hub does.

It is not a hub: no auth, no branches, no xet. Its one knob is ``throttle`` (seconds per 64 KiB chunk of
LFS files), so a test can kill a client in the middle of a shard; ``requests`` records every request's
method, path and Range header, so a test can see that a second run resumed instead of starting over.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

CHUNK = 64 * 1024


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubServer:
    def __init__(self, root: Path, repo_id: str, commit: str, throttle: float = 0.0) -> None:
        self.root, self.repo_id, self.commit, self.throttle = Path(root), repo_id, commit, throttle
        self.requests: list[tuple[str, str, str | None]] = []
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _entry(self, path: Path) -> dict:
        data = path.read_bytes()
        entry = {"type": "file", "path": path.relative_to(self.root).as_posix(), "size": len(data)}
        entry["oid"] = git_blob_id(data)
        if path.suffix == ".safetensors":
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def _handler(self):
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _file(self):
                prefix = f"/{hub.repo_id}/resolve/{hub.commit}/"
                path = unquote(urlparse(self.path).path)
                if not path.startswith(prefix):
                    return None
                target = (hub.root / path[len(prefix) :]).resolve()
                return target if target.is_file() and hub.root.resolve() in target.parents else None

            def _not_found(self):
                body = b'{"error": "Entry not found"}'
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)

            def _headers(self, target: Path, status: int, start: int = 0):
                entry = hub._entry(target)
                etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
                size = entry["size"]
                self.send_response(status)
                self.send_header("X-Repo-Commit", hub.commit)
                self.send_header("ETag", f'"{etag}"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(size - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
                self.end_headers()
                return "lfs" in entry

            def do_HEAD(self):
                hub.requests.append(("HEAD", self.path, None))
                target = self._file()
                if target is None:
                    return self._not_found()
                self._headers(target, 200)

            def do_GET(self):
                byte_range = self.headers.get("Range")
                hub.requests.append(("GET", self.path, byte_range))
                tree = f"/api/models/{hub.repo_id}/tree/{hub.commit}"
                if urlparse(self.path).path.rstrip("/") == tree:
                    files = sorted(p for p in hub.root.rglob("*") if p.is_file())
                    body = json.dumps([hub._entry(p) for p in files]).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                target = self._file()
                if target is None:
                    return self._not_found()
                start = 0
                if byte_range and byte_range.startswith("bytes=") and byte_range.endswith("-"):
                    start = int(byte_range[len("bytes=") : -1])
                lfs = self._headers(target, 206 if start else 200, start)
                with target.open("rb") as handle:
                    handle.seek(start)
                    try:
                        while chunk := handle.read(CHUNK):
                            self.wfile.write(chunk)
                            if lfs and hub.throttle:
                                time.sleep(hub.throttle)
                    except (BrokenPipeError, ConnectionResetError):
                        return

        return Handler
