"""Job progress records: status documents read defensively, from files and from task results."""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

from regen.runner.progress import (
    StatusWatcher,
    find_status_files,
    job_name_for,
    parse_status,
    read_status_file,
    status_from_result,
)
from regen.training.status import apply_line, new_status, write_status


def test_the_training_launchers_status_reads_as_progress(tmp_path: Path) -> None:
    # Produced by the real training status code, folding a SpecForge-style step line.
    status = new_status(total_steps=40)
    assert apply_line(
        status, "step 12: {'acc': 0.41, 'loss': 2.53, 'lr': 0.0006, 'perf/optimizer_step_time_s': 0.5}"
    )
    path = tmp_path / "train_status.json"
    write_status(path, status)
    parsed = read_status_file(path)
    assert parsed is not None
    assert (parsed.job, parsed.done, parsed.total, parsed.state) == ("train", 12, 40, "running")
    assert parsed.fraction == 12 / 40 and not parsed.finished
    assert parsed.line and "step 12/40" in parsed.line


def test_a_generation_status_document_reads_as_progress() -> None:
    # The fields regen.jobs.generate writes to status.json (its _status_doc), with values of a real run.
    doc = {
        "job": "generate",
        "state": "running",
        "pid": 4242,
        "total": 1000,
        "done": 250,
        "dropped": 0,
        "failed": 3,
        "skipped": 0,
        "tokens_in": 51200,
        "tokens_out": 128000,
        "records_per_s": 12.5,
        "tokens_out_per_s": 6400.0,
        "eta_s": 60.0,
        "endpoints": [{"url": "http://127.0.0.1:30000"}],
    }
    parsed = parse_status(doc)
    assert parsed is not None
    assert (parsed.job, parsed.done, parsed.total, parsed.failed) == ("generate", 250, 1000, 3)
    assert (parsed.tokens, parsed.tokens_per_s, parsed.eta_s) == (128000, 6400.0, 60.0)
    assert parse_status({**doc, "state": "done", "done": 1000}).finished


def test_documents_without_progress_or_with_nonsense_numbers() -> None:
    assert parse_status({"state": "running"}) is None
    assert parse_status(["done", 1]) is None
    assert parse_status({"done": True, "total": False}) is None  # booleans are not counts
    odd = parse_status({"done": float("nan"), "total": -5, "tokens": "many"}, default_job="x")
    assert odd is None
    nested = parse_status({"name": "tokenize", "progress": {"processed": 7, "total": 9}})
    assert nested is not None and (nested.job, nested.done, nested.total) == ("tokenize", 7, 9)
    assert parse_status({"done": 3}).fraction is None  # no total: no fraction, still progress


def test_half_written_or_missing_files_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    path.write_text('{"done": 3, "tot')
    assert read_status_file(path) is None
    assert read_status_file(tmp_path / "missing-status.json") is None
    path.write_bytes(b"\xff\xfe not utf-8")
    assert read_status_file(path) is None


def test_job_names_come_from_the_file_or_its_directory() -> None:
    assert job_name_for(Path("/w/generate/status.json")) == "generate"
    assert job_name_for(Path("/w/train_status.json")) == "train"
    assert job_name_for(Path("/w/tokenize-progress.json")) == "tokenize"


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
    old.write_text(json.dumps({"done": 9, "total": 9}))
    past = time.time() - 3600
    os.utime(old, (past, past))
    watcher = StatusWatcher([tmp_path], since=time.time())
    assert watcher.poll() == []  # the old run's file is not this run's progress

    current = tmp_path / "generate" / "status.json"
    current.parent.mkdir()
    current.write_text(json.dumps({"job": "generate", "done": 1, "total": 4}))
    first = watcher.poll(rescan_every=0)
    assert [(p, s.done) for p, s in first] == [(current, 1)]
    assert watcher.poll(rescan_every=0) == []  # unchanged: nothing new

    current.write_text('{"job": "generate", "done": 2, "to')  # torn write: wait for the next one
    assert watcher.poll(rescan_every=0) == []
    current.write_text(json.dumps({"job": "generate", "done": 4, "total": 4, "state": "done"}))
    last = watcher.poll(rescan_every=0)
    assert len(last) == 1 and last[0][1].finished


def test_progress_inside_task_results() -> None:
    doc = {"job": "generate", "done": 5, "total": 10, "state": "running"}
    slurped = {
        "content": base64.b64encode(json.dumps(doc).encode()).decode(),
        "encoding": "base64",
        "source": "/root/regen/generate/status.json",
        "changed": False,
    }
    from_slurp = status_from_result(slurped, default_job="x")
    assert from_slurp is not None and (from_slurp.job, from_slurp.done) == ("generate", 5)
    from_stdout = status_from_result({"stdout": json.dumps(doc), "rc": 0}, default_job="x")
    assert from_stdout is not None and from_stdout.total == 10
    from_module = status_from_result({"status": {"step": 3, "total_steps": 8}}, default_job="train")
    assert from_module is not None and (from_module.job, from_module.done) == ("train", 3)
    # a plain task result is not progress, even with numbers in it
    assert status_from_result({"changed": True, "rc": 0, "delta": "0:00:01"}, default_job="x") is None
    assert status_from_result({"content": "bm90IGpzb24=", "encoding": "base64"}, default_job="x") is None
    assert status_from_result("not a mapping", default_job="x") is None
