"""python_env_info: imports probed in a child interpreter, with versions and the reason for failures."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from ansible.module_utils.regen_pyenv import PROBE_MARK, parse_probe_output, probe, summarize, torch_view

from tests.helpers.modules import run_module


def test_versions_and_missing_modules() -> None:
    records, python, error = probe(["json", "jinja2", "regen_surely_not_installed_mod"], sys.executable)
    assert error is None
    by_name = {r["name"]: r for r in records}
    assert [r["name"] for r in records] == ["json", "jinja2", "regen_surely_not_installed_mod"]
    assert by_name["jinja2"]["ok"] and by_name["jinja2"]["version"] == importlib.metadata.version("jinja2")
    missing = by_name["regen_surely_not_installed_mod"]
    assert (missing["ok"], missing["error_type"], missing["missing_module"]) == (
        False,
        "ModuleNotFoundError",
        "regen_surely_not_installed_mod",
    )
    facts = summarize(records, python)
    assert facts["missing"] == ["regen_surely_not_installed_mod"]
    assert facts["imported"]["jinja2"] == importlib.metadata.version("jinja2")
    assert facts["python"]["executable"] == sys.executable


def test_broken_import_is_reported_with_its_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "regen_broken_mod.py").write_text("import regen_dependency_that_is_missing\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    facts = summarize(*probe(["regen_broken_mod"], sys.executable)[:2])
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
    records = {r["name"]: r for r in probe(["json", "regen_crashing_mod", "jinja2"], sys.executable)[0]}
    assert records["json"]["ok"] and records["jinja2"]["ok"]
    crash = records["regen_crashing_mod"]
    assert crash["error_type"] == "InterpreterCrash" and "exit 139" in crash["error"]


def test_torch_build_facts() -> None:
    document = summarize(*probe(["torch"], sys.executable)[:2])
    torch = document["torch"]
    import torch as local_torch

    assert torch["cuda"] == local_torch.version.cuda
    assert torch["cuda_available"] == local_torch.cuda.is_available()
    assert isinstance(torch["arch_list"], list)
    # The gpu_host torch check reads the same probe.
    view = torch_view(document)
    assert view["ok"] is True and view["version"] == local_torch.__version__
    assert view["cuda"] == local_torch.version.cuda


def test_probe_output_parser_finds_the_unfinished_step() -> None:
    out = (
        f'{PROBE_MARK}{{"python": {{"version": "3.11.2"}}}}\nremote code printed this\n'
        f'{PROBE_MARK}{{"started": 0}}\n{PROBE_MARK}{{"done": 0, "result": {{"ok": true}}}}\n'
        f'{PROBE_MARK}{{"started": 1}}\n{{"done": 1}}\n'
    )
    python, done, started = parse_probe_output(out)
    assert python == {"version": "3.11.2"} and done == {0: {"ok": True}} and started == 1


def test_module_inspects_another_interpreter(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_module("python_env_info", {"python": sys.executable, "modules": ["json", "jinja2"]}, capsys)
    env = result["python_env"]
    assert result["changed"] is False and env["python"]["executable"] == sys.executable
    assert set(env["imported"]) == {"json", "jinja2"} and env["missing"] == []


def test_module_reports_an_interpreter_that_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    python = str(tmp_path / "venv" / "bin" / "python")
    result = run_module("python_env_info", {"python": python, "modules": ["specforge.cli"]}, capsys)
    env = result["python_env"]
    assert not result.get("failed") and env["python"]["version"] is None
    assert env["failed"]["specforge.cli"]["error_type"] == "InterpreterError"
    assert python in env["failed"]["specforge.cli"]["error"]
    assert torch_view(env) == {"ok": False, "error": "torch was not probed"}
