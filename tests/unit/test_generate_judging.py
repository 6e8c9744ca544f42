"""Where the generation job judges its answers (regen.jobs.generate.judging), and its ETA.

The judge in a worker process must give the detector's own findings, count what it could not judge
when it falls behind, and survive a worker that dies; the job's status says how long is left.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest

from regen.jobs import generate as G
from regen.jobs.generate.judging import INLINE_EVERY, Judge
from regen.quality.detector import degeneration
from tests.helpers.stub_openai_server import StubConfig, StubServer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quality"
OUTPUTS = json.loads((FIXTURES / "outputs.json").read_text(encoding="utf-8"))
TEXTS = [e["text"] for e in OUTPUTS["garbage"] + OUTPUTS["good"]] + ["", None]


async def _ready(judge: Judge) -> None:
    deadline = time.monotonic() + 60
    while not judge._ready:
        assert time.monotonic() < deadline, "the judge's worker did not start"
        await asyncio.sleep(0.05)


def test_the_worker_judges_as_the_detector_falls_behind_counted_and_survives_its_death(caplog):
    async def scenario():
        judge = Judge(1)
        inline = [await judge.findings(text) for text in TEXTS[:2]]  # before the worker is up: inline
        assert inline == [degeneration(text) for text in TEXTS[:2]]
        judge.start()
        await _ready(judge)
        # a batch in the worker: the same findings, in order
        found = await asyncio.gather(*(judge.findings(text) for text in TEXTS))
        assert found == [degeneration(text) for text in TEXTS]
        assert any(found) and not all(found)
        assert judge.judged == 2 + len(TEXTS) and judge.waiting == 0
        # a judge that is behind: the answer goes unjudged, counted; one in INLINE_EVERY is judged in the
        # event loop, so a starved worker never leaves the stop without a sample
        judge.backlog = 0
        garbage = next(text for text in TEXTS if degeneration(text))
        behind = [await judge.findings(garbage) for _ in range(3 * INLINE_EVERY)]
        assert behind.count(None) == judge.unjudged == 3 * (INLINE_EVERY - 1)
        assert [found for found in behind if found is not None] == [degeneration(garbage)] * 3
        assert judge.judged == 2 + len(TEXTS) + 3
        judge.backlog = 100
        # a worker killed under it: its answers are judged inline, and so is everything after
        for pid in list(judge._pool._processes):
            os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        with caplog.at_level(logging.WARNING, logger="regen.jobs.generate"):
            found = await asyncio.gather(*(judge.findings(text) for text in TEXTS))
        assert found == [degeneration(text) for text in TEXTS]
        assert judge._pool is None
        assert "run in the event loop from now on" in caplog.text
        judge.close()

    asyncio.run(scenario())


def test_negative_worker_counts_are_refused():
    with pytest.raises(ValueError, match="--judge-workers"):
        Judge(-1)


def test_the_job_flags_garbage_and_its_status_has_the_eta(tmp_path):
    garbage = next(e["text"] for e in OUTPUTS["garbage"] if e["id"] == "sglang-24321-nvfp4-plus")
    rows = [
        {"id": f"p{i}", "conversations": [{"role": "user", "content": "broken" if i == 3 else f"q {i}"}]}
        for i in range(30)
    ]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    with StubServer(StubConfig(delay=0.02, replies={"broken": garbage})) as stub:
        s = G.Settings(
            inputs=[str(tmp_path / "prompts.jsonl")],
            output_dir=out,
            endpoints=[stub.url],
            model="m",
            concurrency=4,
            max_tokens=64,
            status_file=out / "status.json",
            fsync=False,
            judge_workers=1,
        )
        code = asyncio.run(G.GenerateJob(s).run())
    assert code == 0
    recs = {}
    for path in out.glob("completions-*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            recs[rec["id"]] = rec
    assert "quality" in recs["p3"] and "quality" not in recs["p4"]
    status = json.loads((out / "status.json").read_text())
    assert status["degeneration"]["judge_workers"] == 1 and status["degeneration"]["unjudged"] == 0
    assert status["degeneration"]["degenerate_total"] == 1
    assert status["eta_s"] == 0.0  # nothing left
    assert "recent_records_per_s" in status  # 0 here: the run was shorter than the meter's minimum span


def test_the_running_line_carries_the_eta():
    job = G.GenerateJob(
        G.Settings(
            inputs=["x"],
            output_dir=Path("/nonexistent"),
            endpoints=["http://127.0.0.1:1"],
            model="m",
            concurrency=1,
            max_tokens=1,
        )
    )
    job.total, job._state = 1000, "running"
    assert job.summary_line().endswith("eta=?")
    for second in range(11):
        job.stats.done = 10 * second
        job.meter.add(float(second), job.stats.done)
    assert job.summary_line().endswith("eta=1m30s")  # 900 left at 10/s
    assert job._status_doc()["eta_s"] == pytest.approx(90.0)


def test_a_sigkilled_job_leaves_no_judge_worker_behind(tmp_path):
    import subprocess
    import sys

    import psutil

    rows = [{"id": f"p{i}", "conversations": [{"role": "user", "content": f"q {i}"}]} for i in range(2000)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with StubServer(StubConfig(delay=0.5)) as stub:
        job = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "regen.jobs.generate",
                "--input",
                str(tmp_path / "prompts.jsonl"),
                "--output-dir",
                str(tmp_path / "out"),
                "--endpoint",
                stub.url,
                "--model",
                "m",
                "--max-tokens",
                "8",
                "--concurrency",
                "4",
                "--no-progress",
                "--judge-workers",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            workers: list[psutil.Process] = []
            while not workers:
                assert time.monotonic() < deadline, "no judge worker started"
                assert job.poll() is None, "the job ended early"
                workers = [
                    p
                    for p in psutil.Process(job.pid).children(recursive=True)
                    if "multiprocessing" in " ".join(p.cmdline())
                ]
                time.sleep(0.2)
            job.kill()
            job.wait(10)
            _gone, alive = psutil.wait_procs(workers, timeout=15)
            assert alive == [], [p.cmdline() for p in alive]
        finally:
            if job.poll() is None:
                job.kill()


def test_the_worker_yields_the_cpu_to_everything_else():
    # SCHED_IDLE where Linux allows it (an unprivileged process may always lower itself to it)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from regen.jobs._judge_worker import worker_init

    with ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn"), initializer=worker_init, initargs=(os.getpid(),)
    ) as pool:
        policy = pool.submit(os.sched_getscheduler, 0).result(timeout=60)
    assert policy == os.SCHED_IDLE
