"""Benchmark the evaluate stage's CPU reference decoder against plain greedy decoding of the same target.

    python bench/bench_evaluate.py [--prompts N] [--max-new-tokens N] [--min-oracle-speedup 1.5] [--model DIR]

Measured in one run on the demo model (unless --model), greedy, concurrency 1, the same prompts:
- plain: `greedy_decode`, one cached target forward per token (the peer);
- oracle: `speculative_decode` with the target's own continuation as drafts, so every block of 16 is
  accepted: tokens/s against plain is what the loop's bookkeeping (block assembly, verification, cache
  crops, context features) leaves of a 16x cut in target forwards;
- reject-all: drafts that are never right (the mask token), so each step commits one token at the price of
  a 16-token verification: the reference decoder's worst-case overhead per token against plain.
Drafter compute is excluded on purpose (no SpecForge needed): the figures isolate the harness itself.
Every speculative output is checked against plain greedy decoding. Fails (exit 1) when the oracle run is
not at least --min-oracle-speedup x plain, or when an output differs.
"""

from __future__ import annotations

import argparse
import json
import sys
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


class RejectAll:
    """Proposes the mask token everywhere: nothing is accepted (the overhead probe)."""

    def __init__(self, block_size: int, mask: int):
        self.block_size, self.mask = block_size, mask

    def reset(self) -> None:
        pass

    def propose(self, block, context, start):
        import torch

        return torch.full((self.block_size - 1,), self.mask, dtype=torch.long)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--mask-token-id", type=int, default=3845)
    ap.add_argument("--min-oracle-speedup", type=float, default=1.5)
    args = ap.parse_args()

    from regen.evaluate import reference as ref

    target = ref.Target.load(args.model or demo_model())
    layers = [target.num_layers // 2]
    prompts = [[3840, *range(100 + 37 * i, 140 + 37 * i)] for i in range(args.prompts)]
    ref.greedy_decode(target, prompts[0], 4)  # warm-up
    totals = {"plain": [0, 0.0], "oracle": [0, 0.0], "reject_all": [0, 0.0]}
    lossless = True
    for prompt in prompts:
        plain = ref.greedy_decode(target, prompt, args.max_new_tokens)
        cont = prompt + ref.greedy_decode(target, prompt, args.max_new_tokens + args.block_size).tokens
        runs = {
            "oracle": ref.OracleProposer(cont, args.block_size),
            "reject_all": RejectAll(args.block_size, args.mask_token_id),
        }
        totals["plain"][0] += len(plain.tokens)
        totals["plain"][1] += plain.seconds
        for name, proposer in runs.items():
            began = time.perf_counter()
            spec = ref.speculative_decode(
                target, proposer, prompt, block_size=args.block_size, mask_token_id=args.mask_token_id,
                layer_ids=layers, max_new=args.max_new_tokens,
            )  # fmt: skip
            totals[name][0] += len(spec.tokens)
            totals[name][1] += time.perf_counter() - began
            lossless &= spec.tokens == plain.tokens
    rate = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    result = {
        "tokens_per_s": {k: round(v, 1) for k, v in rate.items()},
        "oracle_speedup": round(rate["oracle"] / rate["plain"], 3),
        "reject_all_slowdown": round(rate["plain"] / rate["reject_all"], 3),
        "lossless": lossless,
        "min_oracle_speedup": args.min_oracle_speedup,
    }
    print(json.dumps(result, indent=1))
    ok = lossless and result["oracle_speedup"] >= args.min_oracle_speedup
    print(
        "ok"
        if ok
        else "FAIL: the reference decoder's overhead eats the speculative win, or an output differed"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
