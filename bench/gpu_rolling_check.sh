#!/usr/bin/env bash
# Rolling offline against one round, on a GPU: the demo model's drafter trained by SpecForge 0.2.0 twice in
# one round (offline, to see how far two identical GPU runs already differ) and once in rounds within a
# disk budget (regen.training.rolling, as the drafter_training role runs it), then compared step by step
# and weight by weight.
#
#   bench/gpu_rolling_check.sh download [WHEELS]   # on a machine with PyPI: the wheels (as gpu_train_smoke.sh)
#   bench/gpu_rolling_check.sh run [WHEELS]        # on the GPU machine (offline is fine)
#
# Knobs (env): SAMPLES (32), SEQ (256 tokens), ROUNDS_BUDGET_KIB (disk budget of the rolling features; the
# default holds about a third of them), ATTN (flex_attention), PYTHON (python3). TRAIN_PYTHON=<python with
# SpecForge> skips building the venv; DEVICE=cpu (with ATTN=sdpa) dry-runs it without a GPU (on the CPU the
# rounds equal one round bit for bit, see tests/integration/test_train_stage.py).
# Prints one line per run and a verdict line `ROLLING {...}`; exit 0 when the rolling run's weights differ
# from the first offline run's by no more than the second offline run's do (bit-identical where the
# kernels are deterministic).
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
gpu_check_device gpu_rolling_check "$device"
work=$(mktemp -d /tmp/regen-gpu-rolling.XXXXXX)
trap '[ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
py=$(GPU_TRAIN_VENV=/tmp/regen-gpu-train-venv gpu_train_python "$wheels")
export PYTHONPATH=$PWD/src
model=$work/model
"$py" -m regen.demo.build --output "$model" --cache-dir "$PWD/.cache/demo-models" >/dev/null

sharding=$([ "$device" = cuda ] && echo SHARD_GRAD_OP || echo NO_SHARD)
"$py" - "$py" "$model" "$work" "${SAMPLES:-32}" "${SEQ:-256}" "${ATTN:-flex_attention}" "$sharding" "$device" \
  "${ROUNDS_BUDGET_KIB:-0}" <<'EOF'
import json, random, socket, subprocess, sys, time
from pathlib import Path
import types
sys.modules.setdefault("ansible", types.ModuleType("ansible"))
mu = sys.modules.setdefault("ansible.module_utils", types.ModuleType("ansible.module_utils"))
mu.__path__ = ["module_utils"]
from ansible.module_utils import regen_config, regen_drafter as d
import torch, yaml
from transformers import AutoTokenizer
from regen.training import rolling
from regen.training.status import parse_step_line

py, model, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
samples, seq, attn, sharding, device, budget_kib = int(sys.argv[4]), int(sys.argv[5]), *sys.argv[6:9], int(sys.argv[9])
tok = AutoTokenizer.from_pretrained(model, trust_remote_code=True)
words = Path("src/regen/demo/corpus.txt").read_text().split()
rng = random.Random(0)
(work / "tok").mkdir()
with open(work / "tok" / "part-00000.jsonl", "w") as out:
    for _ in range(samples):
        ids = tok.encode(" ".join(rng.choices(words, k=seq)), add_special_tokens=False)[: rng.randint(seq // 4, seq)]
        half = len(ids) // 4
        out.write(json.dumps({"input_ids": ids, "loss_mask": [0] * half + [1] * (len(ids) - half)}) + "\n")
config = json.loads(Path(model, "config.json").read_text())
arch = regen_config.normalize_config(config)
mask = len(tok) - 1 if len(tok) <= arch["vocab_size"] else arch["vocab_size"] - 1
draft, _, _ = d.draft_config({"architecture": arch}, config, num_draft_layers=1, mask_token_id=mask)
(work / "draft.json").write_text(json.dumps(draft))
layers = ",".join(map(str, draft["dflash_config"]["target_layer_ids"]))
emb, head = d.embedding_and_head_keys(d.weight_keys(model))
total = d.total_steps(samples, 1)
per_token = d.hidden_state_bytes_per_token(draft["hidden_size"], len(draft["dflash_config"]["target_layer_ids"])) + 16


def run_config(name, features, total_steps=None):
    run = d.specforge_run_config(
        model_path=model, draft_config_path=str(work / "draft.json"), embedding_key=emb, lm_head_key=head,
        mask_token_id=mask, mode="offline", run_id=name, output_dir=str(work / name / "out"),
        cache_dir=str(work / "cache"), topology={"nnodes": 1, "nproc_per_node": 1}, master_addr="127.0.0.1",
        hidden_states_path=str(features), max_length=seq,
        training={"batch_size": 1, "learning_rate": 6e-4, "attention_backend": attn, "log_interval": 1,
                  "save_interval": 4, "num_anchors": 64, "fsdp_sharding": sharding, "seed": 42,
                  "total_steps": total_steps})
    (work / name).mkdir(exist_ok=True)
    path = work / name / "run.yaml"
    path.write_text(yaml.safe_dump(run, sort_keys=False))
    return path


def sh(*argv, log=None):
    started = time.monotonic()
    done = subprocess.run(list(map(str, argv)), capture_output=True, text=True)
    if log:
        with open(log, "a") as handle:
            handle.write(done.stdout + done.stderr)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {' '.join(map(str, argv))}\n{(done.stdout + done.stderr)[-4000:]}")
    return done.stdout, time.monotonic() - started


def train(name, config, *overrides):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return sh(py, "-m", "regen.training.rendezvous", "--host", "127.0.0.1", "--port", port, "--", "specforge.cli",
              "train", "--config", config, *overrides, log=work / name / "train.log")[1]


def capture(out, *extra):
    return json.loads(sh(py, "-m", "regen.training.capture", "--backend", "hf", "--device", device, "--data",
                         work / "tok", "--model", model, "--layers", layers, "--output", out, "--max-length", seq,
                         *extra)[0].splitlines()[-1])


def result(name):
    steps = [parse_step_line(l) for l in (work / name / "train.log").read_text().splitlines()]
    losses = {}
    for parsed in filter(None, steps):
        losses.setdefault(parsed[0], []).append(parsed[1]["loss"])
    state = torch.load(work / name / "out" / f"{name}-step{total}" / "training_state.pt", weights_only=False)
    return losses, state["draft_state_dict"]


full = capture(work / "full")
print(f"capture: {full['samples']} samples, {full['bytes']} B; {total} optimizer steps", flush=True)
times = {}
for name in ("one_a", "one_b"):
    times[name] = train(name, run_config(name, work / "full"))
    print(f"{name}: one round in {times[name]:.1f} s", flush=True)

# Rolling, as the role runs it: plan, then per round prepare, capture --only, check, train, finish.
features, ledger = work / "rolling" / "features", work / "rolling" / "ledger.json"
config = run_config("rolling", features, total_steps=total)
budget = budget_kib * 1024 or max(rolling.file_bytes(seq, per_token) * 2, full["bytes"] // 3)
common = ["--ledger", ledger, "--checkpoints", work / "rolling" / "out", "--run-id", "rolling"]
plan = json.loads(sh(py, "-m", "regen.training.rolling", "plan", *common, "--features", features, "--data",
                     work / "tok", "--max-length", seq, "--budget-bytes", budget, "--file-bytes-per-token",
                     per_token, "--total-steps", total, "--seed", 42)[0])
print(f"rolling: {plan['line']}", flush=True)
times["rolling"] = 0.0
for number, item in enumerate(plan["rounds_detail"]):
    sh(py, "-m", "regen.training.rolling", "prepare", *common, "--round", number)
    capture(features, "--only", ledger.parent / item["file"])
    checked = json.loads(sh(py, "-m", "regen.training.rolling", "check", *common, "--round", number)[0])
    latest = sorted((work / "rolling" / "out").glob("rolling-step*"), key=lambda p: int(p.name.split("step")[1]))
    resume = [f"training.resume_from={latest[-1]}"] if latest else []
    times["rolling"] += train("rolling", config, *resume, f"training.max_steps={item['last_step']}")
    sh(py, "-m", "regen.training.rolling", "finish", *common)
    print(f"  round {number + 1}: steps {item['first_step']}-{item['last_step']}, {checked['line']}", flush=True)
status = json.loads(sh(py, "-m", "regen.training.rolling", "status", *common)[0])

(la, wa), (lb, wb), (lr, wr) = result("one_a"), result("one_b"), result("rolling")


def weight_diff(x, y):
    return max(float((x[k].float() - y[k].float()).abs().max()) for k in x)


def loss_diff(x, y):
    return max(abs(a - b) for s in x for a in x[s] for b in y[s])


verdict = {
    "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    "steps": total,
    "rounds": plan["rounds"],
    "budget_bytes": budget,
    "peak_bytes": status["peak_bytes"],
    "finished": status["finished"],
    "offline_vs_offline": {"weights_max_abs": weight_diff(wa, wb), "loss_max_abs": loss_diff(la, lb),
                           "bit_identical": all(torch.equal(wa[k], wb[k]) for k in wa)},
    "rolling_vs_offline": {"weights_max_abs": weight_diff(wa, wr), "loss_max_abs": loss_diff(la, lr),
                           "bit_identical": all(torch.equal(wa[k], wr[k]) for k in wa)},
    "seconds": {k: round(v, 1) for k, v in times.items()},
}
print("ROLLING", json.dumps(verdict), flush=True)
ok = (status["finished"] and plan["rounds"] >= 2 and status["peak_bytes"] <= budget
      and verdict["rolling_vs_offline"]["weights_max_abs"] <= verdict["offline_vs_offline"]["weights_max_abs"])
sys.exit(0 if ok else 1)
EOF
