"""The prompts job: normalization of the common row shapes, rejects, dedup, sampling, atomic output."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from regen.jobs import prompts as P
from regen.jobs._common import JobError


def turns(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


# ------------------------------------------------------------------------------------------ normalize


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        # SpecForge / OpenAI messages
        (
            {"conversations": turns(("user", "hi"), ("assistant", "yo"))},
            turns(("user", "hi"), ("assistant", "yo")),
        ),
        ({"messages": turns(("system", "s"), ("user", "q"))}, turns(("system", "s"), ("user", "q"))),
        # ShareGPT from/value with human/gpt
        (
            {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
            turns(("user", "a"), ("assistant", "b")),
        ),
        # OpenAI content parts
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
                    }
                ]
            },
            turns(("user", "x\ny")),
        ),
        # prompt-only shapes
        ({"prompt": "p"}, turns(("user", "p"))),
        ({"question": "q?"}, turns(("user", "q?"))),
        (
            {"instruction": "do it", "input": "with this", "output": "ignored"},
            turns(("user", "do it\n\nwith this")),
        ),
        ({"instruction": "do it", "input": ""}, turns(("user", "do it"))),
        # a top-level system field becomes the first turn
        ({"system": "be nice", "prompt": "p"}, turns(("system", "be nice"), ("user", "p"))),
        # assistant content may be null (it is regenerated anyway)
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
            turns(("user", "q"), ("assistant", "")),
        ),
    ],
)
def test_normalize_recognises_common_shapes(row, expected):
    assert P.normalize_conversation(row) == expected


def test_normalize_with_a_mapping():
    row = {"uuid": "u1", "dialog": [{"speaker": "USER", "text": "hello"}], "sys": "terse"}
    mapping = {"conversations": "dialog", "role_key": "speaker", "content_key": "text", "system": "sys"}
    assert P.normalize_conversation(row, mapping) == turns(("system", "terse"), ("user", "hello"))
    # a mapped system field may be missing from a row
    assert P.normalize_conversation({"dialog": row["dialog"]}, mapping) == turns(("user", "hello"))


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ([1, 2], "expected an object"),
        ({"foo": 1}, "neither a conversation"),
        ({"messages": []}, "empty list"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "unknown role 'tool'"),
        ({"messages": [{"content": "x"}]}, "no role field"),
        ({"messages": [{"role": "user"}]}, "no content field"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "non-text content",
        ),
        ({"messages": [{"role": "user", "content": 5}]}, "content of type int"),
        ({"messages": turns(("user", "   "))}, "empty user turn"),
        ({"messages": turns(("assistant", "a"), ("user", "q"))}, "before any user turn"),
        ({"messages": turns(("user", "q"), ("assistant", "a"), ("assistant", "b"))}, "consecutive assistant"),
        ({"messages": turns(("user", "q"), ("system", "s"))}, "system turn after the start"),
        ({"messages": turns(("system", "s"))}, "no user turn"),
        ({"messages": "hello"}, "neither a conversation"),
    ],
)
def test_normalize_rejects_with_a_reason(row, reason):
    with pytest.raises(P.Reject, match=reason):
        P.normalize_conversation(row)


def test_mapped_field_missing_is_a_reject():
    with pytest.raises(P.Reject, match="mapped field conversations='dialog' is missing"):
        P.normalize_conversation({"messages": turns(("user", "q"))}, {"conversations": "dialog"})


def test_ids_are_the_sources_or_a_hash_of_the_prompt_side():
    conv = turns(("user", "q"), ("assistant", "a"))
    assert P.row_id({"id": 7}, conv, {}, "src-") == "src-7"
    h1 = P.row_id({}, conv, {}, "")
    # the assistant text does not change the identity of a prompt; the user text does
    assert h1 == P.row_id({}, turns(("user", "q"), ("assistant", "other")), {}, "")
    assert h1 != P.row_id({}, turns(("user", "q2"), ("assistant", "a")), {}, "")
    assert len(h1) == 24 and int(h1, 16) >= 0
    with pytest.raises(P.Reject, match="non-empty string or integer"):
        P.row_id({"id": True}, conv, {}, "")
    with pytest.raises(P.Reject, match="non-empty string or integer"):
        P.row_id({"id": ""}, conv, {}, "")


# ------------------------------------------------------------------------------------------ sources


def test_parse_source_forms(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text("")
    assert P.parse_source(str(f)).files == [f]
    assert P.parse_source("builtin:demo").files[0].name == "demo_prompts.jsonl"
    hf = P.parse_source('{"hf": "org/ds", "split": "test", "sample": 5, "revision": "abc"}')
    assert (hf.kind, hf.location, hf.split, hf.sample, hf.revision) == ("hf", "org/ds", "test", 5, "abc")
    assert P.parse_source("hf:org/ds").kind == "hf"
    # options the role may pass as null are ignored
    assert (
        P.parse_source({"path": str(f), "mapping": None, "sample": None, "id_prefix": None}).id_prefix == ""
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("/no/such/file.jsonl", "does not exist"),
        ("builtin:nope", "unknown builtin prompt set"),
        ('{"path": "x", "hf": "y"}', "exactly one of path, hf or builtin"),
        ('{"path": "x", "bogus": 1}', "unknown option"),
        ('{"path": "x"', "not valid JSON"),
        ('{"builtin": "demo", "sample": 0}', "positive integer"),
    ],
)
def test_parse_source_errors_are_clear(spec, message):
    with pytest.raises(JobError, match=message):
        P.parse_source(spec)


def test_hf_source_without_datasets_names_the_remedy(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as on a host without the package
    src = P.parse_source("hf:org/ds")
    with pytest.raises(JobError, match=r"needs the `datasets` package .* local JSONL/Parquet path"):
        list(P.iter_source_rows(src))


# ------------------------------------------------------------------------------------------ build


def write_jsonl(path: Path, rows, extra_lines=()):
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
        for line in extra_lines:
            fh.write(line + "\n")
    return path


def read_set(out: Path):
    manifest = json.loads((out / "manifest.json").read_text())
    rows = []
    for shard in manifest["shards"]:
        rows += [json.loads(x) for x in (out / shard["path"]).read_text().splitlines()]
    return manifest, rows


def build(sources, out, **kw):
    kw.setdefault("sample", None)
    kw.setdefault("seed", 0)
    kw.setdefault("shard_rows", 1000)
    return P.build([P.parse_source(s) for s in sources], out, **kw)


def test_build_dedups_rejects_and_reports(tmp_path):
    src = write_jsonl(
        tmp_path / "src.jsonl",
        [
            {"id": "a", "conversations": turns(("user", "q1"))},
            {"id": "b", "conversations": turns(("user", "q1"))},  # same prompt: duplicate
            {"id": "c", "conversations": turns(("user", "q2"), ("assistant", "x"))},
            {"id": "d", "conversations": turns(("user", "q2"), ("assistant", "y"))},  # same prompt side
            {"id": "a", "conversations": turns(("user", "q3"))},  # id clash
            {"conversations": turns(("user", "no id"))},
            {"id": "t", "conversations": [{"role": "tool", "content": "x"}]},
        ],
        extra_lines=["{not json", "[1,2]"],
    )
    out = tmp_path / "out"
    result = build([str(src)], out)
    assert result["changed"] is True
    manifest, rows = read_set(out)
    ids = [r["id"] for r in rows]
    assert ids[:2] == ["a", "c"] and len(ids) == 3 and len(ids[2]) == 24  # hashed id for the id-less row
    assert manifest["duplicates"] == 2 and manifest["rejected"] == 4 and manifest["rows"] == 3
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    reasons = " | ".join(r["reason"] for r in rejects)
    assert "already used by a different prompt" in reasons
    assert "unknown role 'tool'" in reasons
    assert "invalid JSON" in reasons
    assert "expected an object" in reasons
    assert all(r["where"].startswith("src.jsonl:") for r in rejects if r["reason"] != "")
    assert {r["where"] for r in rejects} >= {"src.jsonl:8", "src.jsonl:9"}


def test_second_build_changes_nothing_and_a_content_change_rebuilds(tmp_path):
    src = write_jsonl(tmp_path / "src.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    out = tmp_path / "out"
    first = build([str(src)], out, shard_rows=4)
    manifest, rows = read_set(out)
    assert len(manifest["shards"]) == 3 and len(rows) == 10
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    second = build([str(src)], out, shard_rows=4)
    assert second["changed"] is False and second["fingerprint"] == first["fingerprint"]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    # check mode on a changed input says so and writes nothing
    write_jsonl(src, [{"prompt": f"p{i}"} for i in range(11)])
    assert build([str(src)], out, shard_rows=4, check=True)["changed"] is True
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    third = build([str(src)], out, shard_rows=4)
    assert third["changed"] is True
    manifest, rows = read_set(out)
    assert len(rows) == 11
    # shards of the old set are gone, only the manifest's remain
    names = {p.name for p in out.iterdir()}
    # (.lock: the builders' lock, one builder per directory)
    assert names == {s["path"] for s in manifest["shards"]} | {"manifest.json", "rejects.jsonl", ".lock"}


def test_sampling_is_reproducible_and_order_independent(tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"prompt {i}"} for i in range(200)]
    a = write_jsonl(tmp_path / "a.jsonl", rows)
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    b = write_jsonl(tmp_path / "b.jsonl", shuffled)
    build([str(a)], tmp_path / "o1", sample=20, seed=7)
    build([str(b)], tmp_path / "o2", sample=20, seed=7)
    build([str(a)], tmp_path / "o3", sample=20, seed=8)
    s1 = {r["id"] for r in read_set(tmp_path / "o1")[1]}
    s2 = {r["id"] for r in read_set(tmp_path / "o2")[1]}
    s3 = {r["id"] for r in read_set(tmp_path / "o3")[1]}
    assert len(s1) == 20 and s1 == s2 and s1 != s3
    # output keeps the input order of the sampled rows
    ids = [r["id"] for r in read_set(tmp_path / "o1")[1]]
    assert ids == sorted(ids, key=lambda x: int(x[1:]))
    assert read_set(tmp_path / "o1")[0]["sampled_out"] == 180


def test_per_source_sample_prefix_and_cross_source_dedup(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"id": i, "prompt": f"a{i}"} for i in range(50)])
    b = write_jsonl(
        tmp_path / "b.jsonl", [{"id": i, "prompt": f"a{i}" if i < 5 else f"b{i}"} for i in range(10)]
    )
    out = tmp_path / "out"
    build(
        [
            json.dumps({"path": str(a), "sample": 10, "id_prefix": "A-"}),
            json.dumps({"path": str(b), "id_prefix": "B-"}),
        ],
        out,
    )
    manifest, rows = read_set(out)
    ids = [r["id"] for r in rows]
    assert sum(i.startswith("A-") for i in ids) == 10
    # b's rows 0-4 repeat prompts of a: kept only where a's sample did not already hold them
    a_prompts = {r["conversations"][0]["content"] for r in rows if r["id"].startswith("A-")}
    b_kept = {r["conversations"][0]["content"] for r in rows if r["id"].startswith("B-")}
    assert not (a_prompts & b_kept)
    assert {f"b{i}" for i in range(5, 10)} <= b_kept
    assert manifest["sources"][0]["counts"]["sampled_out"] == 40


def test_parquet_and_gzip_sources(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"question": ["what?", "why?"], "uuid": ["q1", "q2"]})
    pq.write_table(table, tmp_path / "d.parquet")
    with gzip.open(tmp_path / "e.jsonl.gz", "wt") as fh:
        fh.write(json.dumps({"messages": turns(("user", "gz"))}) + "\n")
    out = tmp_path / "out"
    build([str(tmp_path / "d.parquet"), str(tmp_path / "e.jsonl.gz")], out)
    _, rows = read_set(out)
    assert [r["id"] for r in rows][:2] == ["q1", "q2"]
    assert rows[2]["conversations"] == turns(("user", "gz"))


def test_a_failed_build_leaves_the_previous_set_intact(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "src.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    out = tmp_path / "out"
    build([str(src)], out, shard_rows=2)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    write_jsonl(src, [{"prompt": f"q{i}"} for i in range(6)])
    real = P._ShardWriter.write
    calls = {"n": 0}

    def boom(self, rid, t, category=None):
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError("disk full (simulated)")
        return real(self, rid, t, category)

    monkeypatch.setattr(P._ShardWriter, "write", boom)
    with pytest.raises(OSError):
        build([str(src)], out, shard_rows=2)
    monkeypatch.undo()
    # the committed set is untouched: the manifest still lists the old shards, which are all there
    manifest, rows = read_set(out)
    assert [r["conversations"][0]["content"] for r in rows] == [f"p{i}" for i in range(6)]
    assert (out / "manifest.json").read_bytes() == before["manifest.json"]
    # a finished shard of the new set may be left over; the next successful build removes it
    build([str(src)], out, shard_rows=2)
    manifest, rows = read_set(out)
    assert {p.name for p in out.iterdir()} == {s["path"] for s in manifest["shards"]} | {
        "manifest.json",
        "rejects.jsonl",
        ".lock",
    }


def test_no_usable_prompts_is_a_clear_error(tmp_path):
    src = write_jsonl(tmp_path / "src.jsonl", [{"foo": 1}])
    with pytest.raises(JobError, match="no usable prompts: 1 rows read, 1 rejected"):
        build([str(src)], tmp_path / "out")


def test_demo_prompt_set_is_valid_and_varied():
    src = P.parse_source("builtin:demo")
    rows = [row for _, row, err in P.iter_source_rows(src) if err is None]
    assert len(rows) >= 20
    convs = [P.normalize_conversation(r) for r in rows]
    assert any(c[0]["role"] == "system" for c in convs)
    assert any(sum(t["role"] == "user" for t in c) >= 2 for c in convs)  # multi-turn
    assert len({r["id"] for r in rows}) == len(rows)


def test_cli_summary_and_exit_codes(tmp_path):
    env = dict(os.environ)
    out = tmp_path / "out"
    run = [sys.executable, "-m", "regen.jobs.prompts", "--output-dir", str(out)]
    ok = subprocess.run(
        [*run, "--source", "builtin:demo", "--sample", "5"], capture_output=True, text=True, env=env
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout.splitlines()[-1])["rows"] == 5
    bad = subprocess.run([*run, "--source", str(tmp_path / "missing.jsonl")], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "error: source" in bad.stderr and "does not exist" in bad.stderr and "Traceback" not in bad.stderr


# ------------------------------------------------------------------------ length statistics (the budget)


def test_percentiles_are_nearest_rank():
    # 1..100: the p-th percentile is the value at rank ceil(p/100 x 100)
    assert P.percentiles(list(range(100, 0, -1))) == {"p50": 50, "p90": 90, "p99": 99, "max": 100}
    # 3 values: ranks ceil(1.5) = 2, ceil(2.7) = 3, ceil(2.97) = 3
    assert P.percentiles([7, 1, 4]) == {"p50": 4, "p90": 7, "p99": 7, "max": 7}
    assert P.percentiles([]) is None


def test_generated_turns_and_the_prompt_side_the_server_sees():
    conv = turns(("system", "s"), ("user", "a"), ("assistant", "old"), ("user", "b"))
    assert P.generated_turns(conv) == 2  # the old answer is regenerated, and one more after "b"
    assert P.prompt_view(conv) == turns(("system", "s"), ("user", "a"), ("assistant", ""), ("user", "b"))
    ends_with_answer = turns(("user", "a"), ("assistant", "x"))
    assert P.generated_turns(ends_with_answer) == 1
    assert P.prompt_view(ends_with_answer) == turns(("user", "a"))


def test_lengths_without_a_tokenizer_count_characters_and_bytes(tmp_path):
    src = write_jsonl(tmp_path / "src.jsonl", [
        {"id": "a", "conversations": turns(("user", "hello"))},                       # 5 chars
        {"id": "b", "conversations": turns(("system", "ab"), ("user", "é"))},           # 3 chars, 4 bytes
        {"id": "c", "conversations": turns(("user", "q"), ("assistant", "x"), ("user", "zz"))},  # 2 turns
    ])
    out = tmp_path / "out"
    result = build([str(src)], out)
    lengths = json.loads((out / "manifest.json").read_text())["lengths"]
    assert result["lengths"] == lengths
    assert lengths["rows"] == 3 and lengths["tokens"] is None
    assert lengths["tokens_reason"] == "no --tokenizer was given"
    assert lengths["chars"]["max"] == 5 and lengths["utf8_bytes"]["max"] == 5
    assert lengths["by_turns"] == [
        {"turns": 1, "rows": 2, "max_chars": 5, "max_utf8_bytes": 5, "max_tokens": None},
        {"turns": 2, "rows": 1, "max_chars": 3, "max_utf8_bytes": 3, "max_tokens": None},
    ]


def test_lengths_with_the_demo_tokenizer_are_its_chat_template_counts(tmp_path, demo_model_dir):
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    result = build(["builtin:demo"], out, tokenizer=demo_model_dir)
    lengths = result["lengths"]
    assert lengths["tokens_reason"].startswith("counted with the model's chat template")
    assert lengths["tokenizer"]["digest"]
    # every row recounted here, with the same tokenizer the job loads (trust_remote_code, as tokenize does)
    tok = AutoTokenizer.from_pretrained(str(demo_model_dir), trust_remote_code=True)
    _manifest, rows = read_set(out)
    counts = {}
    for row in rows:
        ids = tok.apply_chat_template(P.prompt_view(row["conversations"]), tokenize=True,
                                      add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        key = P.generated_turns(row["conversations"])
        counts[key] = max(counts.get(key, 0), len(ids))
    assert {g["turns"]: g["max_tokens"] for g in lengths["by_turns"]} == counts
    assert lengths["tokens"]["max"] == max(counts.values())
    assert sum(g["rows"] for g in lengths["by_turns"]) == lengths["rows"] == len(rows)


def test_the_tokenizer_is_part_of_the_fingerprint_and_old_sets_are_recounted(tmp_path, demo_model_dir):
    out = tmp_path / "out"
    plain = build(["builtin:demo"], out)
    counted = build(["builtin:demo"], out, tokenizer=demo_model_dir)
    assert counted["changed"] is True and counted["fingerprint"] != plain["fingerprint"]
    assert build(["builtin:demo"], out, tokenizer=demo_model_dir)["changed"] is False
    # a set written before the statistics existed (no `lengths` in its manifest) is rebuilt once
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["lengths"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    again = build(["builtin:demo"], out, tokenizer=demo_model_dir)
    assert again["changed"] is True and again["lengths"] == counted["lengths"]


def test_a_tokenizer_that_does_not_load_leaves_tokens_uncounted_with_the_reason(tmp_path):
    empty = tmp_path / "model"
    empty.mkdir()
    result = build(["builtin:demo"], tmp_path / "out", tokenizer=empty)
    assert result["lengths"]["tokens"] is None
    assert "holds no tokenizer files" in result["lengths"]["tokens_reason"]
    missing = build(["builtin:demo"], tmp_path / "out2", tokenizer=tmp_path / "nowhere")
    assert "is not a directory" in missing["lengths"]["tokens_reason"]


def test_the_same_question_with_an_old_answer_is_a_duplicate(tmp_path):
    # Issue 25: one copy of a user turn carried an old assistant turn and both were kept, so the target
    # would be asked the same thing twice. The trailing answer is regenerated; the question is the key.
    src = write_jsonl(
        tmp_path / "src.jsonl",
        [
            {"id": "a", "conversations": turns(("user", "same question"))},
            {"id": "b", "conversations": turns(("user", "same question"), ("assistant", "an old answer"))},
            # A later user turn asks something else, with the first answer in its context: kept.
            {
                "id": "c",
                "conversations": turns(("user", "same question"), ("assistant", "x"), ("user", "and then?")),
            },
        ],
    )
    out = tmp_path / "out"
    build([str(src)], out)
    manifest, rows = read_set(out)
    assert [r["id"] for r in rows] == ["a", "c"] and manifest["duplicates"] == 1
