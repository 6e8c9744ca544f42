#!/usr/bin/env bash
# One device session: real nvidia-smi outputs, the GPU smoke (capture + SpecForge DFlash steps + evaluation
# of the demo pipeline's trained drafter on its held-out prompts, the role's settings), batched capture bench.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
{ nvidia-smi; echo "=== nvidia-smi -q"; nvidia-smi -q; echo "=== topo"; nvidia-smi topo -m; } >"$OUT/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total,driver_version,compute_cap,pstate,power.limit \
  --format=csv >"$OUT/nvidia-smi-query.csv" 2>&1
python3 -c 'import torch, sys; print(sys.version, torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
export MODEL=$PWD/.device/model EVAL_CHECKPOINT=$PWD/.device/drafter EVAL_PROMPTS=$PWD/.device/prompts REPORT_DIR=$OUT
export EVAL_ARGS='--max-prompts 18 --max-new-tokens 32 --prompt-max-tokens 239 --chat-template-kwargs {"thinking":false} --thinking-switch thinking --turn-kinds non-thinking,thinking'
SECONDS=0
timeout 330 bench/gpu_train_smoke.sh run .device/wheels 2>&1 | grep -v -E 'Loading weights|Writing model' | tee "$OUT/smoke.log"
echo "smoke rc ${PIPESTATUS[0]} after ${SECONDS}s"
py=.cache/gpu-train-venv/bin/python
if ! grep -q "evaluation on cuda" "$OUT/smoke.log" && [ -x "$py" ]; then
  echo "=== evaluation alone (the smoke did not reach it)"
  # shellcheck disable=SC2086
  PYTHONPATH=src timeout 150 "$py" -m regen.jobs.evaluate --target-model "$MODEL" --checkpoint "$EVAL_CHECKPOINT" \
    --prompts "$EVAL_PROMPTS" --output-dir /tmp/eval --device cuda --training-steps 0 $EVAL_ARGS 2>&1 | tail -5
  cp /tmp/eval/report.json /tmp/eval/report.md "$OUT/" 2>/dev/null
fi
echo "=== capture bench after ${SECONDS}s"
PYTHONPATH=src timeout 100 "$py" bench/bench_capture.py --device cuda --model "$MODEL" 2>&1 | grep -v 'Loading weights' | tee "$OUT/capture.log"
echo "done after ${SECONDS}s"
