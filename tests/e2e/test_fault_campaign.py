"""The fault campaign's short version (issue 15): every fault kind at least once, against the real demo model
served by `transformers serve` on loopback, the job CLIs as the roles run them.

The pipeline's disk is a small tmpfs of its own (the campaign mounts it as root; elsewhere the disk_full
rounds are skipped and reported so). The report lands in artifacts/fault_campaign-ci/ for people to read;
`make bench` runs the long version (bench/bench_fault_campaign.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.fault_campaign import FAULT_KINDS, Campaign, CampaignConfig, render_markdown, write_report

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_the_fault_campaign_loses_doubles_and_passes_nothing(demo_model_dir, tmp_path):
    lines: list[str] = []
    config = CampaignConfig(
        workdir=tmp_path / "campaign",
        model_dir=demo_model_dir,
        rounds=len(FAULT_KINDS),  # the first rounds take every kind once, in a seeded order
        seed=15,
        log=lines.append,
    )
    started = time.monotonic()
    with Campaign(config) as campaign:
        report = campaign.run()
    seconds = time.monotonic() - started
    write_report(report, ROOT / "artifacts" / "fault_campaign-ci")
    table = render_markdown(report) + "\n" + "\n".join(lines)

    ran = {kind for kind, outcomes in report["by_kind"].items() if sum(outcomes.values())}
    assert ran == set(FAULT_KINDS), table
    for kind, outcomes in report["by_kind"].items():
        if outcomes.get("skipped"):
            assert kind == "disk_full" and "tmpfs" in " ".join(report["skipped"]), table
    assert report["totals"] == {"lost": 0, "duplicated": 0, "stale": 0, "torn": 0, "leftovers": 0}, table
    assert report["silent_passes"] == 0 and report["failed_unnamed"] == 0, table
    assert report["not_resumed"] == 0, table
    assert report["ok"], table
    print(f"fault campaign: {report['rounds']} rounds in {seconds:.0f} s\n{table}")
