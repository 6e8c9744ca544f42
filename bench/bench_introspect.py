"""Benchmark the introspection facts against limits and a peer measured in the same run.

  .venv/bin/python bench/bench_introspect.py [--repeat 3] [--json]

1. Config facts (model_config_info's logic) for the real Kimi K2.5 config and for the demo model:
   mean seconds, against a limit of 1 s ("well under a second").
2. Tokenizer facts for a Kimi-size vocabulary: a synthetic tokenizer directory is built at bench time from
   the demo model's tokenizer (same remote code, template and special-token layout) with 163,584 BPE ranks
   and 256 special ids above them (163,840 in all, as Kimi K2.x). On it, each in a fresh interpreter with
   transformers already imported (import time is the same for all three and not what is measured):
     - bare:    AutoTokenizer.from_pretrained(dir, trust_remote_code=True)   (the peer)
     - library: tokenizer_info's whole library path (load + raw-file cross-check + rendered sample)
     - raw:     tokenizer_info's raw-files path (no tokenizer library)
   Reported as ratios to bare; limits: library <= 2.5x bare, raw <= 1.5x bare.
Exit status 1 when a limit is exceeded.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The shared logic imports its siblings as Ansible does; the checkout's module_utils joins that package.
import ansible.module_utils

ansible.module_utils.__path__.append(str(ROOT / "module_utils"))
from ansible.module_utils.regen_config import read_model_dir

KIMI_BPE_RANKS = 163584
KIMI_SPECIAL_IDS = 256
CONFIG_LIMIT_S = 1.0
LIBRARY_RATIO_LIMIT = 2.5
RAW_RATIO_LIMIT = 1.5

CHILD = r"""
import json, os, sys, tempfile, time
os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="bench-hf-modules-")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import transformers  # imported before timing: the same fixed cost for every variant
import ansible.module_utils
ansible.module_utils.__path__.append(sys.argv[1])
from ansible.module_utils import regen_tokenizer
what, path = sys.argv[2], sys.argv[3]
start = time.perf_counter()
if what == "bare":
    tok = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    size = len(tok)
else:
    facts = regen_tokenizer.gather(path, mode="auto" if what == "library" else "raw_files")
    assert facts["loaded_with"] == ("library" if what == "library" else "raw_files"), facts["load"]
    size = facts["vocab"]["total"]
print(json.dumps({"seconds": time.perf_counter() - start, "vocab_total": size}))
"""


def _demo_model(work: Path) -> Path:
    from regen.demo.build import build

    out = work / "demo"
    build(out, cache_dir=ROOT / ".cache" / "demo-models")  # pre-trained once, then copied
    return out


def kimi_size_tokenizer(demo: Path, dest: Path) -> Path:
    """The demo tokenizer re-laid on 163,584 ranks: same code, template and special-token offsets."""
    dest.mkdir(parents=True)
    demo_config = json.loads((demo / "tokenizer_config.json").read_text())
    demo_ranks = sum(1 for line in (demo / "tiktoken.model").read_bytes().splitlines() if line.strip())
    shift = KIMI_BPE_RANKS - demo_ranks
    with open(dest / "tiktoken.model", "wb") as handle:
        tokens = [bytes([b]) for b in range(256)]
        seen = set(tokens)
        counter = 0
        while len(tokens) < KIMI_BPE_RANKS:
            # Deterministic distinct multi-byte tokens (2-7 bytes of printable ASCII), like merged BPE pieces.
            counter += 1
            value, piece = counter, bytearray()
            while value:
                value, digit = divmod(value, 94)
                piece.append(33 + digit)
            token = bytes(piece) + b"e"
            if token not in seen:
                seen.add(token)
                tokens.append(token)
        for rank, token in enumerate(tokens):
            handle.write(base64.b64encode(token) + b" %d\n" % rank)
    config = dict(demo_config)
    config["added_tokens_decoder"] = {
        str(int(k) + shift): v for k, v in demo_config["added_tokens_decoder"].items()
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenization_kimi.py", "chat_template.jinja"):
        shutil.copy(demo / name, dest / name)
    model_config = json.loads((demo / "config.json").read_text())
    model_config["text_config"]["vocab_size"] = KIMI_BPE_RANKS + KIMI_SPECIAL_IDS
    (dest / "config.json").write_text(json.dumps(model_config, indent=2))
    return dest


def _child(what: str, path: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT / "module_utils"), what, str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if result.returncode != 0:
        raise SystemExit(f"{what} run failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _time_config(path: Path, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        read_model_dir(str(path))
        samples.append(time.perf_counter() - start)
    return statistics.mean(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median/mean reported)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-introspect-") as tmp:
        work = Path(tmp)
        demo = _demo_model(work)
        results["config_seconds"] = {
            "kimi-k2.5": _time_config(
                ROOT / "tests" / "fixtures" / "configs" / "kimi-k2.5", args.repeat * 10
            ),
            "demo": _time_config(demo, args.repeat * 10),
        }
        tok_dir = kimi_size_tokenizer(demo, work / "kimi-size-tokenizer")
        runs = {
            what: [_child(what, tok_dir) for _ in range(args.repeat)] for what in ("bare", "library", "raw")
        }
    seconds = {what: statistics.median(r["seconds"] for r in rs) for what, rs in runs.items()}
    sizes = {what: rs[0]["vocab_total"] for what, rs in runs.items()}
    results["tokenizer_seconds"] = seconds
    results["vocab_total"] = sizes
    results["ratio_to_bare"] = {
        "library": seconds["library"] / seconds["bare"],
        "raw": seconds["raw"] / seconds["bare"],
    }
    checks = {
        f"config facts < {CONFIG_LIMIT_S:.1f} s": max(results["config_seconds"].values()) < CONFIG_LIMIT_S,
        f"library path <= {LIBRARY_RATIO_LIMIT:.1f}x bare load": results["ratio_to_bare"]["library"]
        <= LIBRARY_RATIO_LIMIT,
        f"raw path <= {RAW_RATIO_LIMIT:.1f}x bare load": results["ratio_to_bare"]["raw"] <= RAW_RATIO_LIMIT,
        f"both paths see {KIMI_BPE_RANKS + KIMI_SPECIAL_IDS} ids": (
            sizes["library"] == sizes["raw"] == KIMI_BPE_RANKS + KIMI_SPECIAL_IDS
        ),
    }
    results["checks"] = checks
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for name, value in results["config_seconds"].items():
            print(f"config facts {name:<10} {value * 1000:8.2f} ms   (limit {CONFIG_LIMIT_S:.1f} s)")
        print(f"tokenizer, {KIMI_BPE_RANKS} ranks + {KIMI_SPECIAL_IDS} specials (median of {args.repeat}):")
        for what in ("bare", "library", "raw"):
            ratio = seconds[what] / seconds["bare"]
            print(f"  {what:<8} {seconds[what]:7.3f} s   {ratio:5.2f}x bare AutoTokenizer load")
        for name, ok in checks.items():
            print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
