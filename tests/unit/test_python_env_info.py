"""python_env_info: imports probed in a child interpreter, with versions and the reason for failures."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from ansible.module_utils.regen_pyenv import parse_probe_output, probe, summarize


def test_versions_and_missing_modules() -> None:
    records = probe(["json", "jinja2", "regen_surely_not_installed_mod"])
    by_name = {r["name"]: r for r in records}
    assert [r["name"] for r in records] == ["json", "jinja2", "regen_surely_not_installed_mod"]
    assert by_name["jinja2"]["ok"] and by_name["jinja2"]["version"] == importlib.metadata.version("jinja2")
    missing = by_name["regen_surely_not_installed_mod"]
    assert (missing["ok"], missing["error_type"], missing["missing_module"]) == (
        False,
        "ModuleNotFoundError",
        "regen_surely_not_installed_mod",
    )
    facts = summarize(records)
    assert facts["missing"] == ["regen_surely_not_installed_mod"]
    assert facts["imported"]["jinja2"] == importlib.metadata.version("jinja2")
    assert facts["python"]["executable"] == sys.executable


def test_broken_import_is_reported_with_its_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "regen_broken_mod.py").write_text("import regen_dependency_that_is_missing\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    facts = summarize(probe(["regen_broken_mod"]))
    failure = facts["failed"]["regen_broken_mod"]
    assert failure["missing_module"] == "regen_dependency_that_is_missing"
    # The module exists; what is missing is its dependency, so it is not listed as "not installed".
    assert facts["missing"] == []


def test_interpreter_crash_is_reported_and_the_rest_still_probed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fault injection: a module whose import kills the interpreter, as a broken CUDA library can.
    (tmp_path / "regen_crashing_mod.py").write_text("import os\nos._exit(139)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    records = {r["name"]: r for r in probe(["json", "regen_crashing_mod", "jinja2"])}
    assert records["json"]["ok"] and records["jinja2"]["ok"]
    crash = records["regen_crashing_mod"]
    assert crash["error_type"] == "InterpreterCrash" and "exit 139" in crash["error"]


def test_torch_build_facts() -> None:
    torch = summarize(probe(["torch"]))["torch"]
    import torch as local_torch

    assert torch["cuda"] == local_torch.version.cuda
    assert torch["cuda_available"] == local_torch.cuda.is_available()
    assert isinstance(torch["arch_list"], list)


def test_probe_output_parser_finds_the_unfinished_module() -> None:
    out = '{"name": "a", "started": true}\n{"name": "a", "ok": true}\n{"name": "b", "started": true}\nnoise\n'
    done, started = parse_probe_output(out)
    assert list(done) == ["a"] and started == "b"
