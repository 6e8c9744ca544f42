"""Host-side helpers of the online (disaggregated) train stage: the prompt file and the preflight.

    python -m regen.training.disagg prompts --data TOKENIZED --output PROMPTS.jsonl --max-length N
        [--max-samples N]
    python -m regen.training.disagg preflight --url URL [--url URL ...] [--mooncake-master HOST:PORT]
        [--mooncake-metadata URL] [--timeout SECONDS]
    python -m regen.training.disagg health --url URL [--url URL ...] [--mooncake-master HOST:PORT]
        [--mooncake-metadata URL]

`prompts` writes what SpecForge 0.2.0's online producer reads as `data.prompts_path` (pre-tokenized JSONL,
one `{"input_ids", "loss_mask"}` per line: `specforge.data.prompt_builder` takes a file whose first record
has both as already tokenized): the same samples, cut to the same length and filtered the same way as
offline capture (`regen.training.capture.select`), so an online and an offline run of the same data see
the same samples. Written atomically with a manifest beside it (the samples' fingerprint and the file's
own sha256); an unchanged set whose file still has that sha256 is not rewritten (`changed: false`), a
damaged one (cut short, a torn line) is made again.

`preflight` checks, before SpecForge starts, what SpecForge itself would only find out later: every capture
server answers `GET /health` (SpecForge's producer never asks: a server that is down costs a lease's
retries), and the Mooncake master accepts on its RPC port and its metadata server answers. It waits up to
`--timeout` seconds for each and fails with what is wrong and how to fix it.

`health`, after an online run that did not succeed, probes the same parts once each and says which is down:
the cause the train stage's failure message names (SpecForge's own error for a lost Mooncake master names
none).

Every command prints one JSON object; exit 0 done, 1 a preflight (or health) check failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from regen.fsio import AtomicFile, atomic_write_json
from regen.training.capture import CaptureError, Fingerprint, file_sha256, select

MANIFEST_SUFFIX = ".manifest.json"


def write_prompts(data: str, output: str, max_length: int, max_samples: int | None) -> dict[str, Any]:
    """The online prompt file (see the module docstring); unchanged data leaves it untouched."""
    fingerprint = Fingerprint()
    rows: list[tuple[list[int], list[int]]] = []
    dropped = 0
    for index, ids, mask in select(data, max_length, max_samples):
        if not ids:
            dropped += 1
            continue
        fingerprint.add(index, ids, mask)
        rows.append((ids, mask))
    if not rows:
        raise CaptureError(
            f"no sample under {data} has two consecutive supervised tokens within {max_length} tokens"
        )

    def lines():
        for ids, mask in rows:
            yield (json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n").encode()

    content = hashlib.sha256()
    size = 0
    for line in lines():
        content.update(line)
        size += len(line)
    manifest = {
        "samples": len(rows),
        "tokens": sum(len(ids) for ids, _ in rows),
        "dropped": dropped,
        "max_length": max_length,
        "fingerprint": fingerprint.hexdigest(),
        "format": "specforge pre-tokenized prompts (input_ids, loss_mask)",
        # The file's own digest: a file cut short or torn since it was written is made again, not reused.
        "sha256": content.hexdigest(),
        "bytes": size,
    }
    path = Path(output)
    manifest_path = Path(output + MANIFEST_SUFFIX)
    try:
        old = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        old = None
    damaged = None
    if old == manifest and path.is_file():
        if path.stat().st_size == size and file_sha256(path) == manifest["sha256"]:
            return {"changed": False, "path": str(path), **manifest}
        damaged = f"{path} did not match its manifest's sha256 (damaged since it was written): made again"
    with AtomicFile(path) as out:
        for line in lines():
            out.file.write(line)
    atomic_write_json(manifest_path, manifest)
    return {"changed": True, "path": str(path), **manifest, **({"remade": damaged} if damaged else {})}


def _get(url: str, timeout: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read(512).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(512).decode(errors="replace")


def _until(check, timeout: float) -> tuple[bool, str]:
    """Poll `check` (returns (ok, detail)) until it passes or `timeout` seconds have gone."""
    deadline = time.monotonic() + timeout
    while True:
        ok, detail = check()
        if ok or time.monotonic() >= deadline:
            return ok, detail
        time.sleep(0.5)


def check_capture_server(url: str) -> tuple[bool, str]:
    try:
        status, body = _get(url.rstrip("/") + "/health", 5)
    except (OSError, urllib.error.URLError) as exc:
        reason = getattr(exc, "reason", exc)
        return False, f"{url} does not answer ({reason})"
    if status == 200:
        return True, f"{url} is up"
    return False, f"{url}/health answers HTTP {status}: {body.strip()[:200]}"


def check_mooncake(master: str, metadata: str) -> tuple[bool, str]:
    host, _, port = master.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            pass
    except (OSError, ValueError) as exc:
        return False, f"the Mooncake master at {master} does not accept connections ({exc})"
    try:
        status, body = _get(metadata + "?key=regen-preflight-probe", 5)
    except (OSError, urllib.error.URLError) as exc:
        return (
            False,
            f"the Mooncake metadata server at {metadata} does not answer ({getattr(exc, 'reason', exc)})",
        )
    # Mooncake's metadata server answers an unknown key with 404 "metadata not found".
    if status == 404 or status == 200:
        return True, f"Mooncake master {master} and metadata server {metadata} are up"
    return False, f"{metadata} answers HTTP {status} ({body.strip()[:200]}): not a Mooncake metadata server?"


def _probe(urls: list[str], master: str | None, metadata: str | None, timeout: float) -> list[dict[str, Any]]:
    """Each part of the online stack, polled until it answers or `timeout` seconds have gone (0: once)."""
    checks = []
    if master and metadata:
        ok, detail = _until(lambda: check_mooncake(master, metadata), timeout)
        checks.append({"what": "mooncake", "ok": ok, "detail": detail})
    for url in urls:
        ok, detail = _until(lambda url=url: check_capture_server(url), timeout)
        checks.append({"what": "capture server", "url": url, "ok": ok, "detail": detail})
    return checks


def preflight(urls: list[str], master: str | None, metadata: str | None, timeout: float) -> dict[str, Any]:
    checks = _probe(urls, master, metadata, timeout)
    failed = [c for c in checks if not c["ok"]]
    result: dict[str, Any] = {"ok": not failed, "checks": checks}
    if failed:
        result["msg"] = (
            "; ".join(c["detail"] for c in failed)
            + ". The online producer needs every capture server and the Mooncake master before it starts: "
            "start them (the train stage does when drafter_training_online_manage is true; its log is in the "
            "capture server's state directory) or fix drafter_training_online_server_urls / "
            "drafter_training_online_mooncake"
        )
    return result


def stack_health(urls: list[str], master: str | None, metadata: str | None) -> dict[str, Any]:
    """After an online run that did not succeed: which part of the stack is down now (one probe each, no
    waiting). SpecForge's consumer reports a Mooncake master lost mid-run as a feature that is "not
    available (freed, stale, or never written)", which names no cause; this does."""
    checks = _probe(urls, master, metadata, timeout=0)
    failed = [c for c in checks if not c["ok"]]
    result: dict[str, Any] = {"ok": not failed, "checks": checks}
    if failed:
        result["msg"] = (
            "after the run, " + "; ".join(c["detail"] for c in failed) + ". The trainers read every "
            "feature from Mooncake and the producer sends every prompt to the capture servers, so a part "
            "that stopped during the run failed it; that part's log says why it stopped"
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m regen.training.disagg", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    prompts = sub.add_parser("prompts", help="write SpecForge's online prompt file from the tokenized data")
    prompts.add_argument("--data", required=True)
    prompts.add_argument("--output", required=True)
    prompts.add_argument("--max-length", type=int, required=True)
    prompts.add_argument("--max-samples", type=int, default=None)
    check = sub.add_parser("preflight", help="check the capture servers and Mooncake answer")
    check.add_argument("--url", action="append", default=[], help="a capture server URL")
    check.add_argument("--mooncake-master", default=None, help="HOST:PORT of the master's RPC")
    check.add_argument("--mooncake-metadata", default=None, help="the HTTP metadata server URL")
    check.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each")
    health = sub.add_parser("health", help="after a failed online run: which part of the stack is down")
    health.add_argument("--url", action="append", default=[], help="a capture server URL")
    health.add_argument("--mooncake-master", default=None, help="HOST:PORT of the master's RPC")
    health.add_argument("--mooncake-metadata", default=None, help="the HTTP metadata server URL")
    args = parser.parse_args(argv)
    try:
        if args.command == "prompts":
            result = write_prompts(args.data, args.output, args.max_length, args.max_samples)
        elif args.command == "health":
            result = stack_health(args.url, args.mooncake_master, args.mooncake_metadata)
        else:
            result = preflight(args.url, args.mooncake_master, args.mooncake_metadata, args.timeout)
    except CaptureError as exc:
        print(json.dumps({"failed": True, "msg": str(exc)}))
        return 2
    print(json.dumps(result, sort_keys=True))
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
