"""The throwaway SpecForge 0.2.0 venv the tests run SpecForge's own code in (schema, launch planner, CLI,
Mooncake store, server-capture client).

Layered on this interpreter's site-packages (tests/helpers/evaluate_venv.layered_venv): it holds SpecForge
0.2.0 (--no-deps: its sglang/flash-attn/CUDA pins are not needed for its config, model, launch-planning and
data-plane code) and the transformers release SpecForge pins (5.8.1, with the hub/tokenizers versions that
release needs), while torch 2.13.0 (CPU), pydantic and PyYAML come from the project venv. Built on first use
in about 10 s under .cache/specforge-0.2.0-venv (REGEN_SPECFORGE_VENV elsewhere); its bin/ has SpecForge's
`specforge` console script.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.evaluate_venv import layered_venv

ROOT = Path(__file__).resolve().parents[2]
# SpecForge 0.2.0 and the transformers it pins; the other four are what that transformers release needs
# beyond the project venv (pip's resolution, pinned so the venv is the same everywhere).
PINS = [
    "specforge==0.2.0",
    "transformers==5.8.1",
    "huggingface-hub==1.33.0",
    "tokenizers==0.22.2",
    "httpx==0.29.0",
    "httpcore==1.0.9",
]
VENV = Path(os.environ.get("REGEN_SPECFORGE_VENV", ROOT / ".cache" / "specforge-0.2.0-venv"))


def specforge_python() -> Path:
    return layered_venv(VENV, PINS)
