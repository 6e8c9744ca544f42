"""What each stage records in the run's artifacts directory on the controller (`regen_artifacts_dir`).

One table, read by the end-of-run summary (`regen.summary`), the run manifest (`regen.provenance`) and
the runner's artifact listing (`regen.runner.artifacts`), so none guesses from file names what a stage
produced. A role that records something new adds its pattern here; the paths are relative to the
artifacts directory.
"""

from __future__ import annotations

from pathlib import Path

FACTS = "model_facts.json"
ENVIRONMENT_MANIFESTS = "provision/*/*.json"  # python_env: <host>/<env>.json
SERVING_LAUNCHES = "serving/*/launch.json"  # sglang_server: <instance>/launch.json
SERVING_STATES = "serving/*/state.json"
GENERATION_STATUSES = "completions/status-*.json"  # completions: the job's final status, per host
TOKENIZE_STATS = "tokenized/stats.json"  # tokenized_data (one generate host; else <host>-stats.json)
TOKENIZE_HISTOGRAM = "tokenized/length_histogram.png"
TRAINING_STATUSES = "drafter/*/status.json"  # drafter_training: <host>/status.json
TRAINING_CHECKPOINTS = "drafter/*/checkpoints.json"
TRAINING_RUN_CONFIGS = "drafter/*/run.yaml"  # the SpecForge run config the trainer was started with
EVALUATION_REPORT = "evaluate/report.json"  # drafter_evaluation: report.json, report.md and its PNGs
EVALUATION_FILES = ("evaluate/report.md", "evaluate/*.png")

RECORDS: dict[str, tuple[str, ...]] = {
    "provision": (ENVIRONMENT_MANIFESTS,),
    "introspect": (FACTS,),
    "serve": (SERVING_LAUNCHES, SERVING_STATES),
    "generate": (GENERATION_STATUSES,),
    "tokenize": (
        TOKENIZE_STATS,
        "tokenized/*-stats.json",
        TOKENIZE_HISTOGRAM,
        "tokenized/*-length_histogram.png",
    ),
    "train": (TRAINING_STATUSES, TRAINING_CHECKPOINTS, TRAINING_RUN_CONFIGS),
    "evaluate": (EVALUATION_REPORT, *EVALUATION_FILES),
}


def find(artifacts_dir: Path, pattern: str) -> list[Path]:
    """The records matching one pattern of the table, sorted."""
    return sorted(p for p in Path(artifacts_dir).glob(pattern) if p.is_file())


def stage_records(artifacts_dir: Path) -> dict[str, list[Path]]:
    """Every stage's records that exist, by stage (stages that recorded nothing are left out)."""
    found = {
        stage: sorted({p for pat in patterns for p in find(artifacts_dir, pat)})
        for stage, patterns in RECORDS.items()
    }
    return {stage: paths for stage, paths in found.items() if paths}
