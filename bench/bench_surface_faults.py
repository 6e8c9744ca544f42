"""The surface fault campaign's long version (`tests.helpers.surface_faults`): many seeded shapes of each
damage fed to the online, rolling, evaluate, sweep, provenance and prompts jobs and the address policy.

    .venv/bin/python bench/bench_surface_faults.py [--rounds 200] [--seed 0] [--output DIR]

`make bench` runs it with the defaults. Prints one line per round and the table of outcomes by surface;
writes report.json and report.md under --output. Exit 1 when any round found a traceback, a silent pass, a
leak, an undocumented exit code or an unnamed refusal.
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

from tests.helpers.surface_faults import render_markdown, run, write_report


def demo_model() -> Path:
    from regen.demo.build import build, cache_entry
    from regen.demo.spec import DemoSpec

    spec = DemoSpec()
    output = cache_entry(ROOT / ".cache" / "demo-models", spec)
    build(output, spec)
    return output


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=ROOT / "artifacts" / "surface_faults")
    p.add_argument("--workdir", type=Path, help="where the probes run (default: a temporary directory)")
    a = p.parse_args(argv)
    work = a.workdir or Path(tempfile.mkdtemp(prefix="regen-surface-faults-"))
    try:
        report = run(work, rounds=a.rounds, seed=a.seed, model_dir=demo_model())
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    js, md = write_report(report, a.output)
    print(render_markdown(report))
    print(f"report: {md} and {js}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
