"""The generation job's ETA: a rate over the last minutes of work, not over the whole run."""

from __future__ import annotations

import pytest

from regen.jobs.eta import RateMeter, fmt_eta


def test_no_estimate_before_there_is_work_to_measure():
    meter = RateMeter(window=60, min_span=2, min_count=5)
    assert meter.eta_s(100) is None
    meter.add(0.0, 0)
    meter.add(1.0, 50)  # only one second seen
    assert meter.rate() is None and meter.eta_s(100) is None
    meter.add(2.0, 100)
    assert meter.rate() == pytest.approx(50.0)
    assert meter.eta_s(1000) == pytest.approx(20.0)


def test_rate_follows_the_last_window_not_the_whole_run():
    meter = RateMeter(window=10, min_span=1, min_count=1)
    # a resumed run: 10,000 skipped-like units in the first second, then 10 per second
    meter.add(0.0, 0)
    meter.add(1.0, 10_000)
    for t in range(2, 40):
        meter.add(float(t), 10_000 + 10 * (t - 1))
    assert meter.rate() == pytest.approx(10.0)
    assert meter.eta_s(3600) == pytest.approx(360.0)


def test_a_stall_empties_the_window():
    meter = RateMeter(window=10, min_span=1, min_count=5)
    for t in range(0, 10):
        meter.add(float(t), 10 * t)
    assert meter.rate() == pytest.approx(10.0)
    for t in range(10, 30):  # nothing finishes for 20 s: readings keep coming from the heartbeat
        meter.add(float(t), 90)
    assert meter.rate() is None and meter.eta_s(500) is None


def test_nothing_left_is_zero_and_unknown_total_is_unknown():
    meter = RateMeter()
    assert meter.eta_s(0) == 0.0
    assert meter.eta_s(None) is None


def test_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="window"):
        RateMeter(window=0)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "?"),
        (5, "5s"),
        (59.6, "1m00s"),
        (725, "12m05s"),
        (3 * 3600 + 20 * 60, "3h20m"),
        (2 * 86400 + 4 * 3600, "2d04h"),
    ],
)
def test_fmt_eta(seconds, text):
    assert fmt_eta(seconds) == text


def test_readings_stay_few_however_often_the_job_reports():
    meter = RateMeter(window=120, min_span=1, min_count=1)
    for i in range(200_000):  # 1,000 batches a second for 200 s
        meter.add(i / 1000, i)
    assert len(meter._readings) <= 260
    assert meter.rate() == pytest.approx(1000.0, rel=0.01)
