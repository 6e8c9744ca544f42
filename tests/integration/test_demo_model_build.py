"""The demo model builder on disk: CLI contract, caching, determinism, atomicity, refusing foreign dirs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from regen.demo import build, weights
from regen.demo.spec import DemoSpec

EXPECTED_FILES = {
    "README.md",
    "chat_template.jinja",
    "config.json",
    "configuration_kimi_k25_demo.py",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "modeling_kimi_k25_demo.py",
    "regen_demo_manifest.json",
    "tiktoken.model",
    "tokenization_kimi.py",
    "tokenizer_config.json",
}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "regen.demo.build", *args], capture_output=True, text=True, check=False
    )


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_cli_builds_once_then_reports_no_change(tmp_path: Path) -> None:
    output = tmp_path / "models" / "demo"

    check = _cli("--output", str(output), "--check", "--json")
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["changed"] is True
    assert not output.parent.exists()  # --check writes nothing

    first = _cli("--output", str(output), "--json")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["changed"] is True and report["path"] == str(output)
    assert report["vocab_size"] == 4096 and report["seed"] == 0
    assert {p.name for p in output.iterdir()} == EXPECTED_FILES
    assert not [p for p in output.parent.iterdir() if p.name.startswith(".demo.") and p.is_dir()]

    second = _cli("--output", str(output), "--json")
    assert json.loads(second.stdout)["changed"] is False
    assert json.loads(_cli("--output", str(output), "--check", "--json").stdout)["changed"] is False


def test_two_builds_are_byte_identical(tmp_path: Path, demo_model_dir: Path) -> None:
    fresh = tmp_path / "again"
    assert build.build(fresh).changed is True
    assert _digests(fresh) == _digests(demo_model_dir)


def test_seed_changes_only_the_weights(tmp_path: Path, demo_model_dir: Path) -> None:
    other = tmp_path / "seed1"
    build.build(other, replace(DemoSpec(), seed=1))
    ours, theirs = _digests(demo_model_dir), _digests(other)
    changed = {name for name in ours if ours[name] != theirs[name]}
    assert changed == {*weights.shard_names(2), "regen_demo_manifest.json", "README.md"}


def test_a_damaged_model_is_detected_and_rebuilt(tmp_path: Path, demo_model_dir: Path) -> None:
    output = tmp_path / "demo"
    build.build(output)
    (output / "tokenizer_config.json").write_text("{}")
    (output / "tiktoken.model").unlink()

    assert build.build(output, check=True).changed is True
    assert build.build(output).changed is True
    assert _digests(output) == _digests(demo_model_dir)


def test_a_crash_mid_build_leaves_the_old_model_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = tmp_path / "demo"
    build.build(output)
    before = _digests(output)

    def _crashing_write_checkpoint_stub(spec: DemoSpec, directory: Path) -> list[str]:
        (directory / weights.shard_names(spec.num_shards)[0]).write_bytes(b"half a shard")
        raise OSError("disk full (injected)")

    monkeypatch.setattr(weights, "write_checkpoint", _crashing_write_checkpoint_stub)
    with pytest.raises(OSError, match="injected"):
        build.build(output, replace(DemoSpec(), seed=7))

    assert _digests(output) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["demo"]


def test_refuses_to_replace_a_directory_it_did_not_build(tmp_path: Path) -> None:
    foreign = tmp_path / "real-model"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"model_type": "llama"}')

    result = _cli("--output", str(foreign), "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["failed"] is True and "refusing to replace" in report["msg"]
    assert (foreign / "config.json").read_text() == '{"model_type": "llama"}'

    plain = _cli("--output", str(foreign))
    assert plain.returncode == 1 and "not built by regen.demo.build" in plain.stderr
    assert "Traceback" not in plain.stderr


def test_concurrent_builds_of_one_directory_serialise(tmp_path: Path, demo_model_dir: Path) -> None:
    output = tmp_path / "shared"
    command = [sys.executable, "-m", "regen.demo.build", "--output", str(output), "--json"]
    runs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    reports = []
    for run in runs:
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr
        reports.append(json.loads(stdout))

    assert sorted(report["changed"] for report in reports) == [False, True]
    assert _digests(output) == _digests(demo_model_dir)
