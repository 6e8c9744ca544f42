#!/usr/bin/env bash
# GPU smoke test of the train stage's online (disaggregated) path: a capture server, a Mooncake master and
# SpecForge 0.2.0's producer + consumer for a few optimizer steps on the demo model; prints what streamed,
# the consumer's steps/s and the capture server's peak GPU memory.
#
#   bench/gpu_disagg_smoke.sh download [WHEELS]   # on a machine with PyPI: fetch the wheels (~70 MiB)
#   bench/gpu_disagg_smoke.sh run [WHEELS]        # on the GPU machine (offline is fine)
#
# `run` builds the training venv from those wheels (pip --no-index) with bench/gpu_venv.sh, as
# bench/gpu_train_smoke.sh does (layered on the machine's own CUDA torch), plus the plain build of Mooncake's
# transfer engine (SpecForge 0.2.0 moves features in host memory: the consumer's receive tensors are CPU
# tensors, the capture sink copies to the CPU first, so no CUDA build is needed), builds the demo model,
# tokenizes a few dozen demo chats, then starts, on loopback:
#   - mooncake_master and Mooncake's HTTP metadata server (from the Mooncake wheel);
#   - the capture server: CAPTURE=hf (default) is regen.training.capture_server on the GPU (transformers);
#     CAPTURE=sglang launches `python -m sglang.launch_server` with SpecForge's capture flags (the line the
#     capture_server role renders: --skip-tokenizer-init --chunked-prefill-size -1 --disable-radix-cache
#     --enable-spec-capture --spec-capture-method dflash --spec-capture-aux-layer-ids ...), which needs a
#     python whose sglang 0.5.14 carries SpecForge's spec-capture patch (SGLANG_PYTHON, default the venv's);
#   - `specforge train --config online.yaml` (no --role: SpecForge's supervisor runs the producer, which
#     posts the prompts to the capture server, and the consumer, which trains on GPU from Mooncake).
# Everything it started is stopped at the end (by pid), whatever happened.
# Knobs (env): STEPS (default 8), SAMPLES (32), SEQ (256 tokens), ATTN (flex_attention), PYTHON (python3),
# CAPTURE (hf|sglang), SGLANG_PYTHON, MEM_FRACTION (0.3, sglang on a GPU it shares with the trainer),
# CAPTURE_GPU / TRAIN_GPU (0 / 0: one GPU is enough), TRAIN_PYTHON=<python with SpecForge and mooncake>
# skips building the venv, DEVICE=cpu (with ATTN=sdpa) dry-runs the whole script on a machine without a GPU
# (hf capture on the CPU, gloo consumer): that checks the script, it measures nothing worth reporting.
# bench/gpu_train_smoke.sh is unchanged and measures the offline path.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
wheels=${2:-.cache/gpu-disagg-wheels}
# shellcheck source=bench/gpu_venv.sh
. bench/gpu_venv.sh
# Beyond the training pins (bench/gpu_venv.sh): the plain build of Mooncake's transfer engine. The GPU image
# already has what its metadata server imports (aiohttp, msgpack; probed on the image: Python 3.12.3, torch
# 2.11.0+cu130, no mooncake, sglang, pydantic or datasets).
DISAGG_PINS=(mooncake-transfer-engine-non-cuda==0.3.13.post1)

if [ "$mode" = download ]; then
  gpu_wheels_download "$wheels"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
    --platform manylinux_2_28_x86_64 -d "$wheels" "${DISAGG_PINS[@]}"
  du -sh "$wheels"
  exit 0
fi

device=${DEVICE:-cuda}
capture=${CAPTURE:-hf}
gpu_check_device gpu_disagg_smoke "$device"
work=$(mktemp -d /tmp/regen-disagg-smoke.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  [ -n "${KEEP:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
py=$(GPU_TRAIN_VENV=${GPU_TRAIN_VENV:-.cache/gpu-disagg-venv} gpu_train_python "$wheels")
if [ -z "${TRAIN_PYTHON:-}" ]; then
  if [ -d "$wheels" ]; then
    "$py" -m pip install --quiet --no-index --find-links "$wheels" --no-deps "${DISAGG_PINS[@]}"
  else
    "$py" -m pip install --quiet --no-deps "${DISAGG_PINS[@]}"
  fi
fi
"$py" -c 'import mooncake.store, specforge' || { echo "gpu_disagg_smoke: $py lacks mooncake or specforge" >&2; exit 2; }
export PYTHONPATH=$PWD/src
model=${MODEL:-$work/model}
[ -n "${MODEL:-}" ] || "$py" -m regen.demo.build --output "$model" --cache-dir "$PWD/.cache/demo-models" >/dev/null

ports=$("$py" -c 'import socket
socks = [socket.socket() for _ in range(5)]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))')
read -r rpc meta metrics cport mport <<<"$ports"
export MOONCAKE_MASTER_SERVER_ADDR=127.0.0.1:$rpc MOONCAKE_METADATA_SERVER=http://127.0.0.1:$meta/metadata
export MOONCAKE_LOCAL_HOSTNAME=127.0.0.1 MOONCAKE_PROTOCOL=tcp

# FSDP needs an accelerator: the CPU dry run trains under DDP (NO_SHARD), as the role does on CPU hosts.
sharding=$([ "$device" = cuda ] && echo SHARD_GRAD_OP || echo NO_SHARD)
segment=$((1 << 30))
"$py" - "$model" "$work" "${SAMPLES:-32}" "${SEQ:-256}" "${STEPS:-8}" "${ATTN:-flex_attention}" "$sharding" \
  "$cport" "$mport" "$segment" <<'EOF'
import json, os, random, sys
from pathlib import Path
try:  # the shared logic imports its siblings as ansible.module_utils.*, as Ansible runs it
    import ansible.module_utils
    ansible.module_utils.__path__.append("module_utils")
except ImportError:  # a GPU venv without ansible-core: the checkout's module_utils alone, as that package
    import types
    sys.modules["ansible"] = types.ModuleType("ansible")
    sys.modules["ansible.module_utils"] = mu = types.ModuleType("ansible.module_utils")
    mu.__path__ = ["module_utils"]
from ansible.module_utils import regen_config, regen_disagg as g, regen_drafter as d
import yaml
from transformers import AutoTokenizer

model, work = sys.argv[1], Path(sys.argv[2])
samples, seq, steps = map(int, sys.argv[3:6])
attn, sharding, cport, mport, segment = sys.argv[6], sys.argv[7], int(sys.argv[8]), int(sys.argv[9]), int(sys.argv[10])
tok = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
words = Path("src/regen/demo/corpus.txt").read_text().split()
rng = random.Random(0)
with open(work / "prompts.jsonl", "w") as out:  # what regen.training.disagg prompts writes
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
layers = draft["dflash_config"]["target_layer_ids"]
paths = g.attempt_paths(str(work), 1)
endpoints = {"master_server_addr": os.environ["MOONCAKE_MASTER_SERVER_ADDR"],
             "metadata_server": os.environ["MOONCAKE_METADATA_SERVER"], "local_hostname": "127.0.0.1",
             "protocol": "tcp"}
runtime, arithmetic = g.runtime_watermarks(segment, 1, seq, d.hidden_state_bytes_per_token(arch["hidden_size"], len(layers)), 1)
run = d.specforge_run_config(
    model_path=model, draft_config_path=str(work / "draft.json"), embedding_key=emb, lm_head_key=head,
    mask_token_id=mask, mode="online", run_id="gpu-disagg-smoke", output_dir=str(work / "out"),
    cache_dir=str(work / "cache"), topology={"nnodes": 1, "nproc_per_node": 1, "master_port": mport},
    master_addr="127.0.0.1", prompts_path=str(work / "prompts.jsonl"), max_length=seq,
    training={"max_steps": steps, "batch_size": 1, "learning_rate": 6e-4, "attention_backend": attn,
              "log_interval": 1, "save_interval": steps, "num_anchors": 64, "fsdp_sharding": sharding},
    online={"server_urls": [f"http://127.0.0.1:{cport}"], "mooncake": endpoints,
            "control_dir": paths["control_dir"], "consumer_state_dir": paths["consumer_state_dir"]},
    extra={"runtime": runtime})
(work / "online.yaml").write_text(yaml.safe_dump(run, sort_keys=False))
(work / "capture_args").write_text(" ".join(g.sglang_capture_args(layers, seq)) + "\n")
(work / "layers").write_text(",".join(map(str, layers)) + "\n")
print("layers", layers, "of", arch["num_layers"], "|", arithmetic)
EOF
layers=$(cat "$work/layers")

mc_dir=$("$py" -c 'import os, mooncake; print(os.path.dirname(mooncake.__file__))')
"$py" -m mooncake.http_metadata_server --host 127.0.0.1 --port "$meta" >"$work/metadata.log" 2>&1 &
pids+=($!)
"$mc_dir/mooncake_master" --rpc_address=127.0.0.1 --rpc_port="$rpc" --metrics_host=127.0.0.1 \
  --metrics_port="$metrics" --logtostderr=true >"$work/master.log" 2>&1 &
pids+=($!)

# The capture server owns the features it captured, in its own segment; SpecForge's roles use none.
capture_env=(MOONCAKE_GLOBAL_SEGMENT_SIZE=$segment MOONCAKE_LOCAL_BUFFER_SIZE=$((64 << 20))
             CUDA_VISIBLE_DEVICES=${CAPTURE_GPU:-0})
if [ "$capture" = sglang ]; then
  spy=${SGLANG_PYTHON:-$py}
  "$spy" -c 'import sglang.srt.spec_capture_sink' 2>/dev/null || {
    echo "gpu_disagg_smoke: $spy has no patched sglang (sglang.srt.spec_capture_sink); apply SpecForge's" \
         "patches/sglang/v0.5.14/spec-capture.patch (role capture_patch) or use CAPTURE=hf" >&2; exit 2; }
  # shellcheck disable=SC2046
  env "${capture_env[@]}" "$spy" -m sglang.launch_server --model-path "$model" --trust-remote-code \
    --tp-size 1 --context-length $(( ${SEQ:-256} + 7 )) --mem-fraction-static "${MEM_FRACTION:-0.3}" \
    --host 127.0.0.1 --port "$cport" $(cat "$work/capture_args") >"$work/capture.log" 2>&1 &
else
  env "${capture_env[@]}" "$py" -m regen.training.capture_server --model "$model" --layers "$layers" \
    --host 127.0.0.1 --port "$cport" --max-length "${SEQ:-256}" --device "$device" >"$work/capture.log" 2>&1 &
fi
pids+=($!)
capture_pid=$!

"$py" -m regen.training.disagg preflight --timeout "${READY_S:-600}" --url "http://127.0.0.1:$cport" \
  --mooncake-master "127.0.0.1:$rpc" --mooncake-metadata "http://127.0.0.1:$meta/metadata" >"$work/preflight.json" || {
  cat "$work/preflight.json"; tail -n 30 "$work/capture.log" "$work/master.log" >&2; exit 1; }

started=$(date +%s)
code=0
CUDA_VISIBLE_DEVICES=${TRAIN_GPU:-0} "$py" -m specforge.cli train --config "$work/online.yaml" >"$work/train.log" 2>&1 || code=$?
wall=$(( $(date +%s) - started ))
peak=$( [ "$device" = cuda ] && nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits \
        | awk -F', ' -v p="$capture_pid" '$1 == p {print $2}' || true)
grep -E '^step [0-9]+:' "$work/train.log" | cut -c1-160 || true

"$py" - "$work/train.log" "$work/capture.log" "$code" "$wall" "$capture" "${peak:-}" <<'EOF'
import re, statistics, sys
from regen.training.status import parse_step_line

lines = open(sys.argv[1], errors="replace").read().splitlines()
code, wall, capture, peak = int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
times = [m["perf/optimizer_step_time_s"] for s, m in filter(None, map(parse_step_line, lines))
         if "perf/optimizer_step_time_s" in m]
produced = next((l for l in lines if "drive_producer returning" in l), "producer: no summary line")
steady = times[2:] or times
rate = f"{1 / statistics.mean(steady):.2f} steps/s steady" if steady else "no steps"
print(f"gpu_disagg_smoke: {len(times)} DFlash steps streamed from a {capture} capture server over Mooncake: {rate}, "
      f"wall {wall} s, capture server GPU memory {peak or '?'} MiB, exit {code}")
print("gpu_disagg_smoke:", re.sub(r"^.*drive_producer ", "producer ", produced))
if code or not times:
    print("\n".join(lines[-40:]))
sys.exit(0 if code == 0 and times else 1)
EOF
