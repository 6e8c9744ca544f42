#!/usr/bin/env bash
# GPU smoke test of the train stage: real SpecForge 0.2.0 DFlash training steps on the demo model, on an
# NVIDIA GPU; prints optimizer steps/s and peak GPU memory.
#
#   bench/gpu_train_smoke.sh download [WHEELS]   # on a machine with PyPI: fetch the wheels (~25 MiB)
#   bench/gpu_train_smoke.sh run [WHEELS]        # on the GPU machine (offline is fine)
#
# `run` builds the training venv from those wheels (pip --no-index), layered on the machine's own CUDA
# torch (--system-site-packages: SpecForge pins torch 2.11.0, which GPU images ship), builds the demo
# model, tokenizes a few dozen demo chats, captures the hidden states on the GPU (regen.training.capture,
# hf backend), and runs STEPS optimizer steps through SpecForge's own trainer in-process. Then it evaluates
# a drafter on the same device with regen's reference decoder (`regen.jobs.evaluate --device`): acceptance
# length and tokens/s of speculative against plain greedy decoding, every output checked against greedy.
# Knobs (env): STEPS (default 20), SAMPLES (64), SEQ (512 tokens), ATTN (flex_attention), PYTHON (python3),
# MODEL (a model directory instead of the demo). EVAL=0 skips the evaluation; EVAL_CHECKPOINT (an exported
# drafter, e.g. the demo pipeline's `.work/drafter/runs/<run>/export`, with MODEL its target) and
# EVAL_PROMPTS (default: the built-in demo prompts) evaluate a drafter of your own instead of the one this
# run just trained (20 steps on random text: its acceptance stays near 1); EVAL_ARGS adds evaluate flags.
# REPORT_DIR receives the training log and the evaluation report. TRAIN_PYTHON=<python with SpecForge>
# skips building the venv, and DEVICE=cpu (with ATTN=sdpa) dry-runs the whole script on a machine without a
# GPU: that checks the script, it measures nothing worth reporting.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
wheels=${2:-.cache/gpu-train-wheels}
# shellcheck source=bench/gpu_venv.sh
. bench/gpu_venv.sh

if [ "$mode" = download ]; then
  gpu_wheels_download "$wheels"
  exit 0
fi

device=${DEVICE:-cuda}
gpu_check_device gpu_train_smoke "$device"
work=$(mktemp -d /tmp/regen-gpu-smoke.XXXXXX)
trap '[ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
py=$(gpu_train_python "$wheels")
export PYTHONPATH=$PWD/src
model=${MODEL:-$work/model}
[ -n "${MODEL:-}" ] || "$py" -m regen.demo.build --output "$model" --cache-dir "$PWD/.cache/demo-models" >/dev/null

# FSDP needs an accelerator: the CPU dry run trains under DDP (NO_SHARD), as the role does on CPU hosts.
sharding=$([ "$device" = cuda ] && echo SHARD_GRAD_OP || echo NO_SHARD)
"$py" - "$model" "$work" "${SAMPLES:-64}" "${SEQ:-512}" "${STEPS:-20}" "${ATTN:-flex_attention}" "$sharding" <<'EOF'
import json, random, sys
from pathlib import Path
try:  # the shared logic imports its siblings as ansible.module_utils.*, as Ansible runs it
    import ansible.module_utils
    ansible.module_utils.__path__.append("module_utils")
except ImportError:  # a GPU venv without ansible-core: the checkout's module_utils alone, as that package
    import types
    sys.modules["ansible"] = types.ModuleType("ansible")
    sys.modules["ansible.module_utils"] = mu = types.ModuleType("ansible.module_utils")
    mu.__path__ = ["module_utils"]
from ansible.module_utils import regen_config, regen_drafter as d
import yaml
from transformers import AutoTokenizer

model, work, samples, seq, steps, attn, sharding = (sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:6]),
                                                    sys.argv[6], sys.argv[7])
tok = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
words = Path("src/regen/demo/corpus.txt").read_text().split()
rng = random.Random(0)
(work / "tok").mkdir()
with open(work / "tok" / "part-00000.jsonl", "w") as out:
    for _ in range(samples):
        ids = tok.encode(" ".join(rng.choices(words, k=seq)), add_special_tokens=False)[:seq]
        half = len(ids) // 4
        out.write(json.dumps({"input_ids": ids, "loss_mask": [0] * half + [1] * (len(ids) - half)}) + "\n")
config = json.loads(Path(model, "config.json").read_text())
arch = regen_config.normalize_config(config)
n = max(1, min(5, arch["num_layers"] - 3))
mask = len(tok) - 1 if len(tok) <= arch["vocab_size"] else arch["vocab_size"] - 1
draft, _, _ = d.draft_config({"architecture": arch}, config, num_draft_layers=n, mask_token_id=mask)
(work / "draft.json").write_text(json.dumps(draft))
emb, head = d.embedding_and_head_keys(d.weight_keys(model))
run = d.specforge_run_config(
    model_path=model, draft_config_path=str(work / "draft.json"), embedding_key=emb, lm_head_key=head,
    mask_token_id=mask, mode="offline", run_id="gpu-smoke", output_dir=str(work / "out"), cache_dir=str(work / "cache"),
    topology={"nnodes": 1, "nproc_per_node": 1}, master_addr="127.0.0.1", hidden_states_path=str(work / "hs"),
    max_length=seq, training={"max_steps": steps, "batch_size": 1, "learning_rate": 6e-4, "attention_backend": attn,
                              "log_interval": 1, "save_interval": steps, "num_anchors": 64,
                              "fsdp_sharding": sharding})
(work / "run.yaml").write_text(yaml.safe_dump(run, sort_keys=False))
print("layers", draft["dflash_config"]["target_layer_ids"], "of", arch["num_layers"])
EOF

layers=$("$py" -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['dflash_config']['target_layer_ids'])))" "$work/draft.json")
"$py" -m regen.training.capture --backend hf --device "$device" --data "$work/tok" --model "$model" \
  --layers "$layers" --output "$work/hs" --max-length "${SEQ:-512}"

"$py" - "$work/run.yaml" <<'EOF' 2>&1 | tee "$work/train.log" | grep -E '^(step [0-9]+:|SMOKE)' | cut -c1-160
import json, sys, time
import torch
from specforge.cli import main

gpu = torch.cuda.is_available()
if gpu:
    torch.cuda.reset_peak_memory_stats()
started = time.monotonic()
code = main(["train", "--config", sys.argv[1]])
print("SMOKE", json.dumps({"exit": code, "wall_s": round(time.monotonic() - started, 1),
                           "peak_gpu_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if gpu else None,
                           "gpu": torch.cuda.get_device_name() if gpu else "cpu (dry run)"}))
EOF

"$py" - "$work/train.log" <<'EOF'
import json, statistics, sys
from regen.training.status import parse_step_line

lines = open(sys.argv[1]).read().splitlines()
times = [m["perf/optimizer_step_time_s"] for s, m in filter(None, map(parse_step_line, lines))
         if "perf/optimizer_step_time_s" in m]
smoke = json.loads(next(l for l in lines if l.startswith("SMOKE "))[6:])
steady = times[2:] or times  # the first steps compile kernels (flex_attention)
print(f"gpu_train_smoke: {len(times)} DFlash steps on {smoke['gpu']}: "
      f"{1 / statistics.mean(steady):.2f} steps/s steady (mean of {len(steady)}), "
      f"peak GPU memory {smoke['peak_gpu_mib']} MiB, wall {smoke['wall_s']} s, exit {smoke['exit']}")
sys.exit(0 if smoke["exit"] == 0 and times else 1)
EOF
[ -z "${REPORT_DIR:-}" ] || { mkdir -p "$REPORT_DIR"; cp "$work/train.log" "$REPORT_DIR/train.log"; }

[ "${EVAL:-1}" != 0 ] || exit 0
specforge() { "$py" -c 'import sys; from specforge.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
checkpoint=${EVAL_CHECKPOINT:-}
if [ -z "$checkpoint" ]; then
  # The drafter this run trained, exported as the train stage exports it (SpecForge's HF layout).
  latest=$("$py" -m regen.training.checkpoints --output-dir "$work/out" --run-id gpu-smoke |
           "$py" -c 'import json, sys; print(json.load(sys.stdin)["latest"]["path"])')
  specforge export --to hf --checkpoint "$latest" --draft-config "$work/draft.json" \
    --output-dir "$work/export" >/dev/null
  checkpoint=$work/export
fi
# EVAL_ARGS carries several flags: its word splitting is wanted.
# shellcheck disable=SC2086
"$py" -m regen.jobs.evaluate --target-model "$model" --checkpoint "$checkpoint" \
  --prompts "${EVAL_PROMPTS:-src/regen/data/demo_prompts.jsonl}" --output-dir "$work/eval" \
  --device "$device" --training-steps 0 ${EVAL_ARGS:-} >"$work/eval.out" 2>"$work/eval.log" ||
  { tail -20 "$work/eval.log" >&2; exit 1; }
[ -z "${REPORT_DIR:-}" ] || cp "$work/eval/report.json" "$work/eval/report.md" "$work/eval/results.jsonl" "$REPORT_DIR/"
"$py" - "$work/eval/report.json" <<'EOF'
import json, sys

from regen.evaluate.report import headline

report = json.load(open(sys.argv[1]))
speedup = report.get("speedup") or {}
print(f"gpu_train_smoke: evaluation on {report['settings']['device']}: {headline(report)}; plain "
      f"{speedup.get('plain_tokens_per_s')} tokens/s, speculative {speedup.get('spec_tokens_per_s')} tokens/s")
sys.exit(0 if report["lossless"] else 1)
EOF
