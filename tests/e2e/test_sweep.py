"""playbooks/sweep.yml on the embedded default, for real: two CPU settings measured, a broken and an
infeasible layout recorded, the report with its table and plots, and a second run that measures nothing.

inventory/local lists one layout besides the plan's own: one torch thread (OMP_NUM_THREADS=1) against
torch's default of one per core, a setting that changes the CPU server's speed. The test adds a layout
whose server rejects its flag (fault injection: `--no-such-flag`, so `transformers serve` exits at start)
and one that needs GPUs this host does not have. Work and artifacts go to a temporary directory, so the
repository's artifacts/sweep (which the plan would read) is left alone. About a minute and a half on two
busy cores.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from tests.helpers.ansible import run_playbook

pytestmark = pytest.mark.e2e


def _png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


@pytest.mark.timeout(600)
def test_sweep_measures_records_failures_reports_and_is_reused(tmp_path: Path, demo_model_dir: Path) -> None:
    extra = {
        "regen_work_dir": str(tmp_path / "work"),
        "regen_artifacts_dir": str(tmp_path / "artifacts"),
        "regen_model_path": str(demo_model_dir),
        "layout_sweep_port": 30011,
        "layout_sweep_layouts": [
            {"name": "torch-threads-1", "environment": {"OMP_NUM_THREADS": "1"}},
            {
                "name": "bad-flag",
                "extra_args": ["--no-such-flag"],
            },  # fault injection: the server exits at start
            {"name": "tp2", "tp_size": 2},
        ],
    }
    first = run_playbook("playbooks/sweep.yml", extra_vars=extra, timeout=540)
    assert first.returncode == 0, first.output[-6000:]
    counts = first.counts()
    assert counts["failed"] == 0 and counts["rescued"] == 1 and counts["changed"] > 0, counts

    out = tmp_path / "artifacts" / "sweep"
    report = json.loads((out / "report.json").read_text())
    by_name = {layout["name"]: layout for layout in report["layouts"]}
    assert list(by_name) == ["plan", "torch-threads-1", "bad-flag", "tp2"]
    for name in ("plan", "torch-threads-1"):
        layout = by_name[name]
        assert layout["status"] == "measured", layout
        assert [lv["concurrency"] for lv in layout["levels"]] == [1, 2]
        for level in layout["levels"]:
            assert level["completed"] == 3 and level["failed"] == 0 and level["output_tokens_per_s"] > 0
            assert level["ttft_ms"]["p50"] > 0 and level["tpot_ms"]["p50"] > 0
    assert by_name["torch-threads-1"]["settings"] == {"environment": {"OMP_NUM_THREADS": "1"}}
    broken = by_name["bad-flag"]
    assert broken["status"] == "failed" and "is not ready" in broken["reason"]
    assert broken["diagnosis"] and broken["log_tail"], broken
    assert by_name["tp2"]["status"] == "infeasible" and by_name["tp2"]["reason"].startswith(
        "no GPU on this host"
    )
    rec = report["recommended"]
    assert rec["layout"] in ("plan", "torch-threads-1") and rec["concurrency"] in (1, 2)
    # The simulator does not cover a CPU: every layout says why it has no estimate.
    assert all(lay["estimate"]["output_tokens_per_s"] is None for lay in report["layouts"])

    table = (out / "report.md").read_text()
    assert (
        f"**Recommended for the generate stage: `{rec['layout']}` at concurrency {rec['concurrency']}**"
        in table
    )
    assert (
        len(re.findall(r"^\| `(plan|torch-threads-1)` .* \| measured \| [12] \| ", table, re.MULTILINE)) == 4
    )
    assert "- `bad-flag` failed:" in table and "- `tp2` infeasible:" in table
    for name in report["plots"].values():
        width, height = _png(out / name)
        assert width > 300 and height > 200 and (out / name).stat().st_size > 10_000

    second = run_playbook("playbooks/sweep.yml", extra_vars=extra, timeout=300)
    assert second.returncode == 0, second.output[-4000:]
    assert second.counts()["changed"] == 0, second.output[-4000:]
    assert "measured for the same inputs" in " ".join(second.output.split())
    assert json.loads((out / "report.json").read_text()) == report
