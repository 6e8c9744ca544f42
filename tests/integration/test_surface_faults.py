"""The surface fault campaign's short version (issue 25, item 4): every probe of
`tests.helpers.surface_faults` once (online, rolling, evaluate, sweep, provenance, prompts and the address
policy), each job run as its CLI on a damaged input; none may answer with a traceback, a silent pass, a
leak, an undocumented exit code or an unnamed refusal. `make bench` runs the long version
(bench/bench_surface_faults.py: many seeded shapes of each damage). The report lands in
artifacts/surface_faults-ci/ for people to read.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.surface_faults import PROBES, SURFACES, render_markdown, run, write_report

ROOT = Path(__file__).resolve().parents[2]


def test_every_new_surface_answers_bad_input_with_a_documented_exit(demo_model_dir, tmp_path):
    lines: list[str] = []
    report = run(tmp_path / "campaign", seed=25, model_dir=demo_model_dir, log=lines.append)
    write_report(report, ROOT / "artifacts" / "surface_faults-ci")
    table = render_markdown(report) + "\n" + "\n".join(lines)
    assert report["rounds"] == len(PROBES)
    assert {row["surface"] for row in report["rows"]} == set(SURFACES), table
    assert not report["skipped"], table
    assert report["problems"] == 0 and report["ok"], table
