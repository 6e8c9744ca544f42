"""`regen facts --model-path DIR`: the facts and the plan of a model directory, read on this machine.

No inventory, no SSH, no GPU and no ansible-playbook run: the same pure functions the introspect stage's
modules call (`read_model_dir`, the tokenizer reader, and `build_plan`, the one plan builder that
`model_plan_info` calls too), imported from the package's `regen.module_utils` (the checkout's
`module_utils/`, docs/module-utils-sharing.md). The GPUs the plan is for are described on the command
line. A directory with only `config.json` (and no tokenizer files) still gets its architecture and every
plan part the config decides; the tokenizer-dependent parts are unknown, with the reason and the remedy.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from regen.module_utils import regen_config, regen_gpu, regen_plan, regen_simulator, regen_tokenizer
from regen.runner import BadInput

GIB = 1024**3
_CAPABILITY = re.compile(r"^\d{1,2}\.\d$")
# What reads the tokenizer here: the raw files by default, so no model-shipped code runs on this machine.
TOKENIZER_MODES = ("raw_files", "auto", "library")


def check_gpu_spec(gpus: int | None, memory_gib: float | None, capability: str | None) -> None:
    """Bad combinations of the GPU flags, as BadInput (exit 4) naming the flag."""
    if gpus is not None and gpus < 0:
        raise BadInput(f"--gpus {gpus}: give the number of GPUs (0 plans for the CPU)")
    if memory_gib is not None and not memory_gib > 0:
        raise BadInput(f"--gpu-memory-gib {memory_gib}: give each GPU's memory in GiB, e.g. 96")
    if capability is not None and not _CAPABILITY.match(capability):
        raise BadInput(f"--compute-capability {capability!r}: give it as MAJOR.MINOR, e.g. 12.0 or 9.0")
    if gpus:
        if memory_gib is None:
            raise BadInput(f"--gpus {gpus} needs --gpu-memory-gib (each GPU's memory) to plan the layout")
    elif memory_gib is not None or capability is not None:
        raise BadInput("--gpu-memory-gib and --compute-capability describe GPUs: give --gpus N too")


def local_facts(
    model_path: str | Path,
    *,
    gpus: int | None = None,
    memory_gib: float | None = None,
    capability: str | None = None,
    tokenizer_mode: str = "raw_files",
    overrides: Mapping[str, Any] | None = None,
    sweep_report: Mapping[str, Any] | None = None,
    backend: str | None = None,
    prompt_rows: int | None = None,
    simulation_csv: str | Path | None = None,
) -> dict[str, Any]:
    """The facts document (the introspect stage's shape) of `model_path` for the GPUs described.

    The plan comes from `build_plan` with what this machine has: the simulator's ranking and the layout
    sweep's report only when given (the report is applied only when it was measured for this model, GPU
    count and backend), exactly as the introspect stage leaves out what it does not have. `prompt_rows`
    sizes the run estimate (no length statistics here).
    """
    check_gpu_spec(gpus, memory_gib, capability)
    if tokenizer_mode not in TOKENIZER_MODES:
        raise BadInput(f"--tokenizer-mode {tokenizer_mode!r}: one of {', '.join(TOKENIZER_MODES)}")
    path = str(Path(model_path).expanduser().absolute())
    try:
        architecture = regen_config.read_model_dir(path)
    except regen_config.ModelDirError as exc:
        raise BadInput(str(exc)) from None
    try:
        tokenizer = regen_tokenizer.gather(path, mode=tokenizer_mode, unreadable="unknown")
    except regen_tokenizer.TokenizerError as exc:  # library mode: the user asked for it to load
        raise BadInput(str(exc)) from None
    memory = int(memory_gib * GIB) if memory_gib else None
    gpu = regen_gpu.described(gpus or 0, memory, capability, source="given on the command line")
    if prompt_rows is not None and prompt_rows < 1:
        raise BadInput(f"--prompt-rows {prompt_rows}: give the number of prompts the run regenerates")
    simulation = None
    if simulation_csv:
        # An aiconfigurator ranking the operator ran: beside the plan's layout, and the estimate's throughput.
        try:
            simulation = regen_simulator.simulation_from_csv(Path(simulation_csv).read_text())
        except (OSError, ValueError) as exc:
            raise BadInput(f"--simulation-csv {simulation_csv}: {exc}") from None
    try:
        built = regen_plan.build_plan(
            architecture, tokenizer, gpu, dict(overrides or {}),
            prompts={"rows": prompt_rows} if prompt_rows else None,
            sweep_report=dict(sweep_report) if sweep_report is not None else None, backend=backend,
            simulation=simulation,
        )
    except regen_plan.PlanInputError as exc:
        raise BadInput(str(exc)) from None
    return {
        "schema_version": 1,
        "host": None,
        "source": "regen facts --model-path: read from the files here (no inventory, no GPU query)",
        "model_path": path,
        "architecture": architecture,
        "tokenizer": tokenizer,
        "environment": {"python": None, "gpu": gpu},
        **built,
    }


def planned_context_length(plan: Mapping[str, Any]) -> tuple[Any, str | None, str | None]:
    """(value, where, reason) of the plan's context length: `serving.context_length`, else the first
    section that plans one (the length budget); (None, None, None) when the plan has none."""
    sections = [("serving", plan.get("serving"))] + [
        (name, section) for name, section in plan.items() if name != "serving"
    ]
    for name, section in sections:
        if isinstance(section, Mapping) and "context_length" in section:
            entry = section["context_length"]
            if isinstance(entry, Mapping) and "value" in entry:
                return entry["value"], f"plan.{name}.context_length", entry.get("reason")
            return entry, f"plan.{name}.context_length", None
    return None, None, None
