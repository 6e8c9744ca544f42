"""The fault campaign (`tests.helpers.fault_campaign`): the local pipeline's jobs under one injected fault
per round, against the real demo model served by `transformers serve` on loopback.

    .venv/bin/python bench/bench_fault_campaign.py [--rounds 60] [--seed 0] [--kinds sigkill,sigterm,...]
        [--output artifacts/fault_campaign] [--workdir DIR] [--keep]

`make bench` runs it with the defaults. Prints one line per round and the table of faults by kind and
outcome; writes report.json and report.md under --output. Exit 1 when any record was lost, duplicated,
stale or torn, a stage passed silently, a failure did not name its fault, or a round did not resume.
Root mounts a small tmpfs for the pipeline's disk (the disk_full rounds); elsewhere they are skipped, with
the reason in the report.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # tests.helpers

from tests.helpers.fault_campaign import FAULT_KINDS, Campaign, CampaignConfig, render_markdown, write_report


def demo_model() -> Path:
    from regen.demo.build import build, inputs_digest
    from regen.demo.spec import DemoSpec

    spec = DemoSpec()
    output = ROOT / ".cache" / "demo-models" / inputs_digest(spec)[:16] / "regen-demo-kimi"
    build(output, spec)
    return output


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=ROOT / "artifacts" / "fault_campaign")
    p.add_argument("--kinds", default=",".join(FAULT_KINDS), help="comma-separated fault kinds")
    p.add_argument("--workdir", type=Path, help="where the pipeline runs (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, outputs)")
    p.add_argument("--stop-on-problem", action="store_true", help="stop after the first round with a finding")
    a = p.parse_args(argv)
    kinds = tuple(k for k in a.kinds.split(",") if k)
    unknown = sorted(set(kinds) - set(FAULT_KINDS))
    if unknown:
        p.error(f"unknown fault kinds {unknown}; choose from {', '.join(FAULT_KINDS)}")
    work = a.workdir or Path(tempfile.mkdtemp(prefix="regen-fault-campaign-"))
    config = CampaignConfig(
        workdir=work,
        model_dir=demo_model(),
        rounds=a.rounds,
        seed=a.seed,
        kinds=kinds,
        stop_on_problem=a.stop_on_problem,
    )
    try:
        with Campaign(config) as campaign:
            report = campaign.run()
    finally:
        if not a.keep and a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    js, md = write_report(report, a.output)
    print(render_markdown(report))
    print(f"report: {md} and {js}" + (f"; work directory kept: {work}" if a.keep else ""))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
