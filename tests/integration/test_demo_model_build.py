"""The demo model builder on disk: CLI contract, caching, determinism, atomicity, refusing foreign dirs.

The builder's mechanics are checked on a spec with a few pre-training steps (seconds); the default spec's
full pre-training runs once per session, for the `demo_model_dir` fixture (the builder's cache entry).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from regen.demo import build, pretrain, weights
from regen.demo.spec import DemoSpec

# The builder's mechanics do not depend on how long it pre-trains: a few steps keep these tests fast.
FAST = replace(DemoSpec(), pretrain_steps=3)
FAST_CLI = ("--pretrain-steps", str(FAST.pretrain_steps))

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

    check = _cli("--output", str(output), *FAST_CLI, "--check", "--json")
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["changed"] is True
    assert not output.parent.exists()  # --check writes nothing

    first = _cli("--output", str(output), *FAST_CLI, "--json")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["changed"] is True and report["path"] == str(output)
    assert report["vocab_size"] == 4096 and report["seed"] == 0
    assert report["pretrain_steps"] == FAST.pretrain_steps and report["cached_from"] is None
    assert {p.name for p in output.iterdir()} == EXPECTED_FILES
    assert not [p for p in output.parent.iterdir() if p.name.startswith(".demo.") and p.is_dir()]
    assert "pre-training step 3/3" in first.stderr  # progress goes to stderr, stdout stays one object

    second = _cli("--output", str(output), *FAST_CLI, "--json")
    assert json.loads(second.stdout)["changed"] is False
    recheck = _cli("--output", str(output), *FAST_CLI, "--check", "--json")
    assert json.loads(recheck.stdout)["changed"] is False
    # Other pre-training settings are other inputs: the model would change.
    assert json.loads(_cli("--output", str(output), "--check", "--json").stdout)["changed"] is True


def test_two_builds_are_byte_identical(tmp_path: Path) -> None:
    spec = replace(DemoSpec(), pretrain_steps=8)
    first, second = tmp_path / "one", tmp_path / "two"
    assert build.build(first, spec).changed is True and build.build(second, spec).changed is True
    assert _digests(first) == _digests(second)


def test_seed_and_pretraining_change_only_the_weights(tmp_path: Path) -> None:
    ours = _digests(_built(tmp_path / "seed0", FAST))
    for other in (replace(FAST, seed=1), replace(FAST, pretrain_steps=0), replace(FAST, pretrain_steps=4)):
        theirs = _digests(_built(tmp_path / f"other-{other.seed}-{other.pretrain_steps}", other))
        changed = {name for name in ours if ours[name] != theirs[name]}
        assert changed == {*weights.shard_names(2), "regen_demo_manifest.json", "README.md"}, other


def _built(output: Path, spec: DemoSpec) -> Path:
    build.build(output, spec)
    return output


def test_the_cache_pretrains_once_per_input_hash_and_copies_verified_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    first = build.build(tmp_path / "a" / "demo", FAST, cache_dir=cache)
    entry = build.cache_entry(cache, FAST)
    assert first.changed is True and first.cached_from == str(entry)
    assert _digests(tmp_path / "a" / "demo") == _digests(entry)

    def _pretraining_must_not_run_stub(*args, **kwargs):  # fault injection: a second pre-training fails
        raise AssertionError("pre-trained again although the cache holds these inputs")

    monkeypatch.setattr(pretrain, "pretrain", _pretraining_must_not_run_stub)
    second = build.build(tmp_path / "b" / "demo", FAST, cache_dir=cache)
    assert second.changed is True and second.cached_from == str(entry)
    assert _digests(tmp_path / "b" / "demo") == _digests(entry)
    assert build.build(tmp_path / "b" / "demo", FAST, cache_dir=cache).changed is False

    # A damaged cache entry is rebuilt (here: the stub refuses, so the failure names the pre-training).
    (entry / weights.shard_names(2)[0]).write_bytes(b"not a shard")
    with pytest.raises(AssertionError, match="pre-trained again"):
        build.build(tmp_path / "c" / "demo", FAST, cache_dir=cache)
    assert not (tmp_path / "c" / "demo").exists()


def test_a_damaged_model_is_detected_and_rebuilt(tmp_path: Path) -> None:
    output = tmp_path / "demo"
    build.build(output, FAST)
    before = _digests(output)
    (output / "tokenizer_config.json").write_text("{}")
    (output / "tiktoken.model").unlink()

    assert build.build(output, FAST, check=True).changed is True
    assert build.build(output, FAST).changed is True
    assert _digests(output) == before


def test_a_crash_mid_build_leaves_the_old_model_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = tmp_path / "demo"
    build.build(output, FAST)
    before = _digests(output)

    def _crashing_write_checkpoint_stub(spec: DemoSpec, directory: Path) -> list[str]:
        (directory / weights.shard_names(spec.num_shards)[0]).write_bytes(b"half a shard")
        raise OSError("disk full (injected)")

    monkeypatch.setattr(weights, "write_checkpoint", _crashing_write_checkpoint_stub)
    with pytest.raises(OSError, match="injected"):
        build.build(output, replace(FAST, seed=7))

    assert _digests(output) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["demo"]


def test_refuses_to_replace_a_directory_it_did_not_build(tmp_path: Path) -> None:
    foreign = tmp_path / "real-model"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"model_type": "llama"}')

    result = _cli("--output", str(foreign), *FAST_CLI, "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["failed"] is True and "refusing to replace" in report["msg"]
    assert (foreign / "config.json").read_text() == '{"model_type": "llama"}'

    plain = _cli("--output", str(foreign), *FAST_CLI)
    assert plain.returncode == 1 and "not built by regen.demo.build" in plain.stderr
    assert "Traceback" not in plain.stderr


def test_concurrent_builds_of_one_directory_serialise(tmp_path: Path) -> None:
    output = tmp_path / "shared"
    command = [sys.executable, "-m", "regen.demo.build", "--output", str(output), *FAST_CLI, "--json"]
    runs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    reports = []
    for run in runs:
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr
        reports.append(json.loads(stdout))

    assert sorted(report["changed"] for report in reports) == [False, True]
    assert _digests(output) == _digests(_built(tmp_path / "alone", FAST))
