"""What runs inside the generation job's judge processes (`regen.jobs.generate.judging`).

Kept apart from the `regen.jobs.generate` package on purpose: a spawned worker imports the module of
every function it is handed, and the package pulls in aiohttp, the CLI and the job (about 0.3 s of CPU
more per worker start, taken from the job and the server in the run's first second). This module needs
only the detector.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

from regen.quality.detector import Finding, degeneration

WORKER_NICE = 10
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def judge_many(texts: list[str | None]) -> list[list[Finding]]:
    """The findings of each text (runs in a worker process)."""
    return [degeneration(text) for text in texts]


def worker_init(job_pid: int) -> None:
    """In each worker: die with the job (a SIGKILLed job must not leave workers behind), then yield the
    CPU to everything else: SCHED_IDLE, so the checks run on CPU time no other process wants (where the
    scheduler class is not available, nice +10). Measured against nice +10 (bench `long`, ~24 KB answers,
    2 cores shared with the server): 0.87x against 0.78x of the bare client, with 92-97% of the answers
    still judged; the job's judge (`regen.jobs.generate.judging`) judges a share inline when the worker
    is starved, so the stop never goes blind."""
    with contextlib.suppress(OSError, AttributeError):  # Linux's prctl; elsewhere the pool's own cleanup
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != job_pid:  # the job died before the line above took effect
        os._exit(0)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # not Linux, or not allowed: a lower priority still
        with contextlib.suppress(OSError):  # not allowed either: the job's own priority
            os.nice(WORKER_NICE)


def warm() -> bool:
    # imports numpy and the screen in the worker before the first answer arrives
    degeneration("warm up the worker: " * 4)
    return True
