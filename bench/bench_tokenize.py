"""Benchmark the tokenize job against its peer: the same tokenizer's bare batch encode of the same texts.

    python bench/bench_tokenize.py [--conversations N] [--min-ratio 0.8] [--workers 1,2,...] [--model DIR]

Measured in one run, on the demo model's tokenizer (Kimi-style tiktoken, trust_remote_code) unless --model:
- peer: `tokenizer(texts)` on the exact texts the job renders (chat template applied, reasoning placed),
  tokens/s of that call alone -- no JSON, no template, no masks, no files;
- the whole job (`python -m regen.jobs.tokenize` in a fresh process: read JSONL, check rows, render twice per
  conversation, encode, build masks, write Parquet/JSONL/stats/PNG), tokens/s over its wall time, for each
  --workers value (default 1 up to the cores present) -- the scaling;
- peak resident memory of the job's driver and of its largest worker.
Fails (exit 1) when the one-process job is slower than --min-ratio x the peer, or when the job's memory
grows with the input (a run on twice the conversations must stay within 1.5x the peak RSS).

Then the production-length case (issue 29): --production-samples conversations of 2k-8k tokens each
(--production-tokens), the size of a thinking model's completions (CT200 regenerates 100,000 of them; the
count here is scaled down so the case runs on a small machine, the per-sample cost is what is compared):
- peer: a bare loop of `tokenizer.apply_chat_template(messages, tokenize=True)` over the same records,
  one process -- samples/s;
- the whole job, samples/s over its wall time, for each --workers value, and its ratio to the peer.
Fails when the one-process job is below --min-ratio x that loop. --production-samples 0 skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def demo_model() -> Path:
    from regen.demo.build import build, cache_entry
    from regen.demo.spec import DemoSpec

    spec = DemoSpec()
    out = cache_entry(ROOT / ".cache" / "demo-models", spec)  # the pipeline's and the tests' cache
    build(out, spec)
    return out


def write_completions(path: Path, n: int, seed: int = 0) -> None:
    """Conversations shaped like thinking-model completions: a prompt, a long reasoning, an answer."""
    from regen.demo.bpe import corpus_text

    words = corpus_text().split()
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        start = rng.randrange(len(words) - hi)
        return " ".join(words[start : start + rng.randint(lo, hi)])

    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            turns = [{"role": "system", "content": "You are a helpful assistant."}]
            for _ in range(rng.choice((1, 1, 1, 2))):
                turns += [
                    {"role": "user", "content": text(20, 120)},
                    {"role": "assistant", "content": text(80, 400), "reasoning_content": text(150, 900)},
                ]
            fh.write(json.dumps({"id": f"b{i}", "conversations": turns, "finish_reason": "stop"}) + "\n")


def write_long_completions(path: Path, n: int, lo: int, hi: int, tok, seed: int = 2) -> None:
    """Conversations of lo..hi tokens each (the tokenizer's count of the rendered texts, to within a few
    percent): a short prompt, a long reasoning and a long answer, as a thinking model writes them."""
    from regen.demo.bpe import corpus_text

    words = corpus_text().split()
    sample = " ".join(words[:2000])
    tokens_per_word = len(tok(sample, add_special_tokens=False)["input_ids"]) / 2000
    rng = random.Random(seed)

    def text(count: int) -> str:
        count = max(1, min(count, len(words) - 1))
        start = rng.randrange(len(words) - count)
        return " ".join(words[start : start + count])

    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            total_words = int(rng.randint(lo, hi) / tokens_per_word)
            prompt = text(min(200, total_words // 10))
            reasoning = text(total_words * 6 // 10)
            answer = text(total_words * 3 // 10)
            turns = [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": answer, "reasoning_content": reasoning},
            ]
            fh.write(json.dumps({"id": f"L{i}", "conversations": turns, "finish_reason": "stop"}) + "\n")


def template_loop_peer(model: Path, completions: Path) -> dict:
    """samples/s of a bare `apply_chat_template(..., tokenize=True)` loop over the records, one process."""
    from regen.jobs.tokenize import load_tokenizer

    tok = load_tokenizer(str(model))
    records = [json.loads(line) for line in completions.read_text(encoding="utf-8").splitlines()]
    tokens = 0
    # the reasoning inline in the answer, as the job renders it: the loop tokenizes as much text as the job
    conversations = [
        [
            {"role": m["role"], "content": f"<think>{m['reasoning_content']}</think>{m['content']}"}
            if m.get("reasoning_content")
            else {"role": m["role"], "content": m["content"]}
            for m in record["conversations"]
        ]
        for record in records
    ]
    t0, c0 = time.perf_counter(), time.process_time()
    for messages in conversations:
        ids = tok.apply_chat_template(messages, tokenize=True)
        tokens += len(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in newer releases
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "samples": len(records),
        "tokens": tokens,
        "seconds": wall,
        "samples_per_s": len(records) / wall,
        "cpu_samples_per_s": len(records) / cpu,
    }


def production_case(model: Path, tmpdir: Path, args, cores_list: list[int]) -> bool:
    from regen.jobs.tokenize import load_tokenizer

    lo, hi = (int(x) for x in args.production_tokens.split(","))
    completions = tmpdir / "production.jsonl"
    write_long_completions(completions, args.production_samples, lo, hi, load_tokenizer(str(model)))
    reference = template_loop_peer(model, completions)
    print(
        f"production lengths: {reference['samples']} conversations of {lo:,}-{hi:,} tokens "
        f"({reference['tokens'] / reference['samples']:,.0f} per conversation on average)"
    )
    print(
        f"peer   apply_chat_template loop     {reference['samples_per_s']:>10,.1f} samples/s "
        f"({reference['seconds']:.2f} s; {reference['cpu_samples_per_s']:,.1f} per CPU-second)"
    )
    runs = {}
    for workers in cores_list:
        r = job(model, completions, workers, tmpdir / f"prod-{workers}")
        runs[workers] = r
        # per sample over the job's own clock (a run of 100,000 samples pays its start-up once)
        rate = r["samples"] / r["job_elapsed_s"]
        first = runs[min(runs)]
        print(
            f"job    --workers {workers:<2}               {rate:>10,.1f} samples/s "
            f"({r['job_elapsed_s']:.2f} s of work, {r['wall']:.2f} s with start-up)  "
            f"x{rate / reference['samples_per_s']:.2f} of the loop, {r['tokens'] / r['samples']:,.0f} tokens "
            f"per sample, "
            f"scaling x{rate / (first['samples'] / first['job_elapsed_s']):.2f}"
        )
    if 1 not in runs:
        return True
    ratio = (runs[1]["samples"] / runs[1]["job_elapsed_s"]) / reference["samples_per_s"]
    ok = ratio >= args.min_ratio
    print(
        f"{'ok' if ok else 'FAIL'}: one-process job at production lengths = {ratio:.2f} x the "
        f"apply_chat_template loop (limit {args.min_ratio})"
    )
    return ok


def peer(model: Path, completions: Path, repeats: int) -> dict:
    """tokens/s of `tokenizer(texts)` on the texts the job renders."""
    from regen.jobs._common import decode_json_line
    from regen.tokenization.conversation import conversation_from_record
    from regen.tokenization.loader import load_tokenizer
    from regen.tokenization.render import ChatRenderer

    tok = load_tokenizer(str(model))
    renderer = ChatRenderer(tok)
    texts = []
    with open(completions, "rb") as fh:
        for i, line in enumerate(fh):
            record, _ = decode_json_line(line.rstrip(b"\n"))
            texts.append(renderer.render(conversation_from_record(record, str(i))).text)
    best = cpu = float("inf")
    tokens = 0
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = tok(texts)
        best, cpu = min(best, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
        tokens = sum(len(ids) for ids in out["input_ids"])
    return {
        "tokens": tokens,
        "seconds": best,
        "tokens_per_s": tokens / best,
        "cpu_tokens_per_s": tokens / cpu,
    }


def job(model: Path, completions: Path, workers: int, out: Path, repeats: int = 1) -> dict:
    """The whole job in a fresh process (its imports and memory are its own); the best of `repeats` runs."""
    runs = [_job_once(model, completions, workers, out.with_name(f"{out.name}-{i}")) for i in range(repeats)]
    return min(runs, key=lambda r: r["wall"])


def _job_once(model: Path, completions: Path, workers: int, out: Path) -> dict:
    child = (
        "import json, resource, sys, time\n"
        "from regen.jobs.tokenize import main\n"
        "t0 = time.perf_counter()\n"
        "rc = main(sys.argv[1:])\n"
        "wall = time.perf_counter() - t0\n"
        "me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(json.dumps({'rc': rc, 'wall': wall,\n"
        "  'cpu': me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,\n"
        "  'rss_driver_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,\n"
        "  'rss_worker_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))\n"
    )
    argv = [
        "--input",
        str(completions),
        "--output-dir",
        str(out),
        "--tokenizer",
        str(model),
        "--workers",
        str(workers),
        "--shard-size",
        "250",
        "--max-length",
        "0",
        "--no-progress",
        "--json",
        "--log-level",
        "warning",
    ]
    result = subprocess.run([sys.executable, "-c", child, *argv], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"the job failed:\n{result.stderr[-3000:]}")
    lines = result.stdout.strip().splitlines()
    summary, measured = json.loads(lines[-2]), json.loads(lines[-1])
    return {
        **measured,
        "tokens": summary["tokens"],
        "samples": summary["samples"],
        "job_elapsed_s": summary["elapsed_s"],  # the job's own clock: from its start to the end of its work
        "tokens_per_s": summary["tokens"] / measured["wall"],
        "cpu_tokens_per_s": summary["tokens"] / measured["cpu"],
    }


def main() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=3000)
    p.add_argument(
        "--min-ratio", type=float, default=0.8, help="job/peer tokens-per-second floor, one process"
    )
    p.add_argument("--workers", default=",".join(str(w) for w in sorted({1, *range(2, cores + 1)})))
    p.add_argument("--repeats", type=int, default=2, help="peer repeats (best of)")
    p.add_argument("--model", type=Path, help="model directory (default: the demo model, built if needed)")
    p.add_argument(
        "--production-samples",
        type=int,
        default=300,
        help="conversations in the production-length case (0: skip it; CT200's run has 100,000)",
    )
    p.add_argument("--production-tokens", default="2000,8000", help="tokens per conversation, LO,HI")
    p.add_argument("--skip-short", action="store_true", help="only the production-length case")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = args.model or demo_model()
    worker_counts = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        tmpdir = Path(tmp)
        prod_ok = True
        if args.production_samples:
            prod_ok = production_case(model, tmpdir, args, worker_counts)
        if args.skip_short:
            return 0 if prod_ok else 1
        completions = tmpdir / "completions.jsonl"
        write_completions(completions, args.conversations)
        reference = peer(model, completions, args.repeats)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(
            f"model {model.name}, {args.conversations} conversations, {reference['tokens']} tokens, "
            f"{cores} cores "
            f"(load average {load:.1f}: wall-clock rates and scaling are only meaningful on an idle machine)"
        )
        print(
            f"peer   tokenizer(texts)            {reference['tokens_per_s']:>12,.0f} tokens/s "
            f"({reference['seconds']:.2f} s; {reference['cpu_tokens_per_s']:,.0f} per CPU-second)"
        )
        runs = {}
        for workers in (int(w) for w in args.workers.split(",")):
            r = job(model, completions, workers, tmpdir / f"out-{workers}", repeats=2 if workers == 1 else 1)
            runs[workers] = r
            assert r["tokens"] == reference["tokens"], (
                r["tokens"],
                reference["tokens"],
            )  # same texts, same ids
            scale = r["tokens_per_s"] / runs[min(runs)]["tokens_per_s"]
            print(
                f"job    --workers {workers:<2}               {r['tokens_per_s']:>12,.0f} tokens/s "
                f"({r['wall']:.2f} s; {r['cpu_tokens_per_s']:,.0f} per CPU-second)  "
                f"x{r['tokens_per_s'] / reference['tokens_per_s']:.2f} of peer, "
                f"scaling x{scale:.2f} ({scale / workers:.0%} of linear)  "
                f"peak RSS driver {r['rss_driver_mb']:.0f} MB, worker {r['rss_worker_mb']:.0f} MB"
            )
        # Bounded memory: twice the input must not mean (much) more memory.
        big = tmpdir / "completions-2x.jsonl"
        write_completions(big, 2 * args.conversations, seed=1)
        doubled = job(model, big, 1, tmpdir / "out-2x")
        print(
            f"memory: peak RSS {runs[1]['rss_driver_mb']:.0f} MB for {args.conversations} conversations, "
            f"{doubled['rss_driver_mb']:.0f} MB for {2 * args.conversations}"
        )
    ratio = runs[1]["tokens_per_s"] / reference["tokens_per_s"] if 1 in runs else None
    ok = True
    if ratio is not None:
        verdict = "ok" if ratio >= args.min_ratio else "FAIL"
        ok &= ratio >= args.min_ratio
        print(f"{verdict}: one-process job = {ratio:.2f} x peer (limit {args.min_ratio})")
    grew = doubled["rss_driver_mb"] / runs[1]["rss_driver_mb"] if 1 in runs else 1.0
    ok &= grew <= 1.5
    print(f"{'ok' if grew <= 1.5 else 'FAIL'}: memory x{grew:.2f} for twice the input (limit 1.5)")
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"(peak RSS of this benchmark process: {own:.0f} MB)")
    return 0 if (ok and prod_ok) else 1


if __name__ == "__main__":
    sys.exit(main())
