"""The venv the evaluate stage's reference decoder runs in on the CPU demo, for tests.

The pipeline's training venv on the embedded default is SpecForge 0.2.0 (``--no-deps``) layered on the
serving venv's torch and transformers (roles/drafter_training/tasks/venv.yml); this builds the same
layering on the project venv under .cache/specforge-0.2.0-eval-venv (about 10 s on first use, reused
after). It differs from .cache/specforge-0.2.0-venv, which adds the transformers release SpecForge pins
for checking configs: the reference runs with the transformers the pipeline really uses.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PINS = ["specforge==0.2.0"]
VENV = Path(os.environ.get("REGEN_EVALUATE_VENV", ROOT / ".cache" / "specforge-0.2.0-eval-venv"))


def layered_venv(venv: Path, pins: list[str]) -> Path:
    """The python of a venv at `venv` that sees this interpreter's site-packages (a .pth file) plus `pins`
    installed with --no-deps; rebuilt only when the pins or the base change. Built under a file lock: the
    two lanes of scripts/test-all.sh may ask for the same venv at once."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _layered_venv(venv, pins)


def _layered_venv(venv: Path, pins: list[str]) -> Path:
    python = venv / "bin" / "python"
    base = sysconfig.get_paths()["purelib"]
    marker = venv / ".regen-pins"
    want = json.dumps({"pins": pins, "base": base})
    if python.exists() and marker.exists() and marker.read_text() == want:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "regen-base.pth").write_text(base + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            *pins,
        ],
        check=True,
        timeout=600,
    )
    marker.write_text(want)
    return python


def evaluate_python() -> Path:
    return layered_venv(VENV, PINS)


def run_python(code: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """Run `code` in the evaluate venv: the repo's src/ importable, module_utils/ named for the snippet."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "REGEN_MODULE_UTILS": str(ROOT / "module_utils")}
    return subprocess.run(
        [str(evaluate_python()), "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


# Driver code: `make_drafter` writes an untrained DFlash drafter for a target as `export --to hf` lays it out
# (config.json + model.safetensors), its config from regen's own draft-config derivation.
DRAFTER_SNIPPET = r"""
import json, os, torch
import ansible.module_utils  # the shared logic imports its siblings as Ansible does; module_utils joins it
ansible.module_utils.__path__.append(os.environ["REGEN_MODULE_UTILS"])
from ansible.module_utils import regen_drafter
from transformers import Qwen3Config
from specforge.modeling.draft.dflash import DFlashDraftModel

def make_drafter(model_dir, out_dir, seed=1, num_draft_layers=1, mask_token_id=3845):
    target = json.load(open(f"{model_dir}/config.json"))
    text = target.get("text_config", target)
    facts = {"architecture": {"hidden_size": text["hidden_size"], "num_layers": text["num_hidden_layers"],
                              "vocab_size": text["vocab_size"]}}
    cfg, _, _ = regen_drafter.draft_config(
        facts, target, num_draft_layers=num_draft_layers, mask_token_id=mask_token_id
    )
    torch.manual_seed(seed)
    DFlashDraftModel(Qwen3Config(**cfg)).save_pretrained(out_dir)
    return cfg
"""
