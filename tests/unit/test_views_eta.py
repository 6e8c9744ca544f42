"""The runner's views show a job's ETA (the job's own, from its measured rate) while it runs."""

from __future__ import annotations

from rich.console import Console

from regen.cli.views import LiveView, PlainView
from regen.runner import JobProgress
from regen.status import Status


def _event(state: str, eta_s: float | None) -> JobProgress:
    status = Status(
        job="generate",
        state=state,
        item="record",
        line="generate: ...",
        done=100,
        total=1000,
        tokens_per_s=50.0,
        eta_s=eta_s,
    )
    return JobProgress(
        created="2026-12-04T22:00:00Z", job="generate", host="ct200", status=status, source="x"
    )


def _console() -> Console:
    return Console(width=160, record=True, color_system=None)


def test_plain_view_prints_the_eta_while_running_and_not_after():
    console = _console()
    view = PlainView(console)
    view.handle(_event("running", 5400.0))
    assert "100/1000 (10%), 50.0 tok/s, eta 1h30m" in console.export_text()
    console = _console()
    view = PlainView(console)
    view.handle(_event("done", 0.0))
    assert "eta" not in console.export_text()


def test_live_view_shows_the_jobs_eta():
    view = LiveView(["generate"], "regen run · test")
    view.handle(_event("running", 125.0))
    console = _console()
    console.print(view.render())
    assert "eta 2m05s" in console.export_text()
