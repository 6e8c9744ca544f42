"""`regen facts --model-path DIR`: the facts and the plan of a model directory, read on this machine.

No inventory, no SSH, no GPU and no ansible-playbook run: the same pure functions the introspect stage's
modules call (`read_model_dir`, the tokenizer reader, `make_plan`), imported from the checkout's
`module_utils/` as Ansible imports them (`ansible.module_utils.<name>`). The GPUs the plan is for are
described on the command line. A directory with only `config.json` (and no tokenizer files) still gets
its architecture and every plan part the config decides; the tokenizer-dependent parts are unknown,
with the reason and the remedy.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from regen.runner import BadInput

GIB = 1024**3
_CAPABILITY = re.compile(r"^\d{1,2}\.\d$")
# What reads the tokenizer here: the raw files by default, so no model-shipped code runs on this machine.
TOKENIZER_MODES = ("raw_files", "auto", "library")


class LocalFactsError(Exception):
    """The checkout cannot provide the introspection logic (no module_utils/, no ansible-core)."""


def _module_utils(project_root: Path) -> dict[str, ModuleType]:
    """The introspection modules from `<checkout>/module_utils`, as `ansible.module_utils.<name>` (their
    own imports name each other that way, so they must come from that package and nowhere else)."""
    directory = project_root / "module_utils"
    if not (directory / "regen_plan.py").is_file():
        raise LocalFactsError(
            f"{directory} has no regen_plan.py: run regen from a regen checkout (--project DIR)"
        )
    try:
        import ansible.module_utils
    except ImportError as exc:
        raise LocalFactsError(
            f"ansible-core is not importable ({exc}); use the project venv (scripts/bootstrap.sh)"
        ) from None
    if str(directory) not in ansible.module_utils.__path__:
        ansible.module_utils.__path__.append(str(directory))
    names = ("regen_config", "regen_tokenizer", "regen_gpu", "regen_plan", "regen_simulator")
    return {name: importlib.import_module(f"ansible.module_utils.{name}") for name in names}


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
    project_root: Path,
    model_path: str | Path,
    *,
    gpus: int | None = None,
    memory_gib: float | None = None,
    capability: str | None = None,
    tokenizer_mode: str = "raw_files",
    overrides: Mapping[str, Any] | None = None,
    prompt_rows: int | None = None,
    simulation_csv: str | Path | None = None,
) -> dict[str, Any]:
    """The facts document (the introspect stage's shape) of `model_path` for the GPUs described."""
    check_gpu_spec(gpus, memory_gib, capability)
    if tokenizer_mode not in TOKENIZER_MODES:
        raise BadInput(f"--tokenizer-mode {tokenizer_mode!r}: one of {', '.join(TOKENIZER_MODES)}")
    mods = _module_utils(project_root)
    path = str(Path(model_path).expanduser().absolute())
    try:
        architecture = mods["regen_config"].read_model_dir(path)
    except mods["regen_config"].ModelDirError as exc:
        raise BadInput(str(exc)) from None
    try:
        tokenizer = mods["regen_tokenizer"].gather(path, mode=tokenizer_mode, unreadable="unknown")
    except mods["regen_tokenizer"].TokenizerError as exc:  # library mode: the user asked for it to load
        raise BadInput(str(exc)) from None
    memory = int(memory_gib * GIB) if memory_gib else None
    gpu = mods["regen_gpu"].described(gpus or 0, memory, capability, source="given on the command line")
    errors = mods["regen_plan"].override_errors(dict(overrides or {}))
    if errors:
        raise BadInput("; ".join(errors))
    if prompt_rows is not None and prompt_rows < 1:
        raise BadInput(f"--prompt-rows {prompt_rows}: give the number of prompts the run regenerates")
    prompts = {"rows": prompt_rows} if prompt_rows else None  # the run estimate's size; no length stats
    plan = mods["regen_plan"].make_plan(architecture, tokenizer, gpu, dict(overrides or {}), prompts=prompts)
    if simulation_csv:
        # An aiconfigurator ranking the operator ran: beside the plan's layout, and the estimate's throughput.
        try:
            simulation = mods["regen_simulator"].simulation_from_csv(Path(simulation_csv).read_text())
        except (OSError, ValueError) as exc:
            raise BadInput(f"--simulation-csv {simulation_csv}: {exc}") from None
        serving = mods["regen_plan"].plan_values(plan)["serving"]
        plan["serving"]["simulator_estimate"] = mods["regen_simulator"].plan_entry(simulation, serving)
        mods["regen_plan"].refresh_estimate(plan, architecture, prompts, dict(overrides or {}))
    return {
        "schema_version": 1,
        "host": None,
        "source": "regen facts --model-path: read from the files here (no inventory, no GPU query)",
        "model_path": path,
        "architecture": architecture,
        "tokenizer": tokenizer,
        "environment": {"python": None, "gpu": gpu},
        "plan": plan,
        "plan_values": mods["regen_plan"].plan_values(plan),
        "plan_unknown": mods["regen_plan"].unknown_entries(plan),
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
