"""The degeneration screen in the generation job's judge worker: a batch of answers against one at a time.

    python bench/bench_screen.py [--answers 128] [--rounds 20] [--min-ratio 1.05]

Issue 29: the judge's worker gets the answers that finished together (up to 128) and screens them as one
batch (`regen.quality.detector.degeneration_many`); before, and still where the checks run inline, each
answer was screened alone (`degeneration`). Measured here in a worker process started as the job starts
its own (spawned, `regen.jobs._judge_worker.worker_init`: the lowest priority and the heap settings), CPU
seconds per answer (getrusage, not wall time), on:

- filler: the answers of the benchmark stub (`w0 w1 ... w96` repeated), ~6 KB and ~24 KB, the sizes of
  `bench_generate.py --only long`;
- prose: the recorded good outputs of tests/fixtures/quality (real model answers, some non-ASCII),
  repeated to ~4 KB and ~25 KB.

For each, the ratio of one-at-a-time to batched CPU per answer must be >= --min-ratio. One more line, for
the record and not judged: the batch in a worker without the heap settings (glibc's defaults), which is
why the worker sets them. Both paths give the same findings (tests/unit/test_quality_screen.py).
Exit 1 when a limit is missed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # tests.helpers

from tests.helpers.stub_openai_server import _words  # the stub's own filler

OUTPUTS = json.loads((ROOT / "tests/fixtures/quality/outputs.json").read_text(encoding="utf-8"))
PROSE = " ".join(entry["text"] for entry in OUTPUTS["good"])


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _answers(kind: str, size: int, count: int) -> list[str]:
    if kind == "filler":
        return [f"stub reply 1 to: benchmark prompt {i} | " + _words(size) for i in range(count)]
    return [f"{i}. " + (PROSE + "\n\n") * size for i in range(count)]


def _measure(kind: str, size: int, count: int, rounds: int, batched: bool) -> float:
    """CPU seconds per answer (runs in the worker)."""
    from regen.quality.detector import degeneration, degeneration_many

    answers = _answers(kind, size, count)
    judge = (lambda: degeneration_many(answers)) if batched else (lambda: [degeneration(a) for a in answers])
    judge()  # the first round allocates what the later ones reuse
    start = _cpu()
    for _ in range(rounds):
        judge()
    return (_cpu() - start) / (rounds * count)


def _in_worker(with_job_settings: bool, *args) -> float:
    from regen.jobs._judge_worker import worker_init

    pool = ProcessPoolExecutor(
        1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=worker_init if with_job_settings else None,
        initargs=(os.getpid(),) if with_job_settings else (),
    )
    with pool:
        return pool.submit(_measure, *args).result()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--answers", type=int, default=128, help="answers per batch (the job's BATCH_ANSWERS)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--min-ratio", type=float, default=1.05)
    a = p.parse_args(argv)
    ok = True
    python = sys.version.split()[0]
    print(f"bench_screen: {os.cpu_count()} cores, python {python}, {a.answers} answers a batch")
    for kind, size in (("filler", 1500), ("filler", 6000), ("prose", 5), ("prose", 30)):
        chars = len(_answers(kind, size, 1)[0])
        single = _in_worker(True, kind, size, a.answers, a.rounds, False)
        batched = _in_worker(True, kind, size, a.answers, a.rounds, True)
        default_heap = _in_worker(False, kind, size, a.answers, a.rounds, True)
        ratio = single / batched
        good = ratio >= a.min_ratio
        ok = ok and good
        print(
            f"{kind:6s} ~{chars / 1024:4.0f} KB: one at a time {single * 1e6:6.1f} us/answer, batched "
            f"{batched * 1e6:6.1f} us/answer; ratio {ratio:.2f} (target >= {a.min_ratio}) "
            f"{'OK' if good else 'MISSED'}; batched with glibc's default heap {default_heap * 1e6:6.1f} us"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
