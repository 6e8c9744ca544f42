"""Benchmark batched hidden-state capture against its peer: the same job capturing one sample per forward.

    python bench/bench_capture.py [--samples N] [--batch-tokens 16384] [--min-ratio 1.0] [--model DIR]
        [--device cuda]

Measured in one run, on the demo target (or --model), through `python -m regen.training.capture`'s own
`main` in this process, on the same tokenized samples (demo-corpus chats of 32 to 512 tokens):
- peer: `--batch-tokens 0`, one forward per sample (what the capture did before batching);
- batched: samples grouped by length into forwards of at most --batch-tokens padded tokens.
Reports tokens/s of each over its wall time (each loads the model once, the same cost for both), the ratio,
the forwards each needed, and checks the two feature sets agree. SpecForge's own `prepare_hidden_states.py` is
not a peer here: the SpecForge 0.2.0 wheel ships no `scripts/` directory, and the script needs a GPU build
of SGLang. Fails (exit 1) when batched capture is slower than --min-ratio x the peer.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def demo_model() -> Path:
    from regen.demo.build import build, inputs_digest
    from regen.demo.spec import DemoSpec

    spec = DemoSpec()
    out = ROOT / ".cache" / "demo-models" / inputs_digest(spec)[:16] / "regen-demo-kimi"
    build(out, spec)
    return out


def tokenized(path: Path, n: int, vocab: int, seed: int = 0) -> int:
    """n samples of 32..512 tokens (supervised second half) as the tokenize stage's Parquet; total tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    ids, masks = [], []
    for _ in range(n):
        length = rng.randint(32, 512)
        ids.append([rng.randrange(1, min(vocab, 3840)) for _ in range(length)])
        masks.append([0] * (length // 2) + [1] * (length - length // 2))
    (path / "data").mkdir(parents=True)
    pq.write_table(pa.table({"input_ids": ids, "loss_mask": masks}), path / "data" / "part-00000.parquet")
    return sum(len(x) for x in ids)


def timed_capture(argv: list[str]) -> tuple[dict, float]:
    from regen.training import capture

    out = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = capture.main(argv)
    seconds = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"capture failed: {out.getvalue()}")
    return json.loads(out.getvalue().strip().splitlines()[-1]), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--min-ratio", type=float, default=1.0)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the GPU smoke script passes cuda)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = args.model or demo_model()
    config = json.loads((model / "config.json").read_text())
    text = config.get("text_config", config)
    layers = ",".join(str(i) for i in range(1, min(3, text["num_hidden_layers"])))
    with tempfile.TemporaryDirectory(prefix="regen-bench-capture-") as tmp:
        work = Path(tmp)
        total = tokenized(work / "tok", args.samples, text["vocab_size"])
        base = ["--data", str(work / "tok"), "--model", str(model), "--layers", layers]
        base += ["--device", args.device]
        # Warm-up: load the model once so neither run pays for the first import and page-in.
        timed_capture([*base, "--output", str(work / "warm"), "--max-samples", "2"])
        one, one_s = timed_capture([*base, "--output", str(work / "one"), "--batch-tokens", "0"])
        batched, batched_s = timed_capture(
            [*base, "--output", str(work / "batched"), "--batch-tokens", str(args.batch_tokens)]
        )
        worst = 0.0
        for path in sorted((work / "one").glob("*.ckpt")):
            a = torch.load(path, weights_only=True)["hidden_states"].float()
            b = torch.load(work / "batched" / path.name, weights_only=True)["hidden_states"].float()
            worst = max(worst, (a - b).abs().max().item())
    one_rate, batched_rate = total / one_s, total / batched_s
    ratio = batched_rate / one_rate
    print(
        json.dumps(
            {
                "device": args.device,
                "samples": args.samples,
                "tokens": total,
                "one_per_forward": {"forwards": one["forwards"], "seconds": round(one_s, 2),
                                    "tokens_per_s": round(one_rate, 1)},
                "batched": {"batch_tokens": args.batch_tokens, "forwards": batched["forwards"],
                            "seconds": round(batched_s, 2), "tokens_per_s": round(batched_rate, 1)},
                "ratio": round(ratio, 2),
                "max_abs_difference": worst,
                "specforge_prepare_hidden_states": "not run: SpecForge 0.2.0's wheel ships no scripts/",
            },
            indent=2,
        )
    )
    print(f"batched capture: {ratio:.2f}x the one-sample-per-forward peer (limit {args.min_ratio:.2f}x)")
    return 0 if ratio >= args.min_ratio else 1


if __name__ == "__main__":
    raise SystemExit(main())
