"""Job progress records: status documents (one schema, `regen.status`) from files and task results."""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import pytest

from regen.runner.progress import (
    StatusWatcher,
    find_status_files,
    parse_status,
    read_status_file,
    status_from_result,
)
from regen.status import KEYS, SCHEMA, Status, validate
from regen.training.status import apply_line, new_status, write_status


def test_the_training_launchers_status_reads_as_progress(tmp_path: Path) -> None:
    # Produced by the real training status code, folding a SpecForge-style step line.
    status = new_status(total_steps=40)
    assert apply_line(
        status, "step 12: {'acc': 0.41, 'loss': 2.53, 'lr': 0.0006, 'perf/optimizer_step_time_s': 0.5}"
    )
    path = tmp_path / "train_status.json"
    write_status(path, status)
    assert validate(json.loads(path.read_text())) == []
    parsed = read_status_file(path)
    assert parsed is not None
    assert (parsed.job, parsed.done, parsed.total, parsed.state) == ("train", 12, 40, "running")
    assert parsed.fraction == 12 / 40 and not parsed.finished
    assert parsed.line and "step 12/40" in parsed.line


def _doc(**fields: object) -> dict:
    """A status document as the jobs write it (through the schema's own `Status.document`)."""
    base = {"job": "generate", "state": "running", "item": "record", "line": "generate: state=running"}
    detail = {k: fields.pop(k) for k in list(fields) if k not in KEYS}
    return Status(**{**base, **fields}).document(**detail)


def test_a_generation_status_document_reads_as_progress() -> None:
    doc = _doc(total=1000, done=250, failed=3, tokens=128000, tokens_per_s=6400.0, eta_s=60.0, tokens_in=5)
    parsed = parse_status(json.loads(json.dumps(doc)))
    assert parsed is not None
    assert (parsed.job, parsed.done, parsed.total, parsed.failed) == ("generate", 250, 1000, 3)
    assert (parsed.tokens, parsed.tokens_per_s, parsed.eta_s) == (128000, 6400.0, 60.0)
    assert parsed.fraction == 0.25 and not parsed.finished
    assert parse_status({**doc, "state": "done", "done": 1000}).finished


def test_only_the_schemas_keys_count() -> None:
    # The alternative names readers once guessed among are not progress: one schema, one name per field.
    assert parse_status({"job": "tokenize", "progress": {"processed": 7, "total": 9}}) is None
    assert parse_status({"state": "running", "step": 3, "total_steps": 8}) is None
    assert parse_status(["done", 1]) is None
    doc = _doc(done=3, total=9)
    assert parse_status(doc) is not None
    assert parse_status({k: v for k, v in doc.items() if k != "item"}) is None  # a key missing
    assert parse_status({**doc, "done": True}) is None  # booleans are not counts
    assert parse_status({**doc, "done": float("nan")}) is None
    assert parse_status({**doc, "total": -5}) is None
    assert parse_status({**doc, "tokens": "many"}) is None
    assert parse_status({**doc, "state": "half-way"}) is None
    assert parse_status({**doc, "schema": "regen.status/0"}) is None
    assert parse_status(_doc(done=3)).fraction is None  # no total: no fraction, still progress


def test_the_schema_names_what_a_document_gets_wrong() -> None:
    assert validate(_doc(done=1, total=2)) == []
    problems = validate({"schema": SCHEMA, "job": "x", "state": "running", "item": "", "line": "l"})
    assert "lacks 'done'" in problems and "'item' must be a non-empty string, not ''" in problems
    assert validate([]) == ["a status document is a JSON object, not list"]
    with pytest.raises(ValueError, match="may not reuse the schema's keys: done"):
        Status(job="x", state="running", item="row", line="l").document(done=4)


def test_half_written_or_missing_files_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    path.write_text('{"done": 3, "tot')
    assert read_status_file(path) is None
    assert read_status_file(tmp_path / "missing-status.json") is None
    path.write_bytes(b"\xff\xfe not utf-8")
    assert read_status_file(path) is None


def test_status_files_are_found_without_walking_venvs_or_models(tmp_path: Path) -> None:
    (tmp_path / "generate").mkdir()
    (tmp_path / "generate" / "status.json").write_text("{}")
    (tmp_path / "train_status.json").write_text("{}")
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr")
    (venv / "lib" / "status.json").write_text("{}")
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "status.json").write_text("{}")
    (tmp_path / "notes.json").write_text("{}")
    found = sorted(p.relative_to(tmp_path).as_posix() for p in find_status_files([tmp_path]))
    assert found == ["generate/status.json", "train_status.json"]


def test_the_watcher_reports_changes_once_and_ignores_earlier_runs(tmp_path: Path) -> None:
    old = tmp_path / "old" / "status.json"
    old.parent.mkdir()
    old.write_text(json.dumps(_doc(done=9, total=9)))
    past = time.time() - 3600
    os.utime(old, (past, past))
    watcher = StatusWatcher([tmp_path], since=time.time())
    assert watcher.poll() == []  # the old run's file is not this run's progress

    current = tmp_path / "generate" / "status.json"
    current.parent.mkdir()
    current.write_text(json.dumps(_doc(done=1, total=4)))
    first = watcher.poll(rescan_every=0)
    assert [(p, s.done) for p, s in first] == [(current, 1)]
    assert watcher.poll(rescan_every=0) == []  # unchanged: nothing new

    current.write_text('{"job": "generate", "done": 2, "to')  # torn write: wait for the next one
    assert watcher.poll(rescan_every=0) == []
    current.write_text(json.dumps(_doc(done=4, total=4, state="done")))
    last = watcher.poll(rescan_every=0)
    assert len(last) == 1 and last[0][1].finished


def test_progress_inside_task_results() -> None:
    doc = _doc(done=5, total=10)
    slurped = {
        "content": base64.b64encode(json.dumps(doc).encode()).decode(),
        "encoding": "base64",
        "source": "/root/regen/generate/status.json",
        "changed": False,
    }
    from_slurp = status_from_result(slurped)
    assert from_slurp is not None and (from_slurp.job, from_slurp.done) == ("generate", 5)
    from_stdout = status_from_result({"stdout": json.dumps(doc), "rc": 0})
    assert from_stdout is not None and from_stdout.total == 10
    training = {**new_status(total_steps=8), "state": "running", "done": 3, "line": "running | step 3/8"}
    from_module = status_from_result({"status": training})
    assert from_module is not None and (from_module.job, from_module.done) == ("train", 3)
    # a plain task result is not progress, even with numbers in it
    assert status_from_result({"changed": True, "rc": 0, "delta": "0:00:01", "done": 3}) is None
    assert status_from_result({"content": "bm90IGpzb24=", "encoding": "base64"}) is None
    assert status_from_result("not a mapping") is None
