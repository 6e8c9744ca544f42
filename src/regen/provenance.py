"""One record of each run: `ARTIFACTS/runs/<run id>/manifest.json`, and what changed between two of them.

The manifest is built only from what the stages recorded in the artifacts directory (`regen.records`
says where): the facts and the plan, the package versions of every venv provisioning recorded, the
serving launch lines, the SpecForge run config, the generation, tokenization, training and evaluation
results, the time each job took, and the sha256 of every record file (the data's own digests live in
those records). `model_facts.json` and the other records are overwritten by the next run; the manifests
are the history.

A run that changed nothing records nothing: the manifest's digest covers everything but its id and
creation time, and a new run directory is written only when it differs from the latest one, so a
second `make regen` stays changed=0 and `runs/` holds one entry per distinct result.

    python -m regen.provenance record --artifacts DIR [--check]   write the run's manifest if it is new
    python -m regen.provenance compare --artifacts DIR [A [B]]    what changed (default: the last two)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from regen import records
from regen.fsio import atomic_write_json, read_json_object
from regen.module_utils.regen_files import file_sha256

SCHEMA = "regen.manifest/1"
RUNS_DIR = "runs"
STAGE_TIMES = "stages"  # timings.stages: seconds per stage of the run that recorded the manifest
HISTORY_DIR = "history"  # runs/history/<run id>.json: every run, however started (regen_history callback)
MANIFEST = "manifest.json"
# The sections `compare` reports, in this order, and what each one holds.
SECTIONS = {
    "inputs": "the model and the record files' digests",
    "settings": "the plan, the serving launch lines and the training run config",
    "versions": "packages of every venv provisioning recorded",
    "results": "what the jobs produced",
    "timings": "seconds per job",
}
# Keys of a job's status that describe its result (the rest is progress bookkeeping: pid, updated_at, line).
_RESULT_KEYS = ("state", "done", "total", "failed", "tokens", "samples", "rejected", "loss", "exit_code")


class ProvenanceError(Exception):
    """A manifest cannot be found or read; the message says which and what to do."""


# Deeper than any record regen writes (a manifest is about 6 levels): a file nested deeper is refused by
# name instead of overflowing Python's recursion in the parser, the flattening or the digest.
MAX_DEPTH = 64


def _depth_ok(value: Any) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return True


def _read(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, None when it is missing or not a JSON object; ProvenanceError naming it
    when it is nested too deeply to be one of regen's records."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    try:
        data = json.loads(text)
    except RecursionError:
        data = None
        deep = True
    except ValueError:
        return None
    else:
        deep = not _depth_ok(data)
    if deep:
        raise ProvenanceError(
            f"{path} is nested deeper than {MAX_DEPTH} levels: it is not a record regen wrote; restore or "
            "remove it"
        )
    return data if isinstance(data, dict) else None


def _digest(manifest: Mapping[str, Any]) -> str:
    # The wall-clock time each stage took in the recording run differs from run to run: it is history,
    # not a result, so an unchanged re-run (same results, other times) still records nothing.
    body = {key: value for key, value in manifest.items() if key not in ("run_id", "created_at", "digest")}
    if isinstance(body.get("timings"), Mapping) and STAGE_TIMES in body["timings"]:
        body["timings"] = {k: v for k, v in body["timings"].items() if k != STAGE_TIMES}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _host_of(path: Path, prefix: str = "") -> str:
    """The host or instance a per-host record belongs to: its directory, or its name after `prefix`."""
    return path.stem.removeprefix(prefix) if prefix else path.parent.name


def _results_of(status: Mapping[str, Any]) -> dict[str, Any]:
    return {key: status[key] for key in _RESULT_KEYS if status.get(key) is not None}


def build_manifest(artifacts: Path) -> dict[str, Any]:
    """The manifest of what `artifacts` holds now (without run id and time; `record` adds them)."""
    artifacts = Path(artifacts)
    found = records.stage_records(artifacts)
    if not found:
        raise ProvenanceError(f"no stage has recorded anything in {artifacts} yet: run a stage first")
    # Whether a server is up now is liveness, not provenance: a teardown between two identical runs
    # must not make them differ.
    liveness = set(records.find(artifacts, records.SERVING_STATES))
    record_digests = {
        str(path.relative_to(artifacts)): file_sha256(path)
        for paths in found.values()
        for path in paths
        if path not in liveness
    }
    facts = _read(artifacts / records.FACTS) or {}
    architecture = facts.get("architecture") or {}
    versions = {}
    for path in records.find(artifacts, records.ENVIRONMENT_MANIFESTS):
        env = _read(path) or {}
        versions[f"{path.parent.name}/{path.stem}"] = {
            "python": (env.get("python") or {}).get("version") if isinstance(env.get("python"), dict)
            else env.get("python"),
            "packages": env.get("packages") or {},
        }  # fmt: skip
    # The controller's own venv: it runs the playbooks and, on the embedded default, serves, tokenizes and
    # runs the jobs (the venvs provisioning builds on the hosts are recorded above).
    versions["controller"] = controller_versions()
    launches = {
        path.parent.name: (_read(path) or {}).get("argv")
        for path in records.find(artifacts, records.SERVING_LAUNCHES)
    }
    run_configs = {
        path.parent.name: file_sha256(path) for path in records.find(artifacts, records.TRAINING_RUN_CONFIGS)
    }
    results: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    for stage, pattern, prefix in (
        ("generate", records.GENERATION_STATUSES, "status-"),
        ("train", records.TRAINING_STATUSES, ""),
    ):
        for path in records.find(artifacts, pattern):
            status = _read(path) or {}
            host = _host_of(path, prefix)
            results.setdefault(stage, {})[host] = _results_of(status)
            elapsed = status.get("elapsed_s")
            if elapsed is None and status.get("state") in ("succeeded", "done", "failed", "stopped"):
                # the training launcher's document: its start and its last update
                began, ended = status.get("started_at"), status.get("updated_at")
                if isinstance(began, int | float) and isinstance(ended, int | float) and ended >= began:
                    elapsed = round(ended - began, 1)
            if elapsed is not None:
                timings.setdefault(stage, {})[host] = elapsed
    stats = _read(artifacts / records.TOKENIZE_STATS)
    if stats is not None:
        results["tokenize"] = _results_of(stats) | {
            key: stats[key] for key in ("supervised_fraction", "shards") if key in stats
        }
        if stats.get("elapsed_s") is not None:
            timings["tokenize"] = stats["elapsed_s"]
    report = _read(artifacts / records.EVALUATION_REPORT)
    if report is not None:
        from regen.evaluate.report import headline

        drafters = report.get("drafters") or {}
        results["evaluate"] = {
            "headline": headline(report),
            "lossless": report.get("lossless"),
            "block_size": report.get("block_size"),
            "acceptance_length": {
                name: (entry or {}).get("acceptance_length") for name, entry in sorted(drafters.items())
            },
            "speedup": report.get("speedup"),
        }
    stage_times = run_stage_times(artifacts, os.environ.get("REGEN_RUN_ID"))
    if stage_times:
        timings[STAGE_TIMES] = stage_times
    manifest = {
        "schema": SCHEMA,
        "inputs": {
            "model_path": facts.get("model_path"),
            "model_type": architecture.get("model_type"),
            "records": dict(sorted(record_digests.items())),
        },
        "settings": {
            "plan": facts.get("plan_values"),
            "serving_launches": launches,
            "training_run_configs": run_configs,
        },
        "versions": versions,
        "results": results,
        "timings": timings,
    }
    manifest["digest"] = _digest(manifest)
    return manifest


def controller_versions() -> dict[str, Any]:
    """Python and the installed distributions of the interpreter running this (the controller's venv)."""
    import importlib.metadata
    import platform

    packages = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name:
            packages[name] = dist.version
    return {"python": platform.python_version(), "packages": dict(sorted(packages.items()))}


def run_stage_times(artifacts: Path, run_id: str | None) -> dict[str, float]:
    """Seconds per stage of the run `run_id` so far, from its run-history document (each play's start and
    end, mapped to its stage by the checkout's regen.yml); {} without one."""
    if not run_id:
        return {}
    doc = read_json_object(Path(artifacts) / RUNS_DIR / HISTORY_DIR / f"{run_id}.json") or {}
    by_play: dict[str, str] = {}
    playbooks = [Path(p) for p in doc.get("playbooks") or []]
    if playbooks and (playbooks[0].parent / "regen.yml").is_file():
        from regen.runner.stages import discover_stages, play_stage_map

        try:
            by_play = play_stage_map(discover_stages(playbooks[0].parent))
        except Exception:  # a checkout whose stages cannot be read: plays stay under their own names
            by_play = {}
    times: dict[str, float] = {}
    for play in doc.get("plays") or []:
        counts = play.get("counts") or {}
        if not any(counts.values()) or not play.get("started") or not play.get("finished"):
            continue  # a play --tags left without a task, or the one still running (the summary's)
        seconds = (_iso_time(play["finished"]) or 0) - (_iso_time(play["started"]) or 0)
        name = by_play.get(str(play.get("name")), str(play.get("name")))
        times[name] = round(times.get(name, 0.0) + max(seconds, 0.0), 1)
    return times


def _iso_time(text: str) -> float | None:
    from datetime import datetime

    try:
        return datetime.fromisoformat(str(text)).timestamp()
    except ValueError:
        return None


def run_dirs(artifacts: Path) -> list[Path]:
    """Run directories holding a manifest, oldest first (run ids start with their UTC time)."""
    root = Path(artifacts) / RUNS_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / MANIFEST).is_file())


def record(artifacts: Path, *, check: bool = False, now: float | None = None) -> dict[str, Any]:
    """Write this run's manifest under `runs/<run id>/` unless the latest one already says the same."""
    if not records.stage_records(Path(artifacts)):
        return {"changed": False, "run_id": None, "reason": f"no stage has recorded anything in {artifacts}"}
    manifest = build_manifest(artifacts)
    existing = run_dirs(artifacts)
    if existing:
        latest = _read(existing[-1] / MANIFEST) or {}
        if latest.get("digest") == manifest["digest"]:
            return {"changed": False, "run_id": existing[-1].name, "manifest": str(existing[-1] / MANIFEST)}
    stamp = time.gmtime(time.time() if now is None else now)
    run_id = f"{time.strftime('%Y%m%dT%H%M%SZ', stamp)}-{manifest['digest'][:8]}"
    path = Path(artifacts) / RUNS_DIR / run_id / MANIFEST
    if not check:
        manifest = {"run_id": run_id, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", stamp), **manifest}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, manifest)
    return {"changed": True, "run_id": run_id, "manifest": str(path)}


def history_records(artifacts: Path) -> list[Path]:
    """The run history's documents (`runs/history/<run id>.json`, one per run however it was started:
    plugins/callback/regen_history.py), oldest first."""
    root = Path(artifacts) / RUNS_DIR / HISTORY_DIR
    return sorted(root.glob("*.json")) if root.is_dir() else []


def _manifest_of_run(artifacts: Path, ref: str) -> Path | None:
    """The manifest the run `ref` (an id `regen status` prints, or a unique prefix) recorded, or None when
    no run of the history matches. A run that ended before the summary stage recorded none: an error."""
    matches = [p for p in history_records(artifacts) if p.stem.startswith(ref)]
    exact = [p for p in matches if p.stem == ref]
    if len(exact) == 1 or len(matches) == 1:
        record = read_json_object((exact or matches)[0]) or {}
        manifest = record.get("manifest")
        if not manifest:
            raise ProvenanceError(
                f"run {record.get('ident', ref)} recorded no manifest (it ended "
                f"{record.get('status')!r} before the summary stage); compare two runs that reached it"
            )
        path = Path(artifacts) / RUNS_DIR / str(manifest) / MANIFEST
        if not path.is_file():
            raise ProvenanceError(f"run {record.get('ident', ref)} names manifest {manifest}, which is gone")
        return path
    return None


def resolve(artifacts: Path, ref: str) -> Path:
    """A manifest from a run id (the manifest's own, or the id `regen status` prints for any run), a unique
    prefix of one, a run directory or a manifest path."""
    candidate = Path(ref)
    if candidate.is_file():
        return candidate
    if (candidate / MANIFEST).is_file():
        return candidate / MANIFEST
    runs = run_dirs(artifacts)
    matches = [p for p in runs if p.name.startswith(ref)]
    if len(matches) == 1:
        return matches[0] / MANIFEST
    if not matches:
        of_run = _manifest_of_run(artifacts, ref)
        if of_run is not None:
            return of_run
    known = ", ".join(p.name for p in runs[-5:]) or "none yet"
    if not matches:
        raise ProvenanceError(f"no run {ref!r} in {Path(artifacts) / RUNS_DIR} (latest: {known})")
    raise ProvenanceError(f"{ref!r} names {len(matches)} runs; give more of the id (latest: {known})")


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping) and value:
        for key in sorted(value):
            yield from _flatten(value[key], f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, list[tuple[str, Any, Any]]]:
    """Per section, the (key, value in a, value in b) of every leaf that differs (None where absent)."""
    changes: dict[str, list[tuple[str, Any, Any]]] = {}
    for section in SECTIONS:
        left, right = dict(_flatten(a.get(section) or {})), dict(_flatten(b.get(section) or {}))
        rows = [(key, left.get(key), right.get(key)) for key in sorted(set(left) | set(right))]
        changes[section] = [row for row in rows if row[1] != row[2]]
    return changes


def _short(value: Any, width: int = 60) -> str:
    text = "-" if value is None else json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= width else text[: width - 1] + "…"


def render_comparison(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    lines = [f"regen compare {a.get('run_id', '?')} → {b.get('run_id', '?')}"]
    changes = compare(a, b)
    if not any(changes.values()):
        return lines[0] + "\n  no difference in inputs, settings, versions, results or timings"
    for section, rows in changes.items():
        if not rows:
            continue
        lines.append(f"  {section} ({SECTIONS[section]}): {len(rows)} changed")
        lines += [f"    {key}: {_short(old)} → {_short(new)}" for key, old, new in rows]
    return "\n".join(lines)


def load(path: Path) -> dict[str, Any]:
    manifest = _read(path)
    if manifest is None or manifest.get("schema") != SCHEMA:
        raise ProvenanceError(f"{path} is not a regen run manifest ({SCHEMA})")
    return manifest


def compare_runs(artifacts: Path, refs: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two manifests `refs` name: none = the last two runs, one = that run against the latest."""
    if len(refs) > 2:
        raise ProvenanceError("compare takes at most two runs")
    runs = run_dirs(artifacts)
    if len(refs) == 2:
        paths = [resolve(artifacts, ref) for ref in refs]
    elif len(refs) == 1:
        if not runs:
            raise ProvenanceError(f"no runs recorded in {Path(artifacts) / RUNS_DIR} yet")
        paths = [resolve(artifacts, refs[0]), runs[-1] / MANIFEST]
    else:
        if len(runs) < 2:
            raise ProvenanceError(
                f"{len(runs)} run(s) recorded in {Path(artifacts) / RUNS_DIR}: a comparison needs two; "
                "name them (regen compare RUN_A RUN_B) or run the pipeline again after a change"
            )
        paths = [runs[-2] / MANIFEST, runs[-1] / MANIFEST]
    return load(paths[0]), load(paths[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m regen.provenance", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("record", help="write this run's manifest when it differs from the latest one")
    p.add_argument("--artifacts", type=Path, required=True)
    p.add_argument("--check", action="store_true", help="say whether it would write one; write nothing")
    p = sub.add_parser("compare", help="what changed between two runs")
    p.add_argument("--artifacts", type=Path, required=True)
    p.add_argument("runs", nargs="*", metavar="RUN", help="run ids, unique prefixes or manifest paths")
    p.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.command == "record":
            print(json.dumps(record(args.artifacts, check=args.check)))
            return 0
        a, b = compare_runs(args.artifacts, args.runs)
    except ProvenanceError as exc:
        print(f"regen: {exc}", file=sys.stderr)
        return 4
    if args.json:
        print(json.dumps({k: [list(r) for r in v] for k, v in compare(a, b).items()}, default=str, indent=2))
    else:
        print(render_comparison(a, b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
