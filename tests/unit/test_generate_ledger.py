"""The exactly-once store: id index, and recovery from every state a kill or a power loss can leave."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from regen.jobs._common import JobError
from regen.jobs._ledger import LEDGER_NAME, RECORD, IdIndex, ShardStore, id_digest, line_id


def line(rid: str, text: str = "x") -> bytes:
    return json.dumps({"id": rid, "conversations": [{"role": "user", "content": text}]}).encode()


def write_records(directory: Path, ids, kind: int = 0, **kw) -> ShardStore:
    store = ShardStore(directory, **kw)
    store.open()
    store.append([(kind, id_digest(i), line(i)) for i in ids])
    store.close()
    return store


def reopen(directory: Path, **kw) -> ShardStore:
    store = ShardStore(directory, **kw)
    store.open()
    return store


def shard_ids(directory: Path, kind: str = "completions") -> list[str]:
    out = []
    for p in sorted(directory.glob(f"{kind}-*.jsonl")):
        out += [json.loads(x)["id"] for x in p.read_bytes().splitlines()]
    return out


def test_line_id_fast_path_and_fallbacks():
    assert line_id(b'{"id": "abc", "x": 1}') == "abc"
    assert line_id(b'{"x": 1, "id": "late"}') == "late"
    assert line_id(b'{"id": "q\\"uote"}') == 'q"uote'
    assert line_id(b'{"id": 42}') == "42"
    assert line_id(b'{"id": true}') is None
    assert line_id(b'{"id": "torn') is None
    assert line_id(b"[1]") is None


def test_index_contains_many_with_bulk_and_recent_ids():
    idx = IdIndex()
    bulk = [id_digest(f"b{i}") for i in range(1000)]
    from regen.jobs._ledger import _split_digests

    hi, lo = _split_digests(bulk)
    idx.load(hi, lo)
    idx.add(id_digest("new"))
    probe = [id_digest("b5"), id_digest("nope"), id_digest("new"), id_digest("b999")]
    assert idx.contains_many(probe) == [True, False, True, True]
    assert [d in idx for d in probe] == [True, False, True, True]
    assert len(idx) == 1001


def test_index_handles_equal_high_halves():
    # two digests sharing their first 8 bytes (astronomically rare for real ids, but must stay exact)
    a = bytes(8) + (1).to_bytes(8, "big")
    b = bytes(8) + (2).to_bytes(8, "big")
    c = bytes(8) + (3).to_bytes(8, "big")
    idx = IdIndex()
    hi = np.array([0, 0], dtype="<u8")
    lo = np.array([1, 2], dtype="<u8")
    idx.load(hi, lo)
    assert idx.contains_many([a, b, c]) == [True, True, False]
    assert (a in idx, c in idx) == (True, False)


def test_index_compaction_keeps_every_id():
    idx = IdIndex()
    ids = [id_digest(str(i)) for i in range(3000)]
    for d in ids[:1500]:
        idx.add(d)
    idx._compact()
    for d in ids[1500:]:
        idx.add(d)
    assert all(idx.contains_many(ids))
    assert not any(idx.contains_many([id_digest(f"x{i}") for i in range(100)]))


def test_append_reopen_and_rotation(tmp_path):
    write_records(tmp_path, [f"a{i}" for i in range(7)], shard_records=3)
    assert len(list(tmp_path.glob("completions-*.jsonl"))) == 3
    store = reopen(tmp_path, shard_records=3)
    assert store.report.ledger_records == 7 and store.report.recovered_lines == 0
    assert all(store.index.contains_many([id_digest(f"a{i}") for i in range(7)]))
    # a new run appends to a new shard, never into an old one
    store.append([(0, id_digest("b"), line("b"))])
    store.close()
    assert shard_ids(tmp_path) == [f"a{i}" for i in range(7)] + ["b"]
    assert reopen(tmp_path).report.done_by_kind == {"completions": 8, "dropped": 0}


def test_torn_last_line_is_cut_and_the_rest_kept(tmp_path):
    write_records(tmp_path, ["a", "b"])
    shard = next(tmp_path.glob("completions-*.jsonl"))
    with open(shard, "ab") as fh:  # a kill in the middle of a write: half a line, no newline
        fh.write(line("c")[:17])
    store = reopen(tmp_path)
    assert store.report.truncated_bytes == 17
    assert shard_ids(tmp_path) == ["a", "b"]
    assert store.index.contains_many([id_digest("c")]) == [False]
    store.close()


def test_lines_written_before_their_ledger_records_are_recovered(tmp_path):
    write_records(tmp_path, ["a"])
    shard = next(tmp_path.glob("completions-*.jsonl"))
    with open(shard, "ab") as fh:  # killed after the shard write, before the ledger write
        fh.write(line("b") + b"\n" + line("c") + b"\n")
    store = reopen(tmp_path)
    assert store.report.recovered_lines == 2
    assert all(store.index.contains_many([id_digest(x) for x in "abc"]))
    store.close()
    # and the ledger now knows them: the next open has nothing to recover
    again = reopen(tmp_path)
    assert again.report.recovered_lines == 0 and again.report.ledger_records == 3
    again.close()


def test_garbage_line_after_good_ones_is_cut(tmp_path):
    write_records(tmp_path, ["a"])
    shard = next(tmp_path.glob("completions-*.jsonl"))
    with open(shard, "ab") as fh:
        fh.write(line("b") + b"\n" + b"\x00\x00\x00\x00\n" + line("c") + b"\n")
    store = reopen(tmp_path)
    # everything from the first bad line on is discarded; those records are simply generated again
    assert shard_ids(tmp_path) == ["a", "b"]
    assert store.index.contains_many([id_digest(x) for x in "abc"]) == [True, True, False]
    store.close()


def test_torn_ledger_record_and_deleted_ledger(tmp_path):
    write_records(tmp_path, ["a", "b", "c"])
    ledger = tmp_path / LEDGER_NAME
    size = ledger.stat().st_size
    with open(ledger, "r+b") as fh:
        fh.truncate(size - 10)  # last record torn
    store = reopen(tmp_path)
    assert store.report.ledger_records == 2 and store.report.recovered_lines == 1
    store.close()
    assert ledger.stat().st_size == size
    ledger.unlink()
    rebuilt = reopen(tmp_path)
    assert rebuilt.report.recovered_lines == 3
    assert all(rebuilt.index.contains_many([id_digest(x) for x in "abc"]))
    rebuilt.close()


def test_ledger_ahead_of_the_data_is_cut_back(tmp_path):
    # a power loss can persist ledger records whose shard bytes never reached the disk
    write_records(tmp_path, ["a", "b", "c"])
    shard = next(tmp_path.glob("completions-*.jsonl"))
    first = shard.read_bytes().split(b"\n")[0] + b"\n"
    shard.write_bytes(first)
    store = reopen(tmp_path)
    assert store.report.ledger_dropped == 2
    assert store.index.contains_many([id_digest(x) for x in "abc"]) == [True, False, False]
    store.close()
    raw = np.fromfile(tmp_path / LEDGER_NAME, dtype=RECORD, offset=32)
    assert len(raw) == 1


def test_records_pointing_at_a_missing_shard_are_dropped(tmp_path):
    write_records(tmp_path, ["a"])
    write_records(tmp_path, ["b"])
    shards = sorted(tmp_path.glob("completions-*.jsonl"))
    shards[1].unlink()
    store = reopen(tmp_path)
    assert store.index.contains_many([id_digest("a"), id_digest("b")]) == [True, False]
    store.close()


def test_empty_shard_left_by_a_kill_is_removed(tmp_path):
    write_records(tmp_path, ["a"])
    (tmp_path / "completions-00007.jsonl").write_bytes(b"")
    store = reopen(tmp_path)
    assert store.report.removed_files == ["completions-00007.jsonl"]
    store.close()


def test_read_only_open_reports_without_touching_files(tmp_path):
    write_records(tmp_path, ["a"])
    shard = next(tmp_path.glob("completions-*.jsonl"))
    with open(shard, "ab") as fh:
        fh.write(line("b") + b"\n" + b'{"id": "c", "tor')
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    store = ShardStore(tmp_path, read_only=True)
    store.open()
    assert store.index.contains_many([id_digest(x) for x in "abc"]) == [True, True, False]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    with pytest.raises(RuntimeError):
        store.append([(0, id_digest("d"), line("d"))])


def test_second_writer_is_refused(tmp_path):
    first = reopen(tmp_path)
    with pytest.raises(JobError, match=rf"another generate job \(pid {os.getpid()}\) is writing"):
        reopen(tmp_path)
    first.close()
    reopen(tmp_path).close()  # released on close (and by the kernel when a process dies)


def test_dropped_kind_is_a_separate_file_and_counts_as_done(tmp_path):
    store = reopen(tmp_path)
    store.append([(0, id_digest("a"), line("a")), (1, id_digest("t"), line("t"))])
    store.close()
    assert shard_ids(tmp_path) == ["a"] and shard_ids(tmp_path, "dropped") == ["t"]
    again = reopen(tmp_path)
    assert again.report.done_by_kind == {"completions": 1, "dropped": 1}
    assert all(again.index.contains_many([id_digest("a"), id_digest("t")]))
    again.close()


def _doomed(ids):
    wanted = {i.encode() for i in ids}

    def reason(raw: bytes):
        return "orphaned" if line_id(raw).encode() in wanted else None

    return reason


def test_move_aside_keeps_the_rest_and_rebuilds_the_ledger(tmp_path):
    write_records(tmp_path, [f"r{i}" for i in range(6)], shard_records=4)
    store = reopen(tmp_path, shard_records=4)
    counts = store.move_aside(_doomed({"r1", "r4", "r5"}), tmp_path / "aside.jsonl")
    assert counts == {"orphaned": 3}
    assert sorted(shard_ids(tmp_path)) == ["r0", "r2", "r3"]
    assert id_digest("r1") not in store.index and id_digest("r2") in store.index
    store.append([(0, id_digest("r9"), line("r9"))])  # the store writes on as before
    store.close()
    aside = [json.loads(x) for x in (tmp_path / "aside.jsonl").read_text().splitlines()]
    assert [(a["reason"], a["record"]["id"]) for a in aside] == [("orphaned", i) for i in ("r1", "r4", "r5")]
    again = reopen(tmp_path, read_only=True)
    assert sorted(again.index.contains_many([id_digest(f"r{i}") for i in (0, 1, 2, 3, 9)])) == [
        False,
        True,
        True,
        True,
        True,
    ]


def test_a_kill_inside_move_aside_loses_nothing_and_the_next_move_finishes_it(tmp_path, monkeypatch):
    write_records(tmp_path, [f"r{i}" for i in range(6)], shard_records=4)
    store = reopen(tmp_path, shard_records=4)

    real_replace = os.replace

    def killed(src, dst):
        if str(src).endswith(".rewrite.tmp"):
            raise KeyboardInterrupt  # stands in for a SIGKILL after the ledger is gone, before any rewrite
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        store.move_aside(_doomed({"r1"}), tmp_path / "aside.jsonl")
    monkeypatch.undo()
    store.close()
    assert not (tmp_path / LEDGER_NAME).exists()
    store = reopen(tmp_path, shard_records=4)  # the ledger is rebuilt from the untouched shards
    assert sorted(shard_ids(tmp_path)) == [f"r{i}" for i in range(6)]
    assert store.move_aside(_doomed({"r1"}), tmp_path / "aside.jsonl") == {"orphaned": 1}
    store.close()
    assert sorted(shard_ids(tmp_path)) == ["r0", "r2", "r3", "r4", "r5"]
    assert aside_ids(tmp_path / "aside.jsonl") == ["r1"], "listed once, though the first move wrote it"
    assert not store.move_aside_pending(tmp_path / "aside.jsonl")


def aside_ids(path: Path) -> list[str]:
    return [json.loads(x)["record"]["id"] for x in path.read_bytes().splitlines()]


def test_a_kill_between_two_shard_rewrites_lists_every_moved_record_once(tmp_path, monkeypatch):
    write_records(tmp_path, [f"r{i}" for i in range(8)], shard_records=4)
    aside = tmp_path / "aside.jsonl"
    aside.write_bytes(b'{"reason": "orphaned", "shard": "x", "record": {"id": "earlier"}}\n')
    store = reopen(tmp_path, shard_records=4)
    real_replace = os.replace
    calls: list = []

    def killed_on_the_second(src, dst):
        if str(src).endswith(".rewrite.tmp"):
            calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt  # one shard rewritten, the other not yet
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        store.move_aside(_doomed({"r1", "r6"}), aside)
    monkeypatch.undo()
    store.close()
    assert store.move_aside_pending(aside)
    assert sorted(shard_ids(tmp_path)) == ["r0", "r2", "r3", "r4", "r5", "r6", "r7"]
    # the next run's prompt set moves one more record: appended once, the rest not again
    store = reopen(tmp_path, shard_records=4)
    assert store.move_aside(_doomed({"r1", "r6", "r7"}), aside) == {"orphaned": 2}
    store.close()
    assert sorted(shard_ids(tmp_path)) == ["r0", "r2", "r3", "r4", "r5"]
    assert aside_ids(aside) == ["earlier", "r1", "r6", "r7"]
    assert not store.move_aside_pending(aside)


def test_a_kill_while_appending_to_the_aside_file_leaves_no_torn_line(tmp_path, monkeypatch):
    write_records(tmp_path, [f"r{i}" for i in range(4)])
    aside = tmp_path / "aside.jsonl"
    store = reopen(tmp_path)
    from regen.jobs import _ledger

    def torn(fd, data):
        os.write(fd, data[: len(data) // 2 + 3])  # half of what was to be appended reached the disk
        raise KeyboardInterrupt

    monkeypatch.setattr(_ledger, "write_all", torn)
    with pytest.raises(KeyboardInterrupt):
        store.move_aside(_doomed({"r0", "r1", "r2"}), aside)
    monkeypatch.undo()
    store.close()
    assert not aside.read_bytes().endswith(b"\n")
    store = reopen(tmp_path)
    assert store.move_aside(_doomed({"r0", "r1", "r2"}), aside) == {"orphaned": 3}
    store.close()
    assert aside_ids(aside) == ["r0", "r1", "r2"] and shard_ids(tmp_path) == ["r3"]


def test_a_torn_line_left_in_the_aside_file_by_an_older_run_is_cut_before_appending(tmp_path):
    write_records(tmp_path, ["a", "b"])
    aside = tmp_path / "aside.jsonl"
    aside.write_bytes(b'{"reason": "orphaned", "shard": "x", "record": {"id": "old"}}\n{"reason": "orph')
    store = reopen(tmp_path)
    store.move_aside(_doomed({"a"}), aside)
    store.close()
    assert aside_ids(aside) == ["old", "a"]


def test_index_merges_this_runs_ids_into_sorted_arrays_and_keeps_every_one(monkeypatch):
    import numpy as np

    from regen.jobs import _ledger
    from regen.jobs._ledger import _split_digests

    monkeypatch.setattr(_ledger, "_RECENT_IDS", 64)  # many merges from a few hundred ids
    idx = IdIndex()
    bulk = [id_digest(f"b{i}") for i in range(300)]
    idx.load(*_split_digests(bulk))
    added = [id_digest(f"n{i}") for i in range(1000)]
    for digest in added:
        idx.add(digest)
    assert len(idx._recent) < 64 and len(idx) == 1300
    assert bool(np.all(idx._hi[1:] >= idx._hi[:-1]))  # still sorted: lookups bisect it
    probe = bulk + added + [id_digest(f"x{i}") for i in range(200)]
    assert idx.contains_many(probe) == [True] * 1300 + [False] * 200
    assert all(d in idx for d in bulk[::7] + added[::7])
