"""regen.training.disagg prompts: the file SpecForge's online producer reads, from the tokenized data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from regen.training import disagg
from regen.training.capture import CaptureError, count


def _tokenized(path: Path, rows: list[tuple[list[int], list[int]]]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    with (path / "part-00000.jsonl").open("w") as out:
        for ids, mask in rows:
            out.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")


def test_the_prompts_are_the_samples_offline_capture_takes(tmp_path: Path) -> None:
    data = tmp_path / "tokenized"
    _tokenized(
        data,
        [
            ([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]),
            ([6, 7, 8], [0, 1, 0]),  # no two consecutive supervised tokens: SpecForge drops it
            ([9, 10, 11, 12, 13, 14], [0, 1, 1, 1, 1, 1]),  # cut to 4 tokens
        ],
    )
    out = tmp_path / "run" / "prompts.jsonl"
    first = disagg.write_prompts(str(data), str(out), max_length=4, max_samples=None)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [
        {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
        {"input_ids": [9, 10, 11, 12], "loss_mask": [0, 1, 1, 1]},
    ]
    counted = count(data, 4, None)
    assert first["changed"] and (first["samples"], first["tokens"], first["dropped"]) == (2, 8, 1)
    assert first["fingerprint"] == counted["fingerprint"]

    # Unchanged data: nothing is rewritten. Changed data: the file follows it.
    assert disagg.write_prompts(str(data), str(out), max_length=4, max_samples=None)["changed"] is False
    _tokenized(data, [([1, 2, 3, 4, 5], [0, 1, 1, 1, 1])])
    again = disagg.write_prompts(str(data), str(out), max_length=4, max_samples=None)
    assert again["changed"] and again["samples"] == 1 and len(out.read_text().splitlines()) == 1


def test_no_trainable_sample_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "tokenized"
    _tokenized(data, [([1, 2, 3], [0, 1, 0])])
    with pytest.raises(CaptureError, match="two consecutive supervised tokens"):
        disagg.write_prompts(str(data), str(tmp_path / "p.jsonl"), max_length=8, max_samples=None)


def test_preflight_says_what_does_not_answer(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = disagg.preflight(
        [f"http://127.0.0.1:{port}"], f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/metadata", timeout=0
    )
    assert not result["ok"]
    assert f"the Mooncake master at 127.0.0.1:{port} does not accept connections" in result["msg"]
    assert f"http://127.0.0.1:{port} does not answer" in result["msg"]
    assert "drafter_training_online_server_urls" in result["msg"]


def test_a_damaged_prompt_file_is_made_again_not_reused(tmp_path: Path) -> None:
    # Issue 25: a prompt file cut to 3 of 12 lines, or with a torn last line, was reused ("changed": false).
    data = tmp_path / "tokenized"
    _tokenized(data, [([i, i + 1, i + 2, i + 3], [0, 1, 1, 1]) for i in range(0, 120, 10)])
    out = tmp_path / "run" / "prompts.jsonl"
    assert disagg.write_prompts(str(data), str(out), max_length=8, max_samples=None)["samples"] == 12
    whole = out.read_bytes()
    for damage in (
        b"".join(whole.splitlines(keepends=True)[:3]),  # cut to 3 of 12 lines
        whole[:-7],  # a torn last line
        whole.replace(b"[0, 1, 1, 1]", b"[0, 0, 1, 1]", 1),  # same size, another mask
    ):
        out.write_bytes(damage)
        again = disagg.write_prompts(str(data), str(out), max_length=8, max_samples=None)
        assert again["changed"] is True and "made again" in again["remade"]
        assert out.read_bytes() == whole
    assert disagg.write_prompts(str(data), str(out), max_length=8, max_samples=None)["changed"] is False


def test_health_after_a_run_names_the_part_that_is_down_and_only_that(tmp_path: Path) -> None:
    """A listening socket stands for a live Mooncake master's RPC port; a closed port for a capture server and
    a metadata server that are gone."""
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone = closed.getsockname()[1]
    with socket.socket() as master:
        master.bind(("127.0.0.1", 0))
        master.listen()
        alive = master.getsockname()[1]
        down = disagg.stack_health(
            [f"http://127.0.0.1:{gone}"], f"127.0.0.1:{gone}", f"http://127.0.0.1:{gone}/metadata"
        )
        assert not down["ok"] and down["msg"].startswith("after the run, the Mooncake master at 127.0.0.1:")
        assert f"http://127.0.0.1:{gone} does not answer" in down["msg"]
        # The master accepts, its metadata server is gone: only that is named.
        half = disagg.stack_health([], f"127.0.0.1:{alive}", f"http://127.0.0.1:{gone}/metadata")
        assert not half["ok"] and "metadata server" in half["msg"] and "master at" not in half["msg"]
    assert disagg.stack_health([], None, None) == {"ok": True, "checks": []}
    assert disagg.main(["health", "--mooncake-master", f"127.0.0.1:{gone}", "--mooncake-metadata", "x"]) == 1
