#!/usr/bin/env bash
# Device session 2: rolling offline rounds against one round under FSDP on a GPU, then the online
# (disaggregated) smoke: regen's hf capture server + Mooncake (plain build, slimmed: its bench and client
# binaries left out to fit the carry limit) + SpecForge's producer and consumer.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
SECONDS=0
# shellcheck source=bench/gpu_venv.sh
. bench/gpu_venv.sh
py=$(GPU_TRAIN_VENV=/tmp/regen-gpu-train-venv gpu_train_python .device/wheels) || exit 1
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
tar xJf .device/mooncake-slim.tar.xz -C "$site"
"$py" -c 'import mooncake.store, specforge, torch; print("venv ok", torch.__version__)' || exit 1
export TRAIN_PYTHON=$py
echo "=== rolling check after ${SECONDS}s"
timeout 300 bench/gpu_rolling_check.sh run 2>&1 | grep -v -E 'Loading weights|Writing model' | tee "$OUT/rolling.log"
echo "rolling rc ${PIPESTATUS[0]}"
echo "=== disaggregated smoke after ${SECONDS}s"
timeout 200 bench/gpu_disagg_smoke.sh run 2>&1 | grep -v -E 'Loading weights|Writing model' | tee "$OUT/disagg.log"
echo "disagg rc ${PIPESTATUS[0]}; done after ${SECONDS}s"
