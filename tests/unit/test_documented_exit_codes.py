"""Documented exit codes instead of tracebacks (issue 25), each job fed the damaged input the attack review
found, as a user's command line runs it (a subprocess): the exit code the job's --help documents, one
readable line naming the file, and no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PY = sys.executable


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", *argv], capture_output=True, text=True, timeout=120, check=False)


def test_prompts_a_parquet_file_with_a_corrupt_data_page_exits_2(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "prompts.parquet"
    rows = [{"id": str(i), "prompt": f"question number {i} " * 20} for i in range(2000)]
    pq.write_table(pa.Table.from_pylist(rows), path, compression="none", row_group_size=500)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 400] = b"\xff" * 400  # a data page of a middle row group overwritten
    path.write_bytes(bytes(data))
    run = _run("regen.jobs.prompts", "--source", str(path), "--output-dir", str(tmp_path / "out"))
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert f"Parquet file {path} is damaged after row" in run.stderr


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_compare_and_record_refuse_a_deeply_nested_manifest_with_exit_4(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for run_id, body in (("20260101T000000Z-a", _deep(100_000)), ("20260102T000000Z-b", _deep(300))):
        (runs / run_id).mkdir(parents=True)
        (runs / run_id / "manifest.json").write_text(
            '{"schema": "regen.manifest/1", "results": ' + body + "}"
        )
    for argv in (
        ["regen.provenance", "compare", "--artifacts", str(tmp_path)],
        ["regen.cli", "compare", "--artifacts", str(tmp_path)],
        ["regen.cli", "compare", "--artifacts", str(tmp_path), "20260102"],
    ):
        run = _run(*argv)
        assert run.returncode == 4, run.stderr[-2000:]  # bad input, as `regen --help` documents
        assert "Traceback" not in run.stderr and "is nested deeper than 64 levels" in run.stderr
    artifacts = tmp_path / "artifacts"
    (artifacts / "generate").mkdir(parents=True)
    (artifacts / "model_facts.json").write_text('{"plan": ' + _deep(300) + "}")
    run = _run("regen.provenance", "record", "--artifacts", str(artifacts))
    assert run.returncode == 4 and "Traceback" not in run.stderr
    assert "model_facts.json is nested deeper than 64 levels" in run.stderr


def test_sweep_report_refuses_a_malformed_layout_record_with_exit_2(tmp_path: Path) -> None:
    good = {"name": "tp1", "status": "measured", "estimate": None, "levels": []}
    damaged = {
        "list.json": [good],
        "noname.json": {**good, "name": None},
        "levels.json": {**good, "levels": [{"concurrency": "8", "output_tokens_per_s": 1.0}]},
        "rate.json": {**good, "levels": [{"concurrency": 8, "output_tokens_per_s": "fast"}]},
        "ttft.json": {**good, "levels": [{"concurrency": 8, "output_tokens_per_s": 1.0, "ttft_ms": [1]}]},
        "deep.json": None,
    }
    for name, doc in damaged.items():
        path = tmp_path / name
        path.write_text(json.dumps(doc) if doc is not None else _deep(100_000))
        out = ["--output-dir", str(tmp_path / "out"), "--inputs-digest", "d"]
        run = _run("regen.jobs.sweep", "report", "--results", str(path), *out)
        assert run.returncode == 2, (name, run.stderr[-2000:])
        assert "Traceback" not in run.stderr and f"--results {path}: not a layout record" in run.stderr
    assert not (tmp_path / "out" / "report.json").exists()
