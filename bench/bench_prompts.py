"""The prompts job on a million rows against a bare loop, and the generation job's input check on that set.

    python bench/bench_prompts.py [--rows 1000000] [--min-ratio 0.5] [--max-check-ratio 1.5]

Issue 29 asks for the per-record paths at production size. Measured in one run, on this machine:

- source: --rows ShareGPT rows (`conversations` of `from`/`value` turns: a system prompt in one row in
  ten, a question of 20-120 words, an answer of 40-200 words; one row in twenty repeats an earlier
  question), written to one JSONL file;
- peer: a bare loop in its own process over the same file, the least a correct build does: parse each
  line, map the roles, drop a prompt already seen (a set of the prompt side's digests), write one JSON line
  per row kept. No shards, no rejects, no manifest, no length statistics;
- the job (`python -m regen.jobs.prompts` in its own process): rows/s over its wall time (start-up
  included) and CPU; its ratio to the peer must be >= --min-ratio. Its peak RSS at a quarter of the rows
  and at all of them: the growth per row (the job holds a digest of every prompt and id kept, to drop
  duplicates) is reported beside the peer's, which holds one digest per prompt;
- the generation job's check of that set before its first request (`verify_manifest`: every shard's rows
  and sha256 against the manifest), against a bare read of the same shards that counts lines and hashes
  them; its ratio (seconds) must be <= --max-check-ratio.

Exit 1 when a limit is missed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PY = sys.executable

_BARE_LOOP = """
import hashlib, json, sys, time
src, out = sys.argv[1], sys.argv[2]
roles = {"system": "system", "human": "user", "gpt": "assistant"}
seen = set()
t0 = time.perf_counter()
kept = 0
with open(src, encoding="utf-8") as fh, open(out, "w", encoding="utf-8") as dst:
    for line in fh:
        row = json.loads(line)
        turns = [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]
        asked = [t for t in turns if t["role"] != "assistant"]
        key = hashlib.blake2b(json.dumps(asked, ensure_ascii=False).encode(), digest_size=16).digest()
        if key in seen:
            continue
        seen.add(key)
        kept += 1
        dst.write(json.dumps({"id": row["id"], "conversations": turns}, ensure_ascii=False) + "\\n")
print(json.dumps({"kept": kept, "seconds": time.perf_counter() - t0}))
"""


def write_source(path: Path, rows: int, seed: int = 0) -> int:
    """ShareGPT rows; returns how many repeat an earlier question."""
    rng = random.Random(seed)
    vocabulary = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(5000)
    ]

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choices(vocabulary, k=rng.randint(lo, hi)))

    questions: list[str] = []
    repeats = 0
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(rows):
            if questions and rng.random() < 0.05:
                question = rng.choice(questions[-10_000:])
                repeats += 1
            else:
                question = text(20, 120) + "?"
                questions.append(question)
                if len(questions) > 20_000:
                    del questions[:10_000]
            turns = [{"from": "system", "value": "You are a helpful assistant."}] if i % 10 == 0 else []
            turns += [{"from": "human", "value": question}, {"from": "gpt", "value": text(40, 200) + "."}]
            fh.write(json.dumps({"id": f"row-{i:08d}", "conversations": turns}) + "\n")
    return repeats


def _run(args: list[str]) -> tuple[str, float, float, float]:
    """(stdout, wall seconds, CPU seconds, peak RSS MB) of a child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out = proc.stdout.read() if proc.stdout else ""
    err = proc.stderr.read() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{args[:4]} failed: {err[-2000:]}")
    return out, wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def prompts_job(source: Path, out: Path) -> tuple[dict, float, float, float]:
    shutil.rmtree(out, ignore_errors=True)
    args = [PY, "-m", "regen.jobs.prompts", "--source", str(source), "--output-dir", str(out)]
    _, wall, cpu, rss = _run([*args, "--log-level", "warning"])
    manifest = json.loads((out / "manifest.json").read_text())
    return manifest, wall, cpu, rss


def bare_loop(source: Path, out: Path) -> tuple[dict, float, float, float]:
    text, wall, cpu, rss = _run([PY, "-c", _BARE_LOOP, str(source), str(out)])
    return json.loads(text), wall, cpu, rss


def bare_check(prompt_dir: Path) -> float:
    """Seconds to count the lines of every shard and hash it: the least the input check reads."""
    t0 = time.perf_counter()
    for shard in sorted(prompt_dir.glob("prompts-*.jsonl")):
        digest = hashlib.sha256()
        lines = 0
        with open(shard, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
                lines += chunk.count(b"\n")
    return time.perf_counter() - t0


def job_check(prompt_dir: Path) -> float:
    from regen.jobs.generate.rows import verify_manifest

    t0 = time.perf_counter()
    verify_manifest([str(prompt_dir)])
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--min-ratio", type=float, default=0.5, help="the job's rows/s against the bare loop's")
    p.add_argument(
        "--max-check-ratio", type=float, default=1.5, help="input check seconds against a bare read"
    )
    a = p.parse_args()
    load = os.getloadavg()[0]
    print(f"bench_prompts: {os.cpu_count()} cores, python {sys.version.split()[0]}, load {load:.2f}")
    ok = True
    with tempfile.TemporaryDirectory(prefix="bench-prompts-") as tmp:
        work = Path(tmp)
        results = {}
        for rows in (a.rows // 4, a.rows):
            source = work / f"source-{rows}.jsonl"
            repeats = write_source(source, rows)
            size_mb = source.stat().st_size / 2**20
            peer, peer_wall, peer_cpu, peer_rss = bare_loop(source, work / "bare.jsonl")
            manifest, wall, cpu, rss = prompts_job(source, work / f"prompts-{rows}")
            results[rows] = (rss, peer_rss)
            if manifest["rows"] != peer["kept"] or manifest["duplicates"] != rows - peer["kept"]:
                print(f"MISMATCH: the job kept {manifest['rows']} rows, the loop {peer['kept']}")
                ok = False
            ratio = (rows / wall) / (rows / peer_wall)
            print(
                f"{rows:>9,} rows ({size_mb:,.0f} MB, {repeats:,} repeated questions): bare loop "
                f"{rows / peer_wall:,.0f} rows/s (CPU {peer_cpu:.1f} s, peak RSS {peer_rss:.0f} MB); job "
                f"{rows / wall:,.0f} rows/s (CPU {cpu:.1f} s, peak RSS {rss:.0f} MB, "
                f"{len(manifest['shards'])} shards); ratio {ratio:.2f}"
            )
            if rows == a.rows:
                good = ratio >= a.min_ratio
                ok = ok and good
                print(
                    f"ok: the job at {ratio:.2f}x the bare loop (limit {a.min_ratio})"
                    if good
                    else f"MISSED: the job at {ratio:.2f}x the bare loop (limit {a.min_ratio})"
                )
                prompt_dir = work / f"prompts-{rows}"
                bare_s = min(bare_check(prompt_dir) for _ in range(3))
                job_s = min(job_check(prompt_dir) for _ in range(3))
                check_ratio = job_s / bare_s
                good = check_ratio <= a.max_check_ratio
                ok = ok and good
                print(
                    f"input check of the {rows:,}-row set before generation: {job_s:.2f} s against a bare "
                    f"count-and-hash {bare_s:.2f} s = {check_ratio:.2f}x (limit {a.max_check_ratio}) "
                    f"{'OK' if good else 'MISSED'}"
                )
            source.unlink()
        (small_rss, small_peer), (large_rss, large_peer) = results[a.rows // 4], results[a.rows]
        grown = a.rows - a.rows // 4
        job_per_row = (large_rss - small_rss) * 2**20 / grown
        peer_per_row = (large_peer - small_peer) * 2**20 / grown
        print(
            f"memory: the job grows {job_per_row:.0f} bytes per row ({small_rss:.0f} -> {large_rss:.0f} MB), "
            f"the bare loop {peer_per_row:.0f} ({small_peer:.0f} -> {large_peer:.0f} MB)"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
