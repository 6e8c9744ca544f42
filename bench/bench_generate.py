"""Benchmarks of the generation job against the STUB OpenAI-compatible server on loopback.

    .venv/bin/python bench/bench_generate.py [--quick] [--strict]
        [--only throughput,overhead,resume,memory,long]
        [--long-prompts N] [--long-rounds R] [--long-sizes 1500,6000] [--long-memory 10000,160000]

Every number is a ratio against a limit or a peer measured in the same run, on this machine:
  throughput  stub answers after 200 ms; with 256 requests in flight the limit is 256/0.2 = 1280 req/s.
              Target: the job reaches >= 0.9 of it.
  overhead    stub answers at once; the job's client CPU per request, and its requests/s against the usual
              baseline, a 64-thread pool of the official `openai` client doing the same work (read the
              prompts, call the API, write JSONL). Target: >= 2x the baseline's requests/s.
  resume      opening an output directory whose ledger holds 1,000,000 finished ids. Target: <= 2 s, and
              the memory it takes (the id index is 16 bytes per id) reported; plus a whole no-op run over
              the 1M prompts.
  memory      peak RSS of the job over a small and a 5x larger prompt file. Target: the larger file costs
              <= 1.25x the memory (the input is streamed, never loaded whole).
  long        answers of real size: the stub answers ~6 KB and ~24 KB (1,500 and 6,000 filler words) after
              200 ms, 512 requests in flight, the degeneration stop on. The peer is a bare aiohttp client
              (a semaphore, parse the answer, one JSON line per answer) against the same stub, measured
              in the same run, interleaved with the job over --long-rounds rounds (medians). The job runs
              with its judge in a worker process (the default) and in the event loop (--judge-workers 0),
              so the two placements are compared too. Target: the job (default) >= 0.9x the bare client.
              Then the job's peak RSS over the two prompt counts of --long-memory (~6 KB answers).
              Target: the larger run costs <= 1.25x the memory.
The job runs as its real CLI in a subprocess; the stub runs in its own process. Results are printed;
with --strict the exit code is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # tests.helpers

from tests.helpers.stub_openai_server import spawn

PY = sys.executable


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def write_prompts(path: Path, n: int, pad: int = 0, start: int = 0) -> None:
    filler = "x" * pad
    with open(path, "w") as fh:
        for i in range(start, start + n):
            fh.write(
                json.dumps(
                    {
                        "id": f"b{i:08d}",
                        "conversations": [{"role": "user", "content": f"benchmark prompt {i} {filler}"}],
                    }
                )
                + "\n"
            )


def run_job(prompts: Path, out: Path, url: str, *extra: str) -> dict:
    """Run the job CLI; return its status document plus the child's CPU seconds and peak RSS."""
    args = [
        PY,
        "-m",
        "regen.jobs.generate",
        "--input",
        str(prompts),
        "--output-dir",
        str(out),
        "--endpoint",
        url,
        "--model",
        "bench",
        "--max-tokens",
        "64",
        "--no-progress",
        "--log-level",
        "warning",
        *extra,
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"job failed ({code}): {err[-2000:]}")
    doc = json.loads((out / "status.json").read_text())
    doc["cpu_s"] = usage.ru_utime + usage.ru_stime
    doc["maxrss_mb"] = usage.ru_maxrss / 1024
    doc["wall_s"] = wall
    return doc


class Stub:
    def __init__(self, *args: str):
        self.proc, self.url = spawn(["--tokens", "16", *args])

    def __enter__(self) -> Stub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(30)


# ------------------------------------------------------------------------------------------ throughput


_BARE_CLIENT = """
import asyncio, json, sys, time
import aiohttp
url, n, conc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
msgs = [{"role": "user", "content": "hi"}]
body = json.dumps({"model": "bench", "messages": msgs, "max_tokens": 64}).encode()
async def main():
    sem = asyncio.Semaphore(conc)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one():
            async with sem:
                async with s.post(url + "/v1/chat/completions", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    await r.read()
        t0 = time.perf_counter()
        await asyncio.gather(*[one() for _ in range(n)])
        return n / (time.perf_counter() - t0)
print(asyncio.run(main()))
"""


def machine_ceiling(url: str, n: int, conc: int) -> float:
    """Requests/s of a bare aiohttp loop (no input, no output, no retries) against the same stub: what this
    machine, with whatever else runs on it, allows any client to reach."""
    res = subprocess.run(
        [PY, "-c", _BARE_CLIENT, url, str(n), str(conc)], capture_output=True, text=True, check=True
    )
    return float(res.stdout.strip())


def bench_throughput(work: Path, quick: bool) -> tuple[bool, str]:
    conc, delay = 256, 0.2
    rounds = 15 if quick else 30
    n = conc * rounds
    prompts = work / "tp.jsonl"
    write_prompts(prompts, n)
    limit = conc / delay
    with Stub("--delay", str(delay)) as stub:
        doc = run_job(prompts, work / "tp-out", stub.url, "--concurrency", str(conc))
        ceiling = machine_ceiling(stub.url, n, conc)
    # From the first request to the last durable write, as the reference loop measures from its first
    # request; the rate over the job's whole life (ledger open, final fsync) is printed next to it.
    rate = doc["done"] / doc["generating_s"]
    whole = doc["done"] / doc["elapsed_s"]
    ratio = rate / limit
    ok = ratio >= 0.9
    return ok, (
        f"throughput  delay={delay * 1000:.0f}ms concurrency={conc}: {n} requests in "
        f"{doc['generating_s']:.2f}s = {rate:.0f} req/s (whole job {whole:.0f} req/s); "
        f"limit {limit:.0f} req/s; ratio {ratio:.3f} "
        f"(target >= 0.90) {'OK' if ok else 'MISSED'}\n"
        f"            reference: a bare aiohttp loop reaches {ceiling:.0f} req/s = {ceiling / limit:.3f} "
        f"of the limit on this machine now; the job is at {rate / ceiling:.2f} of that"
    )


# ------------------------------------------------------------------------------------------ overhead


def openai_baseline(url: str, prompts: Path, out: Path, threads: int) -> None:
    """The usual script: a thread pool of the official client, results appended under a lock."""
    import openai

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=3, timeout=600)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    lock = threading.Lock()
    with open(out, "w") as fh:

        def one(row: dict) -> None:
            resp = client.chat.completions.create(model="bench", messages=row["conversations"], max_tokens=64)
            rec = {
                "id": row["id"],
                "conversations": [
                    *row["conversations"],
                    {"role": "assistant", "content": resp.choices[0].message.content},
                ],
                "finish_reason": resp.choices[0].finish_reason,
                "usage": resp.usage.model_dump(),
            }
            line = json.dumps(rec, ensure_ascii=False) + "\n"
            with lock:
                fh.write(line)

        t0 = time.perf_counter()
        c0 = time.process_time()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, rows))
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - c0
    print(json.dumps({"elapsed_s": elapsed, "done": len(rows), "cpu_s": cpu}))


def bench_overhead(work: Path, quick: bool) -> tuple[bool, str]:
    n = 3000 if quick else 8000
    prompts = work / "ov.jsonl"
    write_prompts(prompts, n)
    one = work / "ov1.jsonl"
    write_prompts(one, 1, start=10**7)
    with Stub("--delay", "0") as stub:
        # fixed cost of a run (interpreter, imports, startup), subtracted to get the per-request CPU
        fixed = run_job(one, work / "ov1-out", stub.url, "--concurrency", "64")
        doc = run_job(prompts, work / "ov-out", stub.url, "--concurrency", "64")
        ours = doc["done"] / doc["generating_s"]
        cpu_ms = (doc["cpu_s"] - fixed["cpu_s"]) / (n - 1) * 1000
        proc = subprocess.Popen(
            [
                PY,
                __file__,
                "_openai_baseline",
                "--url",
                stub.url,
                "--input",
                str(prompts),
                "--out",
                str(work / "ov-openai.jsonl"),
                "--threads",
                "64",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        out, _ = proc.communicate()
        base = json.loads(out.strip().splitlines()[-1])
        base_rate = base["done"] / base["elapsed_s"]
        base_cpu_ms = base["cpu_s"] / base["done"] * 1000
    ratio = ours / base_rate
    ok = ratio >= 2.0
    return ok, (
        f"overhead    delay=0: regen {ours:.0f} req/s, client CPU {cpu_ms:.3f} ms/request (fsync'd, "
        f"exactly-once); openai client x64 threads {base_rate:.0f} req/s, {base_cpu_ms:.3f} ms/request; "
        f"ratio {ratio:.2f} (target >= 2.0) {'OK' if ok else 'MISSED'}"
    )


# ------------------------------------------------------------------------------------------ resume


_OPEN_PROBE = """
import json, resource, sys, time
from regen.jobs._ledger import ShardStore
import numpy  # imported before the measurement: the baseline includes the libraries
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
store = ShardStore(sys.argv[1], read_only=True)
store.open()
elapsed = time.perf_counter() - t0
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"open_s": elapsed, "ids": len(store.index), "rss_growth_mb": (after - before) / 1024}))
"""


def bench_resume(work: Path, quick: bool) -> tuple[bool, str]:
    from regen.jobs._ledger import ShardStore, id_digest

    n = 1_000_000
    out = work / "rs-out"
    t0 = time.perf_counter()
    store = ShardStore(out, fsync=False, shard_records=250_000)
    store.open()
    batch = []
    for i in range(n):
        rid = f"b{i:08d}"
        batch.append((0, id_digest(rid), b'{"id": "%s", "ok": 1}' % rid.encode()))
        if len(batch) == 50_000:
            store.append(batch)
            batch.clear()
    store.append(batch)
    store.close()
    build_s = time.perf_counter() - t0
    probe = json.loads(
        subprocess.run(
            [PY, "-c", _OPEN_PROBE, str(out)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        ).stdout
    )
    ok = probe["open_s"] <= 2.0 and probe["ids"] == n
    line = (
        f"resume      ledger of {n:,} finished ids (built in {build_s:.1f}s): open {probe['open_s']:.2f}s "
        f"(target <= 2.0s), memory +{probe['rss_growth_mb']:.0f} MB "
        f"({probe['rss_growth_mb'] * 2**20 / n:.0f} bytes/id) {'OK' if ok else 'MISSED'}"
    )
    if not quick:
        prompts = work / "rs.jsonl"
        write_prompts(prompts, n)
        with Stub("--delay", "0") as stub:
            doc = run_job(prompts, out, stub.url, "--concurrency", "64", "--allow-config-change")
        line += (
            f"\n            whole no-op run over {n:,} done prompts: {doc['wall_s']:.2f}s wall, "
            f"{doc['skipped']:,} skipped, {doc['requests']} requests, peak RSS {doc['maxrss_mb']:.0f} MB"
        )
        ok = ok and doc["requests"] == 0 and doc["skipped"] == n
    return ok, line


# ------------------------------------------------------------------------------------------ memory


def bench_memory(work: Path, quick: bool) -> tuple[bool, str]:
    small_n = 4000 if quick else 10000
    pad = 4096
    small, large = work / "mem-small.jsonl", work / "mem-large.jsonl"
    write_prompts(small, small_n, pad=pad)
    write_prompts(large, small_n * 5, pad=pad)
    with Stub("--delay", "0") as stub:
        a = run_job(small, work / "mem-small-out", stub.url, "--concurrency", "64")
        b = run_job(large, work / "mem-large-out", stub.url, "--concurrency", "64")
    size_a, size_b = small.stat().st_size / 2**20, large.stat().st_size / 2**20
    ratio = b["maxrss_mb"] / a["maxrss_mb"]
    ok = ratio <= 1.25
    return ok, (
        f"memory      prompt file {size_a:.0f} MB -> peak RSS {a['maxrss_mb']:.0f} MB; {size_b:.0f} MB -> "
        f"{b['maxrss_mb']:.0f} MB; ratio {ratio:.2f} for 5x the input (target <= 1.25) "
        f"{'OK' if ok else 'MISSED'}"
    )


# ------------------------------------------------------------------------------------------ long answers


_BARE_LONG_CLIENT = """
import asyncio, json, sys, time
import aiohttp
url, prompts, conc, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
rows = [json.loads(line) for line in open(prompts)]
async def main():
    sem = asyncio.Semaphore(conc)
    with open(out, "w") as fh:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def one(row):
                async with sem:
                    body = json.dumps({"model": "bench", "messages": row["conversations"],
                                       "max_tokens": 100000}).encode()
                    async with s.post(url + "/v1/chat/completions", data=body,
                                      headers={"Content-Type": "application/json"}) as r:
                        doc = json.loads(await r.read())
                    answer = doc["choices"][0]["message"]["content"]
                    fh.write(json.dumps({"id": row["id"], "conversations": [*row["conversations"],
                             {"role": "assistant", "content": answer}]}, ensure_ascii=False) + "\\n")
            t0 = time.perf_counter()
            await asyncio.gather(*[one(row) for row in rows])
            return len(rows) / (time.perf_counter() - t0)
print(asyncio.run(main()))
"""


def bare_long_client(url: str, prompts: Path, conc: int, out: Path) -> tuple[float, float]:
    """(requests/s, CPU seconds) of the bare client: the peer the long-answer case is measured against."""
    proc = subprocess.Popen(
        [PY, "-c", _BARE_LONG_CLIENT, url, str(prompts), str(conc), str(out)],
        stdout=subprocess.PIPE,
        text=True,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    out_text = proc.stdout.read() if proc.stdout else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit("the bare client failed")
    return float(out_text.strip()), usage.ru_utime + usage.ru_stime


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def bench_long(work: Path, quick: bool, opts: argparse.Namespace) -> tuple[bool, str]:
    conc, delay = 512, 0.2
    n = opts.long_prompts or (3000 if quick else 10000)
    rounds = opts.long_rounds or (1 if quick else 3)
    sizes = [int(x) for x in opts.long_sizes.split(",")]
    prompts = work / "long.jsonl"
    write_prompts(prompts, n)
    lines, ok = [], True
    for words in sizes:
        rates: dict[str, list[float]] = {"bare": [], "job": [], "inline": []}
        cpu: dict[str, list[float]] = {"bare": [], "job": [], "inline": []}
        unjudged: list[int] = []
        answer_kb = 0.0
        with Stub("--delay", str(delay), "--tokens", str(words)) as stub:
            for r in range(rounds):
                # the order turns each round, so a change in the machine's load hits every variant
                order = ["bare", "job", "inline"] if r % 2 == 0 else ["inline", "job", "bare"]
                for variant in order:
                    out = work / f"long-{words}-{variant}-{r}"
                    if variant == "bare":
                        rate, seconds = bare_long_client(stub.url, prompts, conc, out.with_suffix(".jsonl"))
                    else:
                        workers = "1" if variant == "job" else "0"
                        doc = run_job(
                            prompts,
                            out,
                            stub.url,
                            "--concurrency",
                            str(conc),
                            "--max-tokens",
                            "100000",
                            "--judge-workers",
                            workers,
                        )
                        rate, seconds = doc["done"] / doc["generating_s"], doc["cpu_s"]
                        if variant == "job":
                            unjudged.append(int((doc.get("degeneration") or {}).get("unjudged") or 0))
                        if not answer_kb:
                            records = sum(f.stat().st_size for f in out.rglob("completions*"))
                            answer_kb = records / doc["done"] / 1024
                        shutil.rmtree(out, ignore_errors=True)
                    rates[variant].append(rate)
                    cpu[variant].append(seconds)
        bare, job, inline = (_median(rates[k]) for k in ("bare", "job", "inline"))
        ratio = job / bare
        good = ratio >= 0.9
        ok = ok and good
        lines.append(
            f"long        {words} words (~{answer_kb:.0f} KB records), concurrency {conc}, delay "
            f"{delay * 1000:.0f}ms, {n} prompts x {rounds} round(s): bare client {bare:.0f} req/s "
            f"(CPU {_median(cpu['bare']):.1f}s); job {job:.0f} req/s (CPU {_median(cpu['job']):.1f}s, "
            f"judge in a worker, unjudged {max(unjudged) if unjudged else 0}); ratio {ratio:.2f} "
            f"(target >= 0.90) {'OK' if good else 'MISSED'}\n"
            f"            judge in the event loop (--judge-workers 0): {inline:.0f} req/s = "
            f"{inline / bare:.2f}x (CPU {_median(cpu['inline']):.1f}s)"
        )
    small_n, large_n = (
        int(x) for x in (opts.long_memory or ("2000,8000" if quick else "10000,160000")).split(",")
    )
    peaks = []
    with Stub("--delay", str(delay), "--tokens", str(sizes[0])) as stub:
        for count in (small_n, large_n):
            mem_prompts = work / f"long-mem-{count}.jsonl"
            write_prompts(mem_prompts, count)
            out = work / f"long-mem-{count}"
            doc = run_job(mem_prompts, out, stub.url, "--concurrency", str(conc), "--max-tokens", "100000")
            peaks.append(doc["maxrss_mb"])
            shutil.rmtree(out, ignore_errors=True)
            mem_prompts.unlink()
    growth = peaks[1] / peaks[0]
    good = growth <= 1.25
    ok = ok and good
    lines.append(
        f"            memory with {sizes[0]}-word answers: {small_n:,} prompts -> peak RSS "
        f"{peaks[0]:.0f} MB; {large_n:,} -> {peaks[1]:.0f} MB; ratio {growth:.2f} (target <= 1.25) "
        f"{'OK' if good else 'MISSED'}"
    )
    return ok, "\n".join(lines)


# ------------------------------------------------------------------------------------------ main

BENCHES = {
    "throughput": bench_throughput,
    "overhead": bench_overhead,
    "resume": bench_resume,
    "memory": bench_memory,
    "long": bench_long,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_openai_baseline":
        p = argparse.ArgumentParser()
        p.add_argument("--url")
        p.add_argument("--input", type=Path)
        p.add_argument("--out", type=Path)
        p.add_argument("--threads", type=int)
        a = p.parse_args(argv[1:])
        openai_baseline(a.url, a.input, a.out, a.threads)
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller runs (about a minute)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--only", default=",".join(BENCHES), help="comma-separated subset")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--long-prompts", type=int, help="long: prompts per run (default 10000; --quick 3000)")
    p.add_argument("--long-rounds", type=int, help="long: interleaved rounds, medians (default 3; --quick 1)")
    p.add_argument("--long-sizes", default="1500,6000", help="long: answer sizes in filler words (~4 B each)")
    p.add_argument(
        "--long-memory",
        help="long: the two prompt counts of the memory check (default 10000,160000; --quick 2000,8000)",
    )
    a = p.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 8192), hard), hard))
    print(f"bench_generate: {cores()} cores, python {sys.version.split()[0]}, stub on loopback")
    work = Path(tempfile.mkdtemp(prefix="regen-bench-generate-"))
    missed = []
    try:
        for name in a.only.split(","):
            bench = BENCHES[name.strip()]
            ok, line = bench(work, a.quick, a) if bench is bench_long else bench(work, a.quick)
            print(line, flush=True)
            if not ok:
                missed.append(name)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    if missed:
        print(f"targets missed: {', '.join(missed)}")
    return 1 if (missed and a.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
