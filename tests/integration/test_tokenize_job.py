"""`python -m regen.jobs.tokenize` on the demo model's real tokenizer: outputs, bad rows, resume, re-runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.json as paj
import pyarrow.parquet as pq
import pytest

from regen.jobs._common import run_main
from regen.jobs.tokenize import main
from regen.status import validate

ROOT = Path(__file__).resolve().parents[2]


def _record(i: int, **extra) -> dict:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    text = lambda n: " ".join(words[(i + k) % len(words)] for k in range(n))  # noqa: E731
    conv = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": f"Question {i}: {text(6)}?"},
        {"role": "assistant", "content": f"Answer {i}: {text(12)}.", "reasoning_content": f"Think {text(5)}"},
    ]
    return {"id": f"p{i}", "conversations": conv, "finish_reason": "stop", "truncated": False, **extra}


def write_completions(path: Path, n: int = 40, bad: bool = True, start: int = 0) -> None:
    lines = [json.dumps(_record(i)).encode() for i in range(start, start + n)]
    if bad:
        tool_call = {
            "id": "functions.lookup:0",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"q": "x"}'},
        }
        lines += [
            b"this is not json",
            b'{"id": "latin1", "conversations": [{"role": "user", "content": "caf\xe9"}]}',
            json.dumps({"id": "no-answer", "conversations": [{"role": "user", "content": "hi"}]}).encode(),
            json.dumps(
                {
                    "id": "robot",
                    "conversations": [
                        {"role": "robot", "content": "beep"},
                        {"role": "assistant", "content": "ok"},
                    ],
                }
            ).encode(),
            json.dumps(
                {
                    "id": "empty",
                    "conversations": [
                        {"role": "user", "content": ""},
                        {"role": "assistant", "content": "ok"},
                    ],
                }
            ).encode(),
            json.dumps(
                {
                    "id": "long-prompt",
                    "conversations": [
                        {"role": "user", "content": "go " * 300},
                        {"role": "assistant", "content": "ok"},
                    ],
                }
            ).encode(),
            json.dumps(
                {
                    "id": "special",
                    "conversations": [
                        {"role": "user", "content": "What ends a turn?"},
                        {"role": "assistant", "content": "The <|im_end|> token."},
                    ],
                }
            ).encode(),
            json.dumps(
                {
                    "id": "tools",
                    "messages": [
                        {"role": "user", "content": "Look up x."},
                        {
                            "role": "assistant",
                            "content": "",
                            "reasoning_content": "use the tool",
                            "tool_calls": [tool_call],
                        },
                        {"role": "tool", "tool_call_id": "functions.lookup:0", "content": "x = 1"},
                        {"role": "assistant", "content": "x is 1.", "reasoning_content": "read the result"},
                    ],
                }
            ).encode(),
            json.dumps({**_record(99), "id": "cut", "finish_reason": "length", "truncated": True}).encode(),
            json.dumps(
                {
                    "id": "cut-thinking",
                    "finish_reason": "length",
                    "conversations": [
                        {"role": "user", "content": "Prove it."},
                        {"role": "assistant", "content": "", "reasoning_content": "Assume the opposite and"},
                    ],
                }
            ).encode(),
            json.dumps(
                {
                    "id": "long",
                    "conversations": [
                        {"role": "user", "content": "Count."},
                        {"role": "assistant", "content": " ".join(["one"] * 400)},
                    ],
                }
            ).encode(),
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")


def run(tok_dir: Path, inp: Path, out: Path, *extra: str) -> int:
    return main(
        [
            "--input",
            str(inp),
            "--output-dir",
            str(out),
            "--tokenizer",
            str(tok_dir),
            "--no-progress",
            "--max-length",
            "160",
            "--shard-size",
            "16",
            *extra,
        ]
    )


def read_rows(out: Path) -> list[dict]:
    rows = []
    for name in sorted(p.name for p in (out / "data").glob("*.parquet")):
        rows.extend(pq.read_table(out / "data" / name).to_pylist())
    return rows


def snapshot(out: Path) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(out)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "status.json"
    }


@pytest.fixture(scope="module")
def tok(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir, trust_remote_code=True)


@pytest.fixture
def completions(tmp_path: Path) -> Path:
    path = tmp_path / "completions" / "completions-00000.jsonl"
    write_completions(path)
    (path.parent / "errors.jsonl").write_text('{"id": "e", "error": "boom"}\n')  # not an input
    return path.parent


def test_outputs_rejects_and_stats(demo_model_dir, tok, completions, tmp_path):
    out = tmp_path / "out"
    mask_id = len(tok) - 100
    assert run(demo_model_dir, completions, out, "--mask-token-id", str(mask_id)) == 0
    rows = read_rows(out)
    stats = json.loads((out / "stats.json").read_text())
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    by_reason = {r["reason"]: r for r in rejects}
    assert set(by_reason) == {
        "invalid_json",
        "invalid_utf8",
        "no_assistant_turn",
        "unknown_role",
        "empty_content",
        "insufficient_supervision",
    }
    assert by_reason["invalid_utf8"]["source"].endswith("completions-00000.jsonl:42")
    # Cut to --max-length inside the prompt: nothing left to learn.
    assert by_reason["insufficient_supervision"]["id"] == "long-prompt"
    ids = [r["id"] for r in rows]
    assert ids == [*(f"p{i}" for i in range(40)), "special", "tools", "cut", "cut-thinking", "long"]
    assert stats["samples"] == len(rows) == 45 and stats["input_rows"] == 51
    assert stats["rejected_total"] + stats["dropped_total"] == 6
    assert stats["truncated"] == 1 and next(r for r in rows if r["id"] == "long")["length"] == 160
    assert stats["unfinished_generations"] == 2
    assert stats["special_token_strings_in_content"] == 1
    assert (
        stats["reasoning"]["placed_after_generation_prompt"] == 43
    )  # final turns: 40 + cut(-thinking) + tools
    assert stats["mask_token"] == {
        "id": mask_id,
        "token": f"<|reserved_token_{mask_id}|>",
        "in_vocab": True,
        "occurrences_in_samples": 0,
        "samples_dropped": 0,
    }
    assert stats["tokens"] == sum(r["length"] for r in rows)
    assert stats["supervised_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    assert sum(stats["histogram"]["counts"]) == 45
    assert (out / "length_histogram.png").read_bytes()[:4] == b"\x89PNG"
    status = json.loads((out / "status.json").read_text())
    assert validate(status) == [], "the status file follows the jobs' one schema"
    assert status["state"] == "done" and status["done"] == status["total"] == 51
    assert status["item"] == "row" and status["result"]["samples"] == 45
    for row in rows:
        assert len(row["input_ids"]) == len(row["loss_mask"]) == row["length"]
        assert mask_id not in row["input_ids"]
    first = rows[0]
    supervised = tok.decode([i for i, m in zip(first["input_ids"], first["loss_mask"], strict=True) if m])
    assert (
        supervised
        == "Think alpha beta gamma delta epsilon</think>Answer 0: "
        + " ".join(
            [
                "alpha",
                "beta",
                "gamma",
                "delta",
                "epsilon",
                "zeta",
                "eta",
                "theta",
                "alpha",
                "beta",
                "gamma",
                "delta",
            ]
        )
        + ".<|im_end|>"
    )
    cut = next(r for r in rows if r["id"] == "cut")
    assert tok.decode(cut["input_ids"]).endswith(".") and cut["loss_mask"][-1] == 1  # no <|im_end|> invented
    thinking = next(r for r in rows if r["id"] == "cut-thinking")
    assert tok.decode(thinking["input_ids"]).endswith("<|im_middle|><think>Assume the opposite and")
    # The SpecForge-shaped JSONL is uniform enough for Arrow (SpecForge reads it with `datasets`).
    table = paj.read_json(out / "conversations.jsonl")
    assert table.num_rows == 45 and table.column_names == ["id", "conversations"]
    spec = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    assert spec[0]["conversations"][2] == {
        "role": "assistant",
        "content": "Answer 0: alpha beta gamma delta epsilon zeta eta theta alpha beta gamma delta.",
        "reasoning_content": "Think alpha beta gamma delta epsilon",
        "tool_calls": None,
        "tool_call_id": None,
        "name": None,
    }


def test_rerun_changes_nothing_and_growth_redoes_only_the_tail(demo_model_dir, completions, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(demo_model_dir, completions, out, "--json") == 0
    first = json.loads(capsys.readouterr().out)
    assert first["changed"] and first["shards_written"] == 4
    before = snapshot(out)
    assert run(demo_model_dir, completions, out, "--json") == 0
    second = json.loads(capsys.readouterr().out)
    assert not second["changed"] and second["shards_written"] == 0
    assert snapshot(out) == before
    assert run(demo_model_dir, completions, out, "--dry-run") == 0
    assert json.loads(capsys.readouterr().out)["complete"] is True

    with open(completions / "completions-00000.jsonl", "ab") as fh:  # the generation job appended rows
        fh.write(b"".join(json.dumps(_record(i)).encode() + b"\n" for i in range(100, 105)))
    assert run(demo_model_dir, completions, out, "--dry-run") == 0
    assert json.loads(capsys.readouterr().out) | {"output_dir": None} == {
        "shards": 4,
        "pending": 1,
        "stale": 0,
        "complete": False,
        "output_dir": None,
    }
    assert run(demo_model_dir, completions, out, "--json") == 0
    third = json.loads(capsys.readouterr().out)
    assert third["shards_written"] == 1 and third["samples"] == 50
    after = snapshot(out)
    assert after["data/completions-00000-00000.parquet"] == before["data/completions-00000-00000.parquet"]

    # Settings are part of every shard's identity: another max length redoes everything.
    assert run(demo_model_dir, completions, out, "--json", "--max-length", "100") == 0
    assert json.loads(capsys.readouterr().out)["shards_written"] == 4

    # A vanished input file takes its shards with it.
    other = completions / "completions-00001.jsonl"
    write_completions(other, n=3, bad=False, start=1000)  # ids of its own: a repeated id is refused
    assert run(demo_model_dir, completions, out, "--json") == 0
    assert json.loads(capsys.readouterr().out)["shards_written"] == 5
    other.unlink()
    assert run(demo_model_dir, completions, out, "--json") == 0
    gone = json.loads(capsys.readouterr().out)
    assert gone["shards_removed"] == 1 and not list((out / "data").glob("completions-00001-*"))


def test_killed_run_resumes_to_the_same_result(demo_model_dir, tmp_path):
    """SIGKILL mid-run, run again: the result equals an uninterrupted run's, nothing lost or doubled."""
    inp = tmp_path / "c.jsonl"
    write_completions(inp, n=160, bad=False)
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    args = ["--input", str(inp), "--tokenizer", str(demo_model_dir), "--no-progress", "--shard-size", "2"]
    assert main([*args, "--output-dir", str(clean)]) == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "regen.jobs.tokenize", *args, "--output-dir", str(killed)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        done = len(list((killed / "state").glob("*.json"))) if (killed / "state").is_dir() else 0
        if done >= 5:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, (
        "the job finished before it could be killed; make the input larger"
    )
    assert not (killed / "stats.json").exists()
    assert main([*args, "--output-dir", str(killed)]) == 0
    assert read_rows(killed) == read_rows(clean)
    assert (killed / "conversations.jsonl").read_bytes() == (clean / "conversations.jsonl").read_bytes()
    strip = lambda d: {k: v for k, v in d.items() if k != "config"}  # noqa: E731
    assert strip(json.loads((killed / "stats.json").read_text())) == strip(
        json.loads((clean / "stats.json").read_text())
    )
    assert not [p for p in killed.rglob("*") if p.name.endswith(".tmp")]


def test_workers_produce_the_same_shards(demo_model_dir, completions, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert run(demo_model_dir, completions, one) == 0
    assert run(demo_model_dir, completions, two, "--workers", "2") == 0
    assert read_rows(one) == read_rows(two)
    assert (one / "rejects.jsonl").read_bytes() == (two / "rejects.jsonl").read_bytes()


def test_mask_token_in_data_is_dropped_and_unknown_ids_stop_the_job(demo_model_dir, tok, tmp_path, capsys):
    mask_id = len(tok) - 100
    token = tok.convert_ids_to_tokens(mask_id)
    inp = tmp_path / "c.jsonl"
    inp.write_text(
        json.dumps(
            {
                "id": "m",
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": f"a {token} b c"},
                ],
            }
        )
        + "\n"
    )
    out = tmp_path / "out"
    # As text (the default) the string is harmless; as a control token it would put the mask id in the data.
    assert run(demo_model_dir, inp, out, "--mask-token-id", str(mask_id)) == 0
    assert json.loads((out / "stats.json").read_text())["samples"] == 1
    assert run(demo_model_dir, inp, out, "--mask-token-id", str(mask_id), "--allow-special-in-content") == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["samples"] == 0 and stats["dropped"] == {"contains_mask_token": 1}
    capsys.readouterr()
    argv = [
        "--input",
        str(inp),
        "--output-dir",
        str(out),
        "--tokenizer",
        str(demo_model_dir),
        "--mask-token-id",
        str(len(tok) + 5),
    ]
    assert run_main(main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "outside the tokenizer" in err[0] and "plan.drafter.mask_token_id" in err[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tokenizer", "/nonexistent"], "not a directory"),
        (["--chat-template-kwargs", "{thinking"], "not valid JSON"),
        (["--input", "/nonexistent.jsonl"], "no such file"),
    ],
)
def test_usage_errors_are_one_line(demo_model_dir, tmp_path, flags, message):
    inp = tmp_path / "c.jsonl"
    write_completions(inp, n=1, bad=False)
    base = {"--input": str(inp), "--output-dir": str(tmp_path / "o"), "--tokenizer": str(demo_model_dir)}
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        base[flag] = value
    argv = [x for kv in base.items() for x in kv]
    result = subprocess.run(
        [sys.executable, "-m", "regen.jobs.tokenize", *argv, *flags[len(flags) :]],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_gzip_input_and_blank_lines_give_the_same_samples(demo_model_dir, completions, tmp_path):
    import gzip

    plain = completions / "completions-00000.jsonl"
    packed = tmp_path / "packed" / "completions-00000.jsonl.gz"
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(plain.read_bytes().replace(b"\n", b"\r\n\n", 3)))  # CRLF, blank lines
    assert run(demo_model_dir, plain, tmp_path / "a") == 0
    assert run(demo_model_dir, packed, tmp_path / "b") == 0
    assert read_rows(tmp_path / "a") == read_rows(tmp_path / "b")
    sources = [
        json.loads(line)["source"] for line in (tmp_path / "b" / "rejects.jsonl").read_text().splitlines()
    ]
    assert sources[0].endswith("completions-00000.jsonl.gz:44")  # line numbers count the blank lines


def test_an_unexpected_error_costs_one_row_not_the_job(demo_model_dir, tmp_path, monkeypatch):
    """Fault injection: a stub around the encoder raises a non-RowError for one conversation."""
    from regen.tokenization.encode import PieceEncoder

    real = PieceEncoder.encode_many

    def encode_many_stub(self, rendered):
        if any("BOOM" in r.text for r in rendered):
            raise RuntimeError("injected fault")
        return real(self, rendered)

    monkeypatch.setattr(PieceEncoder, "encode_many", encode_many_stub)
    inp = tmp_path / "c.jsonl"
    write_completions(inp, n=5, bad=False)
    with open(inp, "a") as fh:
        fh.write(
            json.dumps(
                {
                    "id": "boom",
                    "messages": [
                        {"role": "user", "content": "say BOOM"},
                        {"role": "assistant", "content": "BOOM!"},
                    ],
                }
            )
            + "\n"
        )
    assert run(demo_model_dir, inp, tmp_path / "out") == 0
    assert [r["id"] for r in read_rows(tmp_path / "out")] == [f"p{i}" for i in range(5)]
    (reject,) = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert (
        reject["id"] == "boom"
        and reject["reason"] == "internal_error"
        and "injected fault" in reject["detail"]
    )


def test_a_run_stopped_after_its_shards_before_the_merge_is_merged_by_the_next(
    demo_model_dir, tmp_path, monkeypatch, capsys
):
    """Every shard committed, then the job died before merging conversations.jsonl (a full disk there, or a
    kill): the next run must merge, and its dry run must not call the output complete before that."""
    from regen.jobs import tokenize

    inp = tmp_path / "c.jsonl"
    write_completions(inp, n=20, bad=False)
    out = tmp_path / "out"
    assert run(demo_model_dir, inp, out) == 0
    with open(inp, "ab") as fh:  # the generation job appended rows
        fh.write(b"".join(json.dumps(_record(i)).encode() + b"\n" for i in range(100, 110)))

    def full(*args):
        raise OSError(28, "No space left on device")  # the merged file is the largest write of the run

    monkeypatch.setattr(tokenize, "_concat", full)
    assert run_main(lambda argv: run(demo_model_dir, inp, out)) == 5
    monkeypatch.undo()
    capsys.readouterr()
    assert run(demo_model_dir, inp, out, "--dry-run") == 0
    assert json.loads(capsys.readouterr().out)["complete"] is False, "the merge is still to be done"
    assert run(demo_model_dir, inp, out, "--json") == 0
    ids = [json.loads(x)["id"] for x in (out / "conversations.jsonl").read_text().splitlines()]
    assert sorted(ids) == sorted(r["id"] for r in read_rows(out)) and len(ids) == 30
    assert json.loads((out / "stats.json").read_text())["samples"] == 30
