"""The verification probe of python_env, run for real inside venvs (the project venv and one made
without tiktoken) against the demo model: the tokenizer smoke passes where tiktoken is, and fails with a
message naming the venv and the package where it is not."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ansible.module_utils import regen_venv as pe
from ansible.module_utils.regen_pyenv import probe_venv


def _probe(python: Path | str, model: Path | None, imports: list[str]) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = probe_venv(str(python), imports, model_path=str(model) if model else None, env=env, timeout=300)
    assert result["error"] is None, result
    return result


def test_probe_in_project_venv_loads_the_demo_tokenizer(demo_model_dir: Path) -> None:
    result = _probe(sys.executable, demo_model_dir, ["transformers", "tiktoken"])
    assert result["imports"]["tiktoken"]["ok"] and result["imports"]["transformers"]["ok"]
    tokenizer = result["tokenizer"]
    assert tokenizer["ok"] is True, tokenizer
    assert tokenizer["roundtrip"] is True and tokenizer["vocab_size"] > 1000
    assert result["packages"]["tiktoken"] == "0.14.0"
    # The project venv has the CPU torch: the manifest's torch part says so (no CUDA, no arch).
    assert result["torch"]["version"].startswith("2.13.0") and result["torch"]["cuda"] is None
    env = {"name": "serving", "path": sys.prefix, "manage": False}
    assert pe.verification_errors(result, env) == []


def test_probe_without_tiktoken_names_venv_and_package(
    demo_model_dir: Path, python_without_tiktoken: Path, tmp_path: Path
) -> None:
    # The demo tokenizer's remote code is cached per model by transformers; use a private HF home so an
    # earlier successful load cannot hide the missing import.
    os.environ["HF_HOME"] = str(tmp_path / "hf")
    try:
        result = _probe(python_without_tiktoken, demo_model_dir, ["transformers", "tiktoken"])
    finally:
        os.environ.pop("HF_HOME", None)
    assert result["imports"]["transformers"]["ok"]
    assert result["imports"]["tiktoken"]["ok"] is False
    assert result["tokenizer"]["attempted"] and not result["tokenizer"]["ok"]
    venv = str(python_without_tiktoken.parent.parent)
    env = {
        "name": "serving",
        "path": venv,
        "manage": True,
        "remedy_variable": "regen_serving_packages",
        "lock_source": "envs/serving.lock",
    }
    errors = pe.verification_errors(result, env)
    assert (
        f"tiktoken is not installed in {venv} (environment 'serving'); add tiktoken to regen_serving_packages"
        in errors[0]
    )
    assert errors[1].startswith(
        f"tiktoken is not installed in {venv} (environment 'serving'), so the tokenizer of "
        f"{demo_model_dir} cannot load there"
    )


def test_probe_reports_absent_model_without_attempting(tmp_path: Path) -> None:
    result = _probe(sys.executable, tmp_path / "no-such-model", [])
    assert result["tokenizer"]["attempted"] is False


def test_probe_reports_an_interpreter_that_does_not_run(tmp_path: Path) -> None:
    result = probe_venv(str(tmp_path / "bin" / "python"), ["json"])
    assert result["python"] is None and "does not run" in result["error"]
