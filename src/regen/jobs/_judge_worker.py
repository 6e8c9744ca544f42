"""What runs inside the generation job's judge processes (`regen.jobs.generate.judging`).

Kept apart from the `regen.jobs.generate` package on purpose: a spawned worker imports the module of
every function it is handed, and the package pulls in aiohttp, the CLI and the job (about 0.3 s of CPU
more per worker start, taken from the job and the server in the run's first second). This module needs
only the detector, and imports it (and numpy with it) only once the worker runs at its low priority.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from regen.quality.detector import Finding

WORKER_NICE = 10
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# glibc's mallopt parameters (malloc.h) and the values the worker sets: the screen allocates arrays of a
# few hundred KB per batch, which by default glibc gives back to the kernel at each free (the heap's top
# is trimmed past 128 KB, larger blocks are mmap'd), so every batch paid page faults on fresh memory:
# 1.5-2.2x the CPU of the screen on ~4-24 KB answers (bench/bench_screen.py). The worker keeps what it
# used (a few MB) instead.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_FREED_BYTES = 256 << 20
_HEAP_BLOCKS_UP_TO = 64 << 20


def judge_many(texts: list[str | None]) -> list[list[Finding]]:
    """The findings of each text (runs in a worker process), the batch screened at once."""
    from regen.quality.detector import degeneration_many

    return degeneration_many(texts)


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
    with contextlib.suppress(OSError, AttributeError):  # glibc's; another libc keeps its own policy
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED_BYTES)
        libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCKS_UP_TO)


def warm() -> bool:
    # imports numpy and the screen in the worker (at its low priority) before the first answer arrives
    from regen.quality.detector import degeneration

    degeneration("warm up the worker: " * 4)
    return True
