"""The fault campaign over the newest surfaces (issue 25): each job fed bad inputs, checked for tracebacks,
silent passes and leaks.

    python bench/bench_surface_faults.py [--rounds 200] [--seed 0] [--output DIR]

`tests.helpers.fault_campaign` kills and starves the pipeline's long jobs (prompts, generate, tokenize);
this campaign covers what landed after it: the online path (prompt file, preflight, capture server), the
rolling rounds (ledger, round files, feature files), the GPU evaluation's client and report, the sweep's
report, the run manifests (`regen compare`, `provenance record`) and the prompts job's sources. Each
*probe* prepares one damaged input in a directory of its own and runs the job's CLI as a role (or a user)
runs it, in a subprocess, then judges the outcome:

  ok              the job refused with an exit code its documentation lists and a message naming the fault
                  (or, where the contract is to repair, exited 0 and said it repaired)
  traceback       a Python traceback instead of a documented exit code
  silent_pass     exit 0 (or "changed": false) although the input was damaged
  leak            a secret of the input (a password in a URL) in the output, the error or a written file
  wrong_exit      an exit code the job does not document for this fault
  unnamed         a refusal whose message does not name the fault

Damage is seeded: a probe with `damage` draws where to cut or which byte to flip from the round's random
generator, so the long version (`bench/bench_surface_faults.py`, `make bench`) tries many shapes of the same
fault and the short version (tests/integration/test_surface_faults.py, in CI) each probe once. The inputs
are real files in the formats the jobs read (a ledger `regen.training.rolling` plans, Parquet written by
pyarrow, manifests as `regen.provenance` writes them); nothing is mocked, and no model is loaded except where
a probe needs a tokenizer (`model_dir`; those probes are skipped, and reported so, without one).
"""

from __future__ import annotations

import dataclasses
import json
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUTCOMES = ("ok", "traceback", "silent_pass", "leak", "wrong_exit", "unnamed", "skipped")
PROBLEMS = ("traceback", "silent_pass", "leak", "wrong_exit", "unnamed")
SURFACES = ("online", "rolling", "evaluate", "sweep", "provenance", "prompts", "bind")
TRACEBACK = "Traceback (most recent call last)"


@dataclasses.dataclass
class Case:
    """One prepared run: the CLI (module and arguments) and what its outcome must show."""

    argv: list[str]
    exits: tuple[int, ...]  # the documented exit codes that answer this fault
    mention: str  # text the answer must hold (names the fault, or the repair)
    forbid: str | None = None  # text that would be a silent pass ('"changed": false' for a repair)
    secret: str | None = None  # must appear nowhere the job writes or prints
    scan: tuple[Path, ...] = ()  # files and directories to search for the secret
    timeout: float = 120.0


@dataclasses.dataclass
class Probe:
    surface: str
    name: str
    prepare: Callable[[Path, random.Random, dict[str, Any]], Case | str]  # a Case, or why it is skipped


def judge(case: Case, rc: int, stdout: str, stderr: str) -> tuple[str, str]:
    """(outcome, detail) of one run of `case`."""
    text = stdout + "\n" + stderr
    if TRACEBACK in stderr or TRACEBACK in stdout:
        line = next((ln for ln in reversed(stderr.splitlines()) if ln.strip()), "")
        return "traceback", line[:300]
    if case.secret:
        places = [("stdout/stderr", text)]
        for root in case.scan:
            files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
            places += [(str(p), p.read_text(encoding="utf-8", errors="replace")) for p in files]
        found = [where for where, body in places if case.secret in body]
        if found:
            return "leak", f"the secret is in {', '.join(found)}"
    if rc == 0 and 0 not in case.exits:
        return "silent_pass", f"exit 0: {stdout.strip()[-200:]}"
    if case.forbid and case.forbid in text:
        return "silent_pass", f"said {case.forbid!r}"
    if rc not in case.exits:
        return "wrong_exit", f"exit {rc}, documented {case.exits}: {text.strip()[-300:]}"
    if case.mention not in text:
        return "unnamed", f"exit {rc} without {case.mention!r}: {text.strip()[-300:]}"
    return "ok", f"exit {rc}"


def run_case(case: Case) -> tuple[int, str, str]:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", *case.argv],
            capture_output=True,
            text=True,
            timeout=case.timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        return -9, str(exc.stdout or ""), f"timed out after {case.timeout} s (a hang is no answer)"
    return proc.returncode, proc.stdout, proc.stderr


# --------------------------------------------------------------------------------------------------
# Damage
# --------------------------------------------------------------------------------------------------


def damage_bytes(data: bytes, rng: random.Random) -> bytes:
    """A copy of `data` cut short, torn at the end, or with bytes overwritten; never equal to `data`."""
    kind = rng.choice(("truncate", "tear", "overwrite"))
    if kind == "truncate" or len(data) < 8:
        cut = rng.randrange(0, max(1, len(data) - 1))
        return data[:cut]
    if kind == "tear":
        return data[: -rng.randint(1, min(16, len(data) - 1))]
    start = rng.randrange(0, len(data) - 1)
    length = rng.randint(1, min(64, len(data) - start))
    spoiled = bytes((b ^ 0xFF) for b in data[start : start + length])
    return data[:start] + spoiled + data[start + length :]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


# --------------------------------------------------------------------------------------------------
# Probes: rolling
# --------------------------------------------------------------------------------------------------

_RUN = "dflash-campaign"
_KEPT = [(0, 10), (2, 20), (3, 30), (5, 40)]
_STEPS = [[3], [0], [1], [2], [0]]


def _ledger(work: Path) -> Path:
    from regen.training import rolling

    inputs = {
        "samples": len(_KEPT),
        "fingerprint": "f" * 16,
        "world_size": 1,
        "batch_size": 1,
        "accumulation_steps": 1,
        "epochs": 2,
        "total_steps": len(_STEPS),
        "seed": 42,
        "file_bytes_per_token": 100,
        "max_length": 64,
        "max_samples": None,
    }
    sizes = [rolling.file_bytes(tokens, 100, 4096) for _, tokens in _KEPT]
    ledger, documents = rolling.build_ledger(
        None,
        inputs=inputs,
        kept=_KEPT,
        sizes=sizes,
        steps=_STEPS,
        budget=24576,
        checkpoint=0,
        run_id=_RUN,
        features=str(work / "features"),
        block=4096,
    )
    path = work / "run" / "rolling" / "ledger.json"
    rolling.write_ledger(path, ledger, documents)
    return path


def _rolling_argv(ledger: Path, command: str, *extra: str) -> list[str]:
    checkpoints = str(ledger.parents[1] / "ckpt")
    return ["regen.training.rolling", command, "--ledger", str(ledger), "--checkpoints", checkpoints,
            "--run-id", _RUN, *extra]  # fmt: skip


def _rolling_damaged_feature(work: Path, rng: random.Random, _ctx: dict[str, Any]) -> Case:
    from regen.training.capture import record_digest, sample_path

    ledger = _ledger(work)
    features = work / "features"
    features.mkdir()
    first = json.loads((ledger.parent / "round-000.json").read_text())["indices"]
    for index in first:
        path = sample_path(features, index)
        path.write_bytes(bytes(rng.randrange(256) for _ in range(3000)))
        record_digest(features, index, path)
    victim = sample_path(features, rng.choice(first))
    victim.write_bytes(damage_bytes(victim.read_bytes(), rng) or b"x")
    return Case(_rolling_argv(ledger, "check", "--round", "0"), (2,), victim.name)


def _rolling_missing_round(work: Path, rng: random.Random, _ctx: dict[str, Any]) -> Case:
    ledger = _ledger(work)
    rounds = sorted(ledger.parent.glob("round-*.json"))
    missing = rng.choice(rounds)
    missing.unlink()
    return Case(_rolling_argv(ledger, "prepare", "--round", "0"), (2,), f"{missing.name}, the sample list")


def _rolling_damaged_ledger(work: Path, rng: random.Random, _ctx: dict[str, Any]) -> Case:
    ledger = _ledger(work)
    ledger.write_bytes(damage_bytes(ledger.read_bytes(), rng))
    # A damaged ledger that still parses may name other rounds: any documented refusal, or a plan.
    return Case(_rolling_argv(ledger, "status"), (0, 2), "")


def _rolling_damaged_round_file(work: Path, rng: random.Random, _ctx: dict[str, Any]) -> Case:
    ledger = _ledger(work)
    path = ledger.parent / "round-000.json"
    path.write_bytes(damage_bytes(path.read_bytes(), rng))
    return Case(_rolling_argv(ledger, "check", "--round", "0"), (2,), "round")


# --------------------------------------------------------------------------------------------------
# Probes: online
# --------------------------------------------------------------------------------------------------


def _tokenized(directory: Path, rows: int = 12) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "part-00000.jsonl").open("w") as out:
        for i in range(rows):
            ids = [10 * i + k for k in range(6)]
            out.write(json.dumps({"input_ids": ids, "loss_mask": [0, 1, 1, 1, 1, 1]}) + "\n")


def _online_damaged_prompts(work: Path, rng: random.Random, _ctx: dict[str, Any]) -> Case:
    from regen.training.disagg import write_prompts

    _tokenized(work / "tok")
    out = work / "run" / "prompts.jsonl"
    write_prompts(str(work / "tok"), str(out), 16, None)
    out.write_bytes(damage_bytes(out.read_bytes(), rng))
    argv = ["regen.training.disagg", "prompts", "--data", str(work / "tok"), "--output", str(out)]
    return Case([*argv, "--max-length", "16"], (0,), "made again", forbid='"changed": false')


def _online_preflight_down(work: Path, rng: random.Random, _ctx: dict[str, Any]) -> Case:
    port = _free_port()
    argv = ["regen.training.disagg", "preflight", "--url", f"http://127.0.0.1:{port}", "--timeout", "1"]
    argv += ["--mooncake-master", f"127.0.0.1:{_free_port()}"]
    argv += ["--mooncake-metadata", f"http://127.0.0.1:{_free_port()}/metadata"]
    return Case(argv, (1,), f"127.0.0.1:{port}")


# --------------------------------------------------------------------------------------------------
# Probes: the one address policy (capture server), evaluate, sweep, provenance, prompts
# --------------------------------------------------------------------------------------------------

WILDCARD_SPELLINGS = ("0.0.0.0", "::", "[::]", "0", "0x0", "0.0", "::ffff:0.0.0.0", "0.0.0.0/0", "", "*")


def _bind_capture_server_wildcard(work: Path, rng: random.Random, _ctx: dict[str, Any]) -> Case:
    host = rng.choice(WILDCARD_SPELLINGS)
    argv = ["regen.training.capture_server", "--model", str(work / "none"), "--layers", "1", "--host", host]
    return Case([*argv, "--port", "0"], (2,), "would expose the capture server")


def _evaluate_credentialed_endpoint(work: Path, rng: random.Random, ctx: dict[str, Any]) -> Case | str:
    import regen.data as regen_data
    model = ctx.get("model_dir")
    if not model:
        return "needs model_dir (a target whose tokenizer renders the prompts)"
    drafter = work / "export"
    drafter.mkdir()
    config = {"architectures": ["DFlashDraftModel"], "block_size": 8, "num_hidden_layers": 1}
    config["dflash_config"] = {"target_layer_ids": [2], "mask_token_id": 3845}
    (drafter / "config.json").write_text(json.dumps(config))
    secret = f"pw-{rng.randrange(10**9)}"
    out = work / "out"
    # The demo prompts the package ships (regen.data), wherever regen is imported from.
    prompts = Path(regen_data.__file__).with_name("demo_prompts.jsonl")
    argv = ["regen.jobs.evaluate_serving", "run", "--target-model", str(model), "--checkpoint", str(drafter)]
    argv += [
        "--prompts",
        str(prompts),
        "--output-dir",
        str(out),
        "--max-prompts",
        "1",
        "--max-new-tokens",
        "2",
    ]
    argv += ["--prompt-max-tokens", "64", "--concurrency", "1", "--server", rng.choice(("plain", "dflash"))]
    argv += [
        "--endpoint",
        f"http://user:{secret}@127.0.0.1:{_free_port()}",
        "--no-tie-probe",
        "--no-progress",
    ]
    return Case(argv, (3,), "nothing answers at", secret=secret, scan=(out,), timeout=300)


def _sweep_damaged_record(work: Path, rng: random.Random, _ctx: dict[str, Any]) -> Case:
    record = {
        "name": "tp1",
        "settings": {"tp_size": 1},
        "status": "measured",
        "reason": None,
        "levels": [
            {"concurrency": 1, "output_tokens_per_s": 50.0, "completed": 8, "failed": 0,
             "ttft_ms": {"p50": 10.0, "p90": 12.0, "p99": 13.0}, "tpot_ms": {"p50": 5.0, "p90": 6.0}},
        ],
        "estimate": None,
    }  # fmt: skip
    path = work / "tp1.json"
    text = json.dumps(record).encode()
    damaged = damage_bytes(text, rng)
    if rng.random() < 0.3:  # a whole-JSON record with a wrong field, not only torn bytes
        field, value = rng.choice(
            [("levels", "none"), ("status", "great"), ("name", 7), ("levels", [{"concurrency": 0}])]
        )
        damaged = json.dumps({**record, field: value}).encode()
    path.write_bytes(damaged)
    argv = ["regen.jobs.sweep", "report", "--results", str(path), "--output-dir", str(work / "out")]
    return Case([*argv, "--inputs-digest", "d"], (2,), "not a layout record")


def _provenance_damaged_manifest(work: Path, rng: random.Random, _ctx: dict[str, Any]) -> Case:
    runs = work / "runs"
    for run_id in ("20260101T000000Z-a", "20260102T000000Z-b"):
        (runs / run_id).mkdir(parents=True)
        doc = {"schema": "regen.manifest/1", "run_id": run_id, "results": {"evaluate": {"lossless": True}}}
        (runs / run_id / "manifest.json").write_text(json.dumps(doc))
    victim = runs / rng.choice(("20260101T000000Z-a", "20260102T000000Z-b")) / "manifest.json"
    if rng.random() < 0.5:
        victim.write_text(
            '{"schema": "regen.manifest/1", "results": ' + _deep(rng.choice((100, 5000, 10**5))) + "}"
        )
    else:
        victim.write_bytes(damage_bytes(victim.read_bytes(), rng))
    command = rng.choice((["regen.provenance", "compare"], ["regen.cli", "compare"]))
    # A damage that leaves a valid manifest (a flipped byte inside a value) is still a comparison.
    return Case([*command, "--artifacts", str(work)], (0, 4), "")


def _provenance_deep_record(work: Path, rng: random.Random, _ctx: dict[str, Any]) -> Case:
    artifacts = work / "artifacts"
    (artifacts / "generate").mkdir(parents=True)
    (artifacts / "model_facts.json").write_text('{"plan": ' + _deep(rng.choice((100, 3000, 10**5))) + "}")
    return Case(["regen.provenance", "record", "--artifacts", str(artifacts)], (4,), "nested deeper than")


def _prompts_damaged_parquet(work: Path, rng: random.Random, _ctx: dict[str, Any]) -> Case:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = work / "prompts.parquet"
    rows = [{"id": str(i), "prompt": f"question {i} " * rng.randint(5, 30)} for i in range(1500)]
    pq.write_table(pa.Table.from_pylist(rows), path, compression="none", row_group_size=300)
    data = bytearray(path.read_bytes())
    # A data page in the middle of the file (not the footer, which pyarrow reads up front).
    start = rng.randrange(len(data) // 4, len(data) // 2)
    data[start : start + 512] = bytes(rng.randrange(256) for _ in range(512))
    path.write_bytes(bytes(data))
    argv = ["regen.jobs.prompts", "--source", str(path), "--output-dir", str(work / "out")]
    # A page whose overwritten bytes still decode is a build (exit 0); a damaged one is named (exit 2).
    return Case(argv, (0, 2), "")


PROBES: tuple[Probe, ...] = (
    Probe("rolling", "feature file damaged after capture", _rolling_damaged_feature),
    Probe("rolling", "round file missing", _rolling_missing_round),
    Probe("rolling", "round file damaged", _rolling_damaged_round_file),
    Probe("rolling", "ledger damaged", _rolling_damaged_ledger),
    Probe("online", "prompt file damaged", _online_damaged_prompts),
    Probe("online", "capture server and Mooncake down", _online_preflight_down),
    Probe("bind", "capture server on a wildcard", _bind_capture_server_wildcard),
    Probe("evaluate", "credentialed endpoint that does not answer", _evaluate_credentialed_endpoint),
    Probe("sweep", "layout record damaged", _sweep_damaged_record),
    Probe("provenance", "run manifest damaged or nested", _provenance_damaged_manifest),
    Probe("provenance", "record nested deeper than a record", _provenance_deep_record),
    Probe("prompts", "Parquet data page damaged", _prompts_damaged_parquet),
)


def run(
    workdir: Path,
    *,
    rounds: int | None = None,
    seed: int = 0,
    model_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run `rounds` probes (default: each probe once, in order; more draw probes at random) and return the
    report: one row per round, outcomes by surface, and `ok` (no problem found)."""
    rng = random.Random(seed)
    schedule = list(PROBES)
    total = len(schedule) if rounds is None else rounds
    while len(schedule) < total:
        schedule.append(rng.choice(PROBES))
    rows = []
    by_surface: dict[str, Counter] = {surface: Counter() for surface in SURFACES}
    context = {"model_dir": str(model_dir) if model_dir else None}
    for number, probe in enumerate(schedule[:total], start=1):
        work = Path(workdir) / f"round-{number:04d}"
        work.mkdir(parents=True)
        round_rng = random.Random(rng.randrange(2**32))
        started = time.monotonic()
        prepared = probe.prepare(work, round_rng, context)
        if isinstance(prepared, str):
            outcome, detail, rc = "skipped", prepared, None
        else:
            rc, out, err = run_case(prepared)
            outcome, detail = judge(prepared, rc, out, err)
        seconds = round(time.monotonic() - started, 2)
        by_surface[probe.surface][outcome] += 1
        rows.append({"round": number, "surface": probe.surface, "probe": probe.name, "outcome": outcome,
                     "exit": rc, "detail": detail, "seconds": seconds})  # fmt: skip
        log(f"round {number}/{total}: {probe.surface}: {probe.name}: {outcome} ({detail}) in {seconds} s")
    problems = sum(1 for row in rows if row["outcome"] in PROBLEMS)
    return {
        "rounds": len(rows),
        "seed": seed,
        "rows": rows,
        "by_surface": {surface: dict(counts) for surface, counts in by_surface.items()},
        "problems": problems,
        "skipped": [f"{row['probe']}: {row['detail']}" for row in rows if row["outcome"] == "skipped"],
        "ok": problems == 0,
    }


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Surface fault campaign: {report['rounds']} rounds, seed {report['seed']}, "
        f"{report['problems']} problem(s)",
        "",
        "| surface | " + " | ".join(OUTCOMES) + " |",
        "|---|" + "---|" * len(OUTCOMES),
    ]
    for surface, counts in report["by_surface"].items():
        lines.append(f"| {surface} | " + " | ".join(str(counts.get(o, 0)) for o in OUTCOMES) + " |")
    found = [row for row in report["rows"] if row["outcome"] in PROBLEMS]
    if found:
        lines += ["", "## Problems", ""]
        lines += [
            f"- round {r['round']} {r['surface']}: {r['probe']}: {r['outcome']}: {r['detail']}" for r in found
        ]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], output: Path) -> tuple[Path, Path]:
    from regen.fsio import atomic_write_json, atomic_write_text

    output.mkdir(parents=True, exist_ok=True)
    atomic_write_json(output / "report.json", report)
    atomic_write_text(output / "report.md", render_markdown(report))
    return output / "report.json", output / "report.md"
