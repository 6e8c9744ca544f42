"""Where the generation job runs the degeneration checks of its answers: in worker processes, or inline.

The checks cost CPU per answer (about 0.1 ms for a 6 KB answer with the screen of
`regen.quality.screen`, more for a long one), comparable to what the HTTP client itself spends on the
answer. Run inside the event loop, that time is time in which no response is read and no request is
sent (issue 29). With `workers` > 0 the answers finished in the same moment go, as one batch, to a
process pool and the loop goes back to I/O; the worker screens the batch at once (`judge_many`: about
0.06 ms per ~6 KB answer, 0.13 ms per ~24 KB one, bench/bench_screen.py), and the record waits for its
verdict (it carries the findings) and is written after. The workers run at the lowest priority
(SCHED_IDLE; nice +10 where that is not allowed): on a host where the CPUs are short, the client's I/O
and a local server come first, and the checks use what is left.

When the workers fall behind (more than `backlog` answers waiting for a verdict), an answer is written
without one: the rolling share is then judged on the answers that were checked (a sample, taken as they
come), and the count of the others is in the status document (`degeneration.unjudged`) and logged once.
Of the answers beyond the backlog, every `INLINE_EVERY`th is judged in the event loop: a worker that
gets no CPU at all (SCHED_IDLE on a host whose cores are all busy) leaves the stop a sample of at least
that share, never none. The stop stays on either way; what it cannot do is slow generation down to the
judge's speed. With 0 workers the checks run inline, every answer, as before. The verdicts are the
detector's own in every mode.

bench/bench_generate.py measures both against a bare client in the same run (the `long` case).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from regen.jobs._common import kv
from regen.jobs._judge_worker import WORKER_NICE, judge_many, warm, worker_init
from regen.quality.detector import Finding, degeneration

__all__ = [
    "BACKLOG_ANSWERS",
    "BATCH_ANSWERS",
    "BATCH_WAIT_S",
    "INLINE_EVERY",
    "WORKER_NICE",
    "Judge",
    "judge_many",
]

log = logging.getLogger("regen.jobs.generate")

# A batch leaves when it holds this many answers, or this long after its first one arrived: long
# enough to gather the answers of one burst of reads, short against a request's latency.
BATCH_ANSWERS = 128
BATCH_WAIT_S = 0.05
# Answers waiting for a verdict before new ones go unjudged: a few batches, so a worker that keeps up
# never drops one, and a worker that cannot keep up holds back no more than this many records.
BACKLOG_ANSWERS = 4 * BATCH_ANSWERS
# Beyond the backlog, one answer in this many is judged in the event loop (the floor of the sample).
INLINE_EVERY = 10


class Judge:
    """Findings of finished answers, from a process pool (`workers` > 0) or inline (0)."""

    def __init__(self, workers: int, backlog: int = BACKLOG_ANSWERS):
        if workers < 0:
            raise ValueError("--judge-workers must be 0 (inline) or more")
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        if workers:
            # spawn: the job has threads (asyncio.to_thread) and an event loop, whose locks a fork would
            # inherit; and spawned workers are the job's own children, so they can die with it
            # (regen.jobs._judge_worker.worker_init), where a forkserver's would outlive a SIGKILLed job.
            self._pool = ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=worker_init,
                initargs=(os.getpid(),),
            )
        self.backlog = backlog
        self._warming: asyncio.Future | None = None
        self._ready = False
        self.waiting = 0  # answers handed to the workers, verdict not back yet
        self.judged = 0
        self.unjudged = 0
        self._behind = 0  # answers that met a full backlog
        self._batch: list[tuple[str | None, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._inflight: set[asyncio.Future] = set()

    def start(self) -> None:
        """Start the workers in the background. Until they are up (an interpreter start and the imports,
        a second or so) the answers are judged inline: the first answers never wait for them."""
        if self._pool is not None and self._warming is None:
            loop = asyncio.get_running_loop()
            self._warming = asyncio.gather(
                *(loop.run_in_executor(self._pool, warm) for _ in range(self.workers))
            )
            self._warming.add_done_callback(self._warmed)

    def _warmed(self, warming: asyncio.Future) -> None:
        if warming.cancelled():
            return
        exc = warming.exception()
        if exc is not None:
            self._inline([], [], exc)
            return
        self._ready = True

    async def findings(self, text: str | None) -> list[Finding] | None:
        """The answer's findings; None when the workers are too far behind to judge it (see above)."""
        if self._pool is None or not self._ready:
            self.judged += 1
            return degeneration(text)
        if self.waiting >= self.backlog:
            self._behind += 1
            if self._behind % INLINE_EVERY == 0:
                self.judged += 1
                return degeneration(text)
            if not self.unjudged:
                log.warning(
                    "the degeneration checks fall behind the answers; answers beyond the backlog are "
                    "written unjudged and the rolling share is taken over the judged ones "
                    "(status.json: degeneration.unjudged)",
                    extra=kv(backlog=self.backlog, workers=self.workers),
                )
            self.unjudged += 1
            return None
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting += 1
        future.add_done_callback(self._answered)
        self._batch.append((text, future))
        if len(self._batch) >= BATCH_ANSWERS:
            self._send()
        elif self._timer is None:
            self._timer = loop.call_later(BATCH_WAIT_S, self._send)
        return await future

    def _answered(self, future: asyncio.Future) -> None:
        self.waiting -= 1
        if not future.cancelled():
            self.judged += 1

    def _send(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._batch = self._batch, []
        if not batch:
            return
        texts = [text for text, _ in batch]
        futures = [future for _, future in batch]
        loop = asyncio.get_running_loop()
        try:
            assert self._pool is not None
            done = loop.run_in_executor(self._pool, judge_many, texts)
        except (BrokenProcessPool, RuntimeError) as exc:
            self._inline(texts, futures, exc)
            return
        self._inflight.add(done)

        def deliver(result: asyncio.Future) -> None:
            self._inflight.discard(result)
            if result.cancelled():
                for future in futures:
                    if not future.done():
                        future.cancel()
                return
            exc = result.exception()
            if exc is not None:
                self._inline(texts, futures, exc)
                return
            for future, found in zip(futures, result.result(), strict=True):
                if not future.done():
                    future.set_result(found)

        done.add_done_callback(deliver)

    def _inline(self, texts: list[str | None], futures: list[asyncio.Future], exc: BaseException) -> None:
        # A worker that died (the OOM killer, a signal) must not lose the answers' verdicts: they are
        # judged here, and every later answer too; said once, loudly.
        if self._pool is not None:
            log.warning(
                "the judge's worker process failed; the degeneration checks run in the event loop from "
                "now on",
                extra=kv(error=f"{type(exc).__name__}: {exc}"),
            )
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        for text, future in zip(texts, futures, strict=True):
            if not future.done():
                future.set_result(degeneration(text))

    def close(self) -> None:
        if self._warming is not None and not self._warming.done():
            self._warming.cancel()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
