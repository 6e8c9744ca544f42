"""The tokenized_data role through a real ansible-playbook run when its job meets a full disk (issue 15).

The tokenized output lies on a small tmpfs of its own (the tests run as root; skipped otherwise), unmounted
by the fixture. The role must fail with the job's own words naming the full disk, and leave nothing torn
for a later stage (train reads data/*.parquet, SpecForge conversations.jsonl); a run with space finishes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.ansible import ansible_env, run_playbook

ROWS = 2400


def _records(n: int) -> str:
    filler = "a sentence of the answer that takes some room on the disk. " * 4
    return "".join(
        json.dumps(
            {
                "id": f"p{i}",
                "finish_reason": "stop",
                "conversations": [
                    {"role": "user", "content": f"Spell the number {i}."},
                    {"role": "assistant", "content": f"The number {i}: {filler}"},
                ],
            }
        )
        + "\n"
        for i in range(n)
    )


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    point = tmp_path / "disk"
    point.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "regen-test", str(point)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield point
    subprocess.run(["umount", "-l", str(point)], check=False)


def tokenize_stage(work: Path, model: Path, output: Path):
    return run_playbook(
        "playbooks/tokenize.yml",
        extra_vars={
            "regen_work_dir": str(work),
            "regen_artifacts_dir": str(work / "artifacts"),
            "regen_model_path": str(model),
            "regen_job_python": sys.executable,
            "tokenized_data_output_dir": str(output),
            "tokenized_data_workers": 1,
            "tokenized_data_shard_size": 300,
            "tokenized_data_poll_interval_s": 1,
            # No introspect stage ran here, so no plan: the two plan-backed settings are set as an operator
            # would set them (without them the stage stops naming both, before it starts a job).
            "tokenized_data_max_length": 4096,
            "tokenized_data_chat_template_kwargs": {},
        },
        env=ansible_env(ANSIBLE_CACHE_PLUGIN_CONNECTION=str(work / "facts")),
        timeout=600,
    )


def whole_jsonl(path: Path) -> bool:
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        return False
    try:
        for line in data.splitlines():
            json.loads(line)
    except ValueError:
        return False
    return True


def test_a_full_disk_fails_the_stage_with_the_jobs_words_and_leaves_nothing_torn(
    tmp_path, small_disk, demo_model_dir
):
    import pyarrow.parquet as pq

    work = tmp_path / "work"
    (work / "completions").mkdir(parents=True)
    (work / "completions" / "completions-00000.jsonl").write_text(_records(ROWS))
    (work / "artifacts").mkdir()
    output = small_disk / "tokenized"

    run = tokenize_stage(work, demo_model_dir, output)
    out = run.output
    assert run.returncode != 0 and run.counts("localhost")["failed"] == 1, out[-4000:]
    assert "the tokenize job exited with 5 (the output cannot be written)" in out, out[-4000:]
    assert "No space left on device" in out, out[-4000:]
    assert "are tokenized and kept (each shard whole)" in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    status = json.loads((output / "status.json").read_text())
    assert (status["state"], status["exit_code"]) == ("failed", 5)
    assert "No space left on device" in status["error"]

    # nothing torn or half-committed for a later stage: no temporary file, every shard file whole, and
    # every shard in data/ committed by its marker (the train stage reads data/*.parquet)
    left = [p for p in output.rglob("*") if p.is_file()]
    assert not [p for p in left if p.name.endswith(".tmp")], left
    for path in left:
        if path.suffix == ".jsonl":
            assert whole_jsonl(path), path
        if path.suffix == ".parquet":
            pq.read_table(path)
    committed = {p.stem for p in (output / "state").glob("*.json")}
    assert {p.stem for p in (output / "data").glob("*.parquet")} <= committed
    assert not (work / "artifacts" / "tokenized" / "stats.json").exists(), "nothing published"

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = tokenize_stage(work, demo_model_dir, output)
    assert again.returncode == 0, again.output[-4000:]
    stats = json.loads((output / "stats.json").read_text())
    assert stats["samples"] == ROWS
    assert sum(1 for _ in (output / "conversations.jsonl").open()) == ROWS
