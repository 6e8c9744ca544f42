"""Introspection of model directories that are broken in ways a download or a cache can leave them:
a symlink loop or a dangling link where config.json should be, JSON nested past the parser's depth, and a
weight index whose total_size cannot be a size. Each must name the file and the fix, never a traceback
or a wrong value; through model_config_info, as a module failure or warning.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "configs"

from ansible.module_utils.regen_config import ModelDirError, read_model_dir

from tests.helpers.modules import run_module


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(FIXTURES / "qwen3-8b" / "config.json", model / "config.json")
    return model


def test_a_symlink_loop_on_config_json_is_reported_as_a_loop(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    (model / "config.json").unlink()
    os.symlink("config.json.link", model / "config.json")
    os.symlink("config.json", model / "config.json.link")
    with pytest.raises(ModelDirError) as caught:
        read_model_dir(str(model))
    message = str(caught.value)
    assert "symlink loop" in message and "not found" not in message
    assert f"{model}/config.json -> {model}/config.json.link -> {model}/config.json" in message


def test_a_link_to_nowhere_is_a_broken_link_not_a_missing_file(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    (model / "config.json").unlink()
    os.symlink("../blobs/0123abcd", model / "config.json")
    with pytest.raises(ModelDirError, match=r"config\.json is a broken symlink \(.*blobs/0123abcd, which"):
        read_model_dir(str(model))


def test_a_model_directory_that_is_a_symlink_loop(tmp_path: Path) -> None:
    os.symlink("model", tmp_path / "model")
    with pytest.raises(ModelDirError, match="symlink loop"):
        read_model_dir(str(tmp_path / "model"))


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_json_nested_past_the_parsers_depth_names_the_file(tmp_path: Path, name: str) -> None:
    model = _model_dir(tmp_path)
    (model / name).write_text("[" * 100_000 + "]" * 100_000)
    if name == "config.json":
        with pytest.raises(ModelDirError, match=rf"{model}/config\.json nests arrays or objects too deeply"):
            read_model_dir(str(model))
    else:  # an optional file: a warning, and the config's facts still come back
        arch = read_model_dir(str(model))
        assert any(f"{model}/{name} nests arrays or objects too deeply" in w for w in arch["warnings"])
        assert arch["num_layers"] == 36


def test_a_deeply_nested_safetensors_header_is_a_warning(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    blob = b'{"a":' * 50_000 + b"1" + b"}" * 50_000
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    arch = read_model_dir(str(model))
    assert arch["weight_bytes_source"] == "estimate"
    assert any("model.safetensors nests arrays or objects too deeply" in w for w in arch["warnings"])


@pytest.mark.parametrize("total_size", [-16381470720, -1, 1.5, "16381470720"])
def test_an_impossible_total_size_is_refused(tmp_path: Path, total_size: object) -> None:
    model = _model_dir(tmp_path)
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total_size}}))
    arch = read_model_dir(str(model))
    assert arch["weight_bytes_source"] == "estimate" and arch["weight_bytes"] > 0
    assert any(
        f"metadata.total_size is {total_size!r}, not a size in bytes" in w for w in arch["warnings"]
    ), arch["warnings"]


def test_the_module_fails_with_the_loop_and_warns_about_the_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _model_dir(tmp_path)
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": -5}}))
    result = run_module("model_config_info", {"path": str(model)}, capsys)
    assert result["architecture"]["weight_bytes"] != -5
    assert any("total_size is -5" in w for w in result["architecture"]["warnings"])
    (model / "config.json").unlink()
    os.symlink("config.json", model / "config.json")
    result = run_module("model_config_info", {"path": str(model)}, capsys)
    assert result["failed"] is True and "symlink loop" in result["msg"]
    assert "Traceback" not in json.dumps(result)
