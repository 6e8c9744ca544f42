"""The prompts stage's held-out evaluation split (--eval-fraction): seeded, stable under re-runs and file
order, never in the training shards, recorded in the manifest, and off (the old fingerprint) by default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from regen.jobs import prompts as P

ROWS = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(200)]


def _ids(directory: Path) -> list[str]:
    return sorted(
        json.loads(line)["id"]
        for f in sorted(directory.glob("prompts-*.jsonl"))
        for line in f.read_text().splitlines()
    )


def _build(src: Path, out: Path, fraction: float, seed: int = 0) -> dict:
    rc = P.main(
        [
            "--source",
            str(src),
            "--output-dir",
            str(out),
            "--seed",
            str(seed),
            "--eval-fraction",
            str(fraction),
        ]
    )
    assert rc == 0
    return json.loads((out / "manifest.json").read_text())


def test_split_is_held_out_stable_and_in_the_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    manifest = _build(src, tmp_path / "a", 0.1)
    train, held = _ids(tmp_path / "a"), _ids(tmp_path / "a" / P.EVAL_DIR)
    assert not set(train) & set(held) and len(train) + len(held) == 200
    assert 8 <= len(held) <= 35  # about a tenth
    assert manifest["rows"] == len(train) and manifest["eval"]["rows"] == len(held)
    assert manifest["eval"]["fraction"] == 0.1
    capsys.readouterr()
    # A second build changes nothing; the same rows in another order give the same split.
    _build(src, tmp_path / "a", 0.1)
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["changed"] is False
    rev = tmp_path / "rev.jsonl"
    rev.write_text("".join(json.dumps(r) + "\n" for r in reversed(ROWS)))
    _build(rev, tmp_path / "b", 0.1)
    assert _ids(tmp_path / "b" / P.EVAL_DIR) == held
    # Another seed holds out other rows.
    _build(src, tmp_path / "c", 0.1, seed=1)
    assert _ids(tmp_path / "c" / P.EVAL_DIR) != held


def test_no_split_keeps_the_set_and_fingerprint_and_clears_an_old_split(tmp_path: Path) -> None:
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    source = P.parse_source(str(src))
    assert P.fingerprint([source], None, 0, 100_000) == P.fingerprint([source], None, 0, 100_000, 0.0)
    _build(src, tmp_path / "a", 0.2)
    manifest = _build(src, tmp_path / "a", 0.0)
    assert "eval" not in manifest and manifest["rows"] == 200
    assert not list((tmp_path / "a" / P.EVAL_DIR).glob("prompts-*.jsonl"))


def test_a_fraction_out_of_range_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(P.JobError, match="--eval-fraction must be at least 0 and below 1"):
        P.main(["--source", "builtin:demo", "--output-dir", str(tmp_path), "--eval-fraction", "1.5"])
