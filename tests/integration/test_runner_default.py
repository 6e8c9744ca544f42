"""The embedded default (inventory/local, the repository's own regen.yml) through `regen run`, end to end.

Slow (the whole pipeline on CPU), so marked e2e: `make e2e` / `make test` run it, `make check` does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from regen.cli import main
from regen.runner import discover_stages

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def test_the_embedded_default_runs_through_regen_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stop_local_server_afterwards: None
) -> None:
    pdd = str(tmp_path / "runner")
    code = main(["run", "--plain", "--project", str(ROOT), "--private-data-dir", pdd])
    out = capsys.readouterr().out
    assert code == 0, out[-6000:]
    assert "regen: exit 0 (ok): all stages ran" in out
    pipeline = [s.name for s in discover_stages(ROOT) if not s.standalone]
    assert main(["status", "--json", "--project", str(ROOT), "--private-data-dir", pdd]) == 0
    # The run history also lists ansible-playbook runs on this checkout's artifacts (other tests' runs
    # among them, some still going): this run is the one the runner recorded in its private data dir.
    (ident,) = [p.name for p in (Path(pdd) / "artifacts").iterdir() if p.is_dir()]
    (last,) = [r for r in json.loads(capsys.readouterr().out) if r["ident"] == ident]
    assert last["status"] == "successful"
    assert [s["name"] for s in last["stages"]] == pipeline
    assert all(s["status"] in ("ok", "changed", "no hosts") for s in last["stages"]), last["stages"]
    # and the plan of the same inventory now finds every stage done
    assert main(["plan", "--json", "--project", str(ROOT), "--private-data-dir", pdd]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {s["state"] for s in report["stages"]} <= {"done", "no hosts"}, report["stages"]
    assert report["plan"] is not None
