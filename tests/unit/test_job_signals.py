"""How a job's end is reported when a signal stops it (`regen.jobs._common.run_main`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from regen.jobs._common import (
    EXIT_CRASHED,
    EXIT_TERMINATED,
    StatusFile,
    Terminated,
    interrupt_behind,
    run_main,
)


def _interrupted_inside_a_lock() -> None:
    """SIGTERM's exception landing where CI once saw it: inside threading's own bookkeeping, after
    `Condition.wait` released the lock and before it waits. Leaving the `with` block then releases the
    lock a second time and raises "release unlocked lock" over the Terminated."""
    lock = threading.Lock()
    with lock:
        lock.release()  # what Condition._release_save does
        raise Terminated  # where the signal handler ran (fault injection: the raise stands in for SIGTERM)


def _job(tmp_path: Path, body) -> tuple[int, dict]:
    status = StatusFile(tmp_path / "status.json", job="fault").arm()

    def main(argv: list[str] | None) -> int:
        status.maybe_write(lambda: {"state": "running"}, force=True)
        body()
        return 0

    code = run_main(main, [])
    return code, json.loads((tmp_path / "status.json").read_text())


def test_the_lock_error_really_hides_the_signal() -> None:
    """The premise: what escapes is a RuntimeError, with the Terminated only in its context."""
    with pytest.raises(RuntimeError, match="release unlocked lock") as caught:
        _interrupted_inside_a_lock()
    assert isinstance(interrupt_behind(caught.value), Terminated)


def test_a_signal_that_breaks_a_lock_on_its_way_out_is_an_interruption_not_a_crash(tmp_path: Path) -> None:
    code, status = _job(tmp_path, _interrupted_inside_a_lock)
    assert code == EXIT_TERMINATED
    assert status["state"] == "interrupted"
    assert status["exit_code"] == EXIT_TERMINATED


def test_the_same_error_without_a_signal_behind_it_is_still_a_crash(tmp_path: Path) -> None:
    def unlocked_twice() -> None:
        threading.Lock().release()

    code, status = _job(tmp_path, unlocked_twice)
    assert code == EXIT_CRASHED
    assert status["state"] == "failed"
    assert "release unlocked lock" in status["error"]
