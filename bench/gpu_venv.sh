# Sourced by the GPU scripts (bench/gpu_train_smoke.sh, bench/gpu_rolling_check.sh): the training venv on a
# GPU machine, built offline from carried wheels and layered on the machine's own CUDA torch.
#
#   gpu_wheels_download DIR     on a machine with PyPI: the wheels the GPU image lacks (~25 MiB)
#   gpu_check_device NAME DEV   with DEV=cuda: stops with exit 2 unless nvidia-smi is there, else names the GPU
#   gpu_train_python WHEELS     prints the venv's python (TRAIN_PYTHON, if set, is used as it is)

# The wheels the GPU image lacks or has at other versions (versions of requirements/controller.lock; the
# image ships SpecForge's torch 2.11.0). Found by running on the image: httpcore2 needs truststore, typer a
# newer click, httpx2 a newer idna.
GPU_TRAIN_PINS=(specforge==0.2.0 transformers==5.24.0 huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2
  tokenizers==0.23.3 hf-xet==1.8.0 typer==0.29.2 pydantic==2.14.4 pydantic_core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 truststore==0.10.5 click==8.5.1 idna==3.20
  anyio==4.16.0 h11==0.16.0)

gpu_wheels_download() {
  # The GPU image's python is 3.12 on x86_64; binary wheels are fetched for that.
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$1" "${GPU_TRAIN_PINS[@]}"
  du -sh "$1"
}

gpu_check_device() {
  [ "$2" = cuda ] || return 0
  command -v nvidia-smi >/dev/null || { echo "$1: no nvidia-smi: this needs an NVIDIA GPU" >&2; exit 2; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
}

gpu_train_python() {
  local wheels=$1 py=${PYTHON:-python3} venv=${GPU_TRAIN_VENV:-.cache/gpu-train-venv} parent site
  if [ -n "${TRAIN_PYTHON:-}" ]; then
    echo "$TRAIN_PYTHON"
    return
  fi
  "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "torch sees no GPU")' >&2 || return 1
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv --system-site-packages "$venv" >&2
    # --system-site-packages reaches the base interpreter's packages only: where PYTHON is itself a venv
    # (GPU images ship their CUDA torch in one), a .pth file adds that venv's site directories (their own
    # .pth files included) after the new venv's own, so the pinned wheels installed here win.
    parent=$("$py" -c 'import sys, sysconfig; p = sysconfig.get_paths()
dirs = sorted({p["purelib"], p["platlib"]}) if sys.prefix != sys.base_prefix else []
print("; ".join(["import site"] + [f"site.addsitedir({d!r})" for d in dirs]) if dirs else "")')
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    [ -z "$parent" ] || echo "$parent" >"$site/regen-parent-venv.pth"
  fi
  if [ -d "$wheels" ]; then
    "$venv/bin/python" -m pip install --quiet --no-index --find-links "$wheels" --no-deps "${GPU_TRAIN_PINS[@]}" >&2
  else
    "$venv/bin/python" -m pip install --quiet --no-deps "${GPU_TRAIN_PINS[@]}" >&2
  fi
  echo "$venv/bin/python"
}
