"""The generation job in-process against the STUB server on loopback: turns, kwargs, faults, outputs."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from regen.jobs import generate as G
from regen.jobs._common import JobError
from regen.jobs._ledger import ShardStore
from regen.status import validate
from tests.helpers.stub_openai_server import StubConfig, StubServer


def turns(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


@pytest.fixture
def stub():
    with StubServer(StubConfig(record=True)) as s:
        yield s


def write_prompts(tmp_path: Path, rows) -> Path:
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def simple_prompts(tmp_path: Path, n: int) -> Path:
    return write_prompts(
        tmp_path, [{"id": f"p{i}", "conversations": turns(("user", f"question {i}"))} for i in range(n)]
    )


def settings(tmp_path: Path, urls, **kw) -> G.Settings:
    out = tmp_path / "out"
    base = dict(
        inputs=[str(tmp_path / "prompts.jsonl")],
        output_dir=out,
        endpoints=list(urls),
        model="m",
        concurrency=4,
        max_tokens=64,
        backoff_base=0.01,
        backoff_max=0.05,
        circuit_cooldown=0.05,
        circuit_cooldown_max=0.2,
        request_timeout=5.0,
        status_file=out / "status.json",
        fsync=False,
        seed=0,
    )
    base.update(kw)
    return G.Settings(**base)


def run(s: G.Settings) -> tuple[int, G.GenerateJob]:
    job = G.GenerateJob(s)
    return asyncio.run(job.run()), job


def records(out: Path, kind: str = "completions") -> dict[str, dict]:
    found: dict[str, dict] = {}
    for p in sorted(out.glob(f"{kind}-*.jsonl")):
        for raw in p.read_text().splitlines():
            rec = json.loads(raw)
            assert rec["id"] not in found, f"duplicate {rec['id']}"
            found[rec["id"]] = rec
    return found


def errors(out: Path) -> list[dict]:
    p = out / "errors.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def test_multi_turn_regenerates_each_assistant_turn_in_order(tmp_path, stub):
    write_prompts(
        tmp_path,
        [
            {
                "id": "mt",
                "conversations": turns(
                    ("system", "be brief"),
                    ("user", "first?"),
                    ("assistant", "SOURCE ANSWER"),
                    ("user", "second?"),
                ),
            }
        ],
    )
    code, _ = run(settings(tmp_path, [stub.url]))
    assert code == 0
    bodies = [r["body"] for r in stub.requests]
    assert len(bodies) == 2
    assert bodies[0]["messages"] == turns(("system", "be brief"), ("user", "first?"))
    reply1 = bodies[1]["messages"][2]["content"]
    assert reply1.startswith("stub reply 1 to: first?")
    assert bodies[1]["messages"] == turns(
        ("system", "be brief"), ("user", "first?"), ("assistant", reply1), ("user", "second?")
    )
    assert "SOURCE ANSWER" not in json.dumps(bodies)
    rec = records(tmp_path / "out")["mt"]
    assert [t["role"] for t in rec["conversations"]] == ["system", "user", "assistant", "user", "assistant"]
    assert rec["conversations"][4]["content"].startswith("stub reply 2 to: second?")
    assert [t["index"] for t in rec["turns"]] == [2, 4]
    assert rec["usage"]["completion_tokens"] == sum(t["completion_tokens"] for t in rec["turns"]) == 32
    assert rec["finish_reason"] == "stop" and rec["truncated"] is False and rec["model"] == "m"


def test_kwargs_and_sampling_are_sent_and_reasoning_is_captured(tmp_path, stub):
    stub.configure(reasoning="when_thinking")
    simple_prompts(tmp_path, 3)
    s = settings(
        tmp_path,
        [stub.url],
        chat_template_kwargs={"thinking": True},
        temperature=0.6,
        top_p=0.9,
        extra_body={"top_k": 20},
        api_key="sekret",
    )
    assert run(s)[0] == 0
    for req in stub.requests:
        body = req["body"]
        assert body["chat_template_kwargs"] == {"thinking": True}
        assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"]) == (0.6, 0.9, 20, 64)
        assert req["authorization"] == "Bearer sekret"
    rec = records(tmp_path / "out")["p0"]
    assert rec["conversations"][1]["reasoning_content"].startswith("stub reasoning about: question 0")
    assert rec["provenance"]["chat_template_kwargs"] == {"thinking": True}
    assert rec["provenance"]["sampling"] == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}


def test_no_kwargs_no_extra_fields_and_inline_reasoning(tmp_path, stub):
    stub.configure(reasoning="always")
    simple_prompts(tmp_path, 1)
    assert run(settings(tmp_path, [stub.url], reasoning="inline"))[0] == 0
    assert set(stub.requests[0]["body"]) == {"model", "max_tokens", "messages"}
    content = records(tmp_path / "out")["p0"]["conversations"][1]["content"]
    assert content.startswith("<think>stub reasoning about: question 0</think>stub reply 1")


def test_transient_errors_are_retried(tmp_path, stub):
    stub.configure(fail_first=2, fail_kind="500")
    simple_prompts(tmp_path, 5)
    code, job = run(settings(tmp_path, [stub.url], circuit_threshold=100))
    assert code == 0
    recs = records(tmp_path / "out")
    assert len(recs) == 5 and all(r["turns"][0]["attempts"] == 3 for r in recs.values())
    assert job.stats.retries == 10 and errors(tmp_path / "out") == []


@pytest.mark.parametrize("kind", ["reset", "malformed", "503", "stall"])
def test_each_fault_kind_recovers(tmp_path, stub, kind):
    stub.configure(fail_first=1, fail_kind=kind, stall_seconds=30)
    simple_prompts(tmp_path, 4)
    code, _ = run(settings(tmp_path, [stub.url], request_timeout=0.5, circuit_threshold=100))
    assert code == 0 and len(records(tmp_path / "out")) == 4


def test_retry_after_is_honoured(tmp_path, stub):
    stub.configure(fail_first=1, fail_kind="429", retry_after=0.4)
    simple_prompts(tmp_path, 1)
    t0 = time.monotonic()
    assert run(settings(tmp_path, [stub.url]))[0] == 0
    # the only reason to wait this long is the server's Retry-After (backoff here is <= 50 ms)
    assert time.monotonic() - t0 >= 0.4
    assert stub.stats["fault_429"] == 1 and stub.stats["ok"] == 1


def test_client_errors_fail_at_once_and_are_retried_by_the_next_run(tmp_path, stub):
    stub.configure(error_rate=1.0, error_status=[400])
    simple_prompts(tmp_path, 2)
    code, _ = run(settings(tmp_path, [stub.url]))
    assert code == G.EXIT_FAILED_RECORDS
    errs = errors(tmp_path / "out")
    assert sorted(e["id"] for e in errs) == ["p0", "p1"]
    assert all(e["status"] == 400 and e["attempts"] == 1 and "HTTP 400" in e["error"] for e in errs)
    status = json.loads((tmp_path / "out" / "status.json").read_text())
    assert status["state"] == "failed" and status["failed"] == 2 and status["exit_code"] == 1
    stub.configure(error_rate=0.0)
    code, _ = run(settings(tmp_path, [stub.url]))
    assert code == 0 and len(records(tmp_path / "out")) == 2
    assert errors(tmp_path / "out") == [] and (tmp_path / "out" / "errors.previous.jsonl").exists()


def test_exhausted_retries_end_in_errors(tmp_path, stub):
    stub.configure(error_rate=1.0, error_status=[503])
    simple_prompts(tmp_path, 1)
    code, _ = run(settings(tmp_path, [stub.url], max_retries=2, max_outage=30))
    assert code == 1
    (err,) = errors(tmp_path / "out")
    assert err["error"].startswith("gave up after") and "HTTP 503" in err["error"]


def test_truncated_completions_kept_or_dropped(tmp_path, stub):
    simple_prompts(tmp_path, 3)
    assert run(settings(tmp_path, [stub.url], max_tokens=4))[0] == 0
    kept = records(tmp_path / "out")
    assert all(r["truncated"] and r["finish_reason"] == "length" for r in kept.values()) and len(kept) == 3

    s = settings(
        tmp_path,
        [stub.url],
        max_tokens=4,
        truncated="drop",
        output_dir=tmp_path / "drop",
        status_file=tmp_path / "drop" / "status.json",
    )
    code, job = run(s)
    assert code == 0 and records(tmp_path / "drop") == {}
    assert set(records(tmp_path / "drop", "dropped")) == {"p0", "p1", "p2"}
    assert job.stats.dropped == 3
    # dropped prompts count as done: the next run does not ask for them again
    before = len(stub.requests)
    code, job = run(s)
    assert code == 0 and len(stub.requests) == before and job.stats.skipped == 3


def test_circuit_pauses_while_the_endpoint_is_down_without_spending_retries(tmp_path, stub):
    stub.configure(down=True, down_mode="reset")
    simple_prompts(tmp_path, 6)
    timer = threading.Timer(1.0, stub.configure, kwargs={"down": False})
    timer.start()
    try:
        code, job = run(
            settings(tmp_path, [stub.url], max_retries=2, circuit_cooldown=0.1, circuit_cooldown_max=0.2)
        )
    finally:
        timer.cancel()
    # 2 retries would be gone in ~0.1 s of backoff; the circuit held the prompts for the whole second
    assert code == 0 and len(records(tmp_path / "out")) == 6
    assert job.pool.outage_seconds() > 0.5
    assert stub.stats["fault_reset"] < 40  # paused, not hammering the dead server


def test_outage_longer_than_the_limit_stops_the_job_without_errors(tmp_path, stub):
    stub.configure(down=True)
    simple_prompts(tmp_path, 3)
    code, _ = run(settings(tmp_path, [stub.url], max_outage=0.5))
    assert code == G.EXIT_UNAVAILABLE
    assert errors(tmp_path / "out") == [] and records(tmp_path / "out") == {}
    status = json.loads((tmp_path / "out" / "status.json").read_text())
    assert status["state"] == "endpoints_down"
    # the prompts were not spent: a run after the outage does them all
    stub.configure(down=False)
    assert run(settings(tmp_path, [stub.url]))[0] == 0 and len(records(tmp_path / "out")) == 3


def test_a_dead_endpoint_among_several_is_routed_around(tmp_path, stub):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening: connection refused
        simple_prompts(tmp_path, 20)
        code, job = run(settings(tmp_path, [dead, stub.url], max_retries=3))
    assert code == 0 and len(records(tmp_path / "out")) == 20
    dead_ep, live_ep = job.pool.endpoints
    assert dead_ep.ok == 0 and dead_ep.state != "closed" and live_ep.ok >= 20


def test_several_endpoints_share_the_load(tmp_path):
    with StubServer(StubConfig(delay=0.02)) as a, StubServer(StubConfig(delay=0.02)) as b:
        simple_prompts(tmp_path, 40)
        code, _ = run(settings(tmp_path, [a.url, b.url], concurrency=2))
        assert code == 0
        assert a.stats["ok"] >= 10 and b.stats["ok"] >= 10 and a.stats["ok"] + b.stats["ok"] == 40


def test_duplicate_ids_and_bad_rows_in_the_input(tmp_path, stub):
    write_prompts(
        tmp_path,
        [
            {"id": "a", "conversations": turns(("user", "q"))},
            {"id": "a", "conversations": turns(("user", "q"))},
            "{broken",
            {"id": "t", "conversations": [{"role": "tool", "content": "x"}]},
        ],
    )
    code, job = run(settings(tmp_path, [stub.url]))
    assert code == 1
    assert list(records(tmp_path / "out")) == ["a"] and job.stats.duplicates + job.stats.skipped == 1
    reasons = sorted(e["error"] for e in errors(tmp_path / "out"))
    assert reasons[0].startswith("invalid input row: not JSON")
    assert "role 'tool'" in reasons[1]
    assert stub.stats["ok"] == 1


def test_resume_skips_done_prompts(tmp_path, stub):
    simple_prompts(tmp_path, 10)
    assert run(settings(tmp_path, [stub.url]))[0] == 0
    n = len(stub.requests)
    simple_prompts(tmp_path, 15)
    code, job = run(settings(tmp_path, [stub.url]))
    assert code == 0 and job.stats.skipped == 10 and job.stats.done == 5
    assert len(stub.requests) == n + 5 and len(records(tmp_path / "out")) == 15


def test_changed_settings_are_refused_unless_allowed(tmp_path, stub):
    simple_prompts(tmp_path, 1)
    assert run(settings(tmp_path, [stub.url]))[0] == 0
    with pytest.raises(JobError, match=r"max_tokens: 64 -> 65.*--allow-config-change to generate them again"):
        run(settings(tmp_path, [stub.url], max_tokens=65))
    assert run(settings(tmp_path, [stub.url], max_tokens=65, allow_config_change=True))[0] == 0


def aside_lines(out: Path) -> list[dict]:
    path = out / "superseded.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": 65},
        {"temperature": 0.7},
        {"chat_template_kwargs": {"thinking": True}},
        {"model": "other-model"},
        {"reasoning": "inline"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_changed_answer_settings_regenerate_and_move_the_old_completions_aside(tmp_path, stub, change):
    simple_prompts(tmp_path, 3)
    assert run(settings(tmp_path, [stub.url]))[0] == 0
    before = records(tmp_path / "out")
    sent = len(stub.requests)
    changed = settings(tmp_path, [stub.url], allow_config_change=True, **change)
    assert G.dry_run(changed)["complete"] is False and G.dry_run(changed)["pending"] == 3
    code, job = run(changed)
    assert code == 0 and job.stats.done == 3 and len(stub.requests) == sent + 3, "all three made again"
    after = records(tmp_path / "out")
    assert sorted(after) == ["p0", "p1", "p2"]
    assert all(after[i]["settings_key"] != before[i]["settings_key"] for i in after)
    moved = aside_lines(tmp_path / "out")
    assert sorted((m["reason"], m["record"]["id"]) for m in moved) == [
        ("settings_changed", i) for i in ("p0", "p1", "p2")
    ]
    assert [m["record"] for m in sorted(moved, key=lambda m: m["record"]["id"])] == [
        before[i] for i in ("p0", "p1", "p2")
    ]
    status = json.loads((tmp_path / "out" / "status.json").read_text())
    assert (status["settings_changed"], status["superseded"], status["state"]) == (3, 0, "done")
    # the same settings again: nothing moves, nothing is sent
    code, job = run(settings(tmp_path, [stub.url], **change))
    assert code == 0 and job.stats.skipped == 3 and len(stub.requests) == sent + 3
    assert len(aside_lines(tmp_path / "out")) == 3 and G.dry_run(changed)["complete"] is True


def test_a_settings_change_that_is_refused_changes_nothing(tmp_path, stub):
    simple_prompts(tmp_path, 2)
    assert run(settings(tmp_path, [stub.url]))[0] == 0
    out = tmp_path / "out"
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name.startswith(("completions", "run"))}
    with pytest.raises(JobError, match=r"the 2 completion\(s\) there move to superseded.jsonl"):
        run(settings(tmp_path, [stub.url], temperature=1.0))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in before} == before
    assert aside_lines(out) == []


def test_a_kill_before_the_move_leaves_the_old_completions_to_the_next_run(tmp_path, stub, monkeypatch):
    """Killed after the settings check, before the old completions moved aside: the next run must still
    move them (run.json may not claim the new settings before the directory holds only their records)."""
    simple_prompts(tmp_path, 2)
    assert run(settings(tmp_path, [stub.url]))[0] == 0

    def killed(self, reason_for, aside):
        raise KeyboardInterrupt  # stands in for a SIGKILL just before the move

    monkeypatch.setattr(ShardStore, "move_aside", killed)
    with pytest.raises(KeyboardInterrupt):
        run(settings(tmp_path, [stub.url], max_tokens=8, allow_config_change=True))
    monkeypatch.undo()
    code, job = run(settings(tmp_path, [stub.url], max_tokens=8, allow_config_change=True))
    assert code == 0 and job.stats.done == 2
    assert all(r["provenance"]["max_tokens"] == 8 for r in records(tmp_path / "out").values())
    assert len(aside_lines(tmp_path / "out")) == 2, "each old completion is listed once"


def test_a_truncation_policy_change_applies_to_new_completions_only(tmp_path, stub):
    simple_prompts(tmp_path, 2)
    assert run(settings(tmp_path, [stub.url]))[0] == 0
    sent = len(stub.requests)
    with pytest.raises(JobError, match=r"truncated: 'keep' -> 'drop'.*apply the new truncation policy"):
        run(settings(tmp_path, [stub.url], truncated="drop"))
    code, job = run(settings(tmp_path, [stub.url], truncated="drop", allow_config_change=True))
    assert code == 0 and job.stats.skipped == 2 and len(stub.requests) == sent
    assert aside_lines(tmp_path / "out") == []


def test_status_file_and_dry_run(tmp_path, stub):
    simple_prompts(tmp_path, 4)
    s = settings(tmp_path, [stub.url])
    assert G.dry_run(s) == {
        "total": 4,
        "pending": 4,
        "done": 0,
        "unreadable": 0,
        "invalid": 0,
        "duplicates": 0,
        "complete": False,
        "inputs_changed": False,
        "config_matches": True,
        "output_dir": str(s.output_dir),
    }
    assert not s.output_dir.exists()  # a dry run writes nothing
    assert run(s)[0] == 0
    status = json.loads(s.status_file.read_text())
    assert (status["state"], status["done"], status["total"], status["exit_code"]) == ("done", 4, 4, 0)
    assert validate(status) == [], "the status file follows the jobs' one schema"
    assert status["latency_p50_s"] > 0 and status["line"].startswith("generate: state=done done=4")
    assert status["endpoints"][0]["ok"] == 4
    assert G.dry_run(s)["complete"] is True
    assert G.dry_run(settings(tmp_path, [stub.url], max_tokens=1))["config_matches"] is False


# -- the rolling degeneration stop (regen.quality.detector) --------------------------------------------


def _garbage(name: str) -> str:
    """A real degenerate output quoted in a public issue (tests/fixtures/quality/outputs.json)."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "quality" / "outputs.json"
    return next(o["text"] for o in json.loads(fixture.read_text())["garbage"] if o["id"] == name)


def test_a_server_answering_garbage_stops_the_job_and_keeps_what_it_wrote(tmp_path):
    plus = _garbage("sglang-24321-nvfp4-plus")  # "+" x 50, SGLang on sm_120 with NVFP4
    simple_prompts(tmp_path, 60)
    with StubServer(StubConfig(replies={"question": plus}, delay=0.01)) as srv:
        s = settings(tmp_path, [srv.url], concurrency=1, degenerate_window=10, degenerate_threshold=0.5,
                     degenerate_min_samples=5)
        code, _ = run(s)
    assert code == 3  # EXIT_UNAVAILABLE: the server is unusable as it is
    status = json.loads((s.output_dir / "status.json").read_text())
    validate(status)
    assert status["state"] == "failed" and status["exit_code"] == 3
    assert "completions are degenerate" in status["error"] and "one_token_repeated" in status["error"]
    assert status["degeneration"]["tripped"] is True
    kept = records(s.output_dir)
    # It stopped early (the first judged window), and every record it wrote is flagged, none torn.
    assert 5 <= len(kept) < 60
    assert all(r["quality"] and "one_token_repeated" in r["quality"][0] for r in kept.values())
    # The rest stays pending: a re-run against a fixed server finishes the set without doubles.
    with StubServer(StubConfig()) as fixed:
        code, _ = run(settings(tmp_path, [fixed.url], degenerate_window=10, degenerate_threshold=0.5,
                               degenerate_min_samples=5))
    assert code == 0
    assert sorted(records(s.output_dir)) == sorted(f"p{i}" for i in range(60))


def test_a_few_odd_answers_do_not_stop_a_healthy_run(tmp_path):
    simple_prompts(tmp_path, 30)
    # Two of thirty answers degenerate (7%): under the 20% threshold, kept and flagged, the run finishes.
    replies = {"question 3": _garbage("sglang-24321-nvfp4-plus"), "question 17": ""}
    with StubServer(StubConfig(replies=replies)) as srv:
        s = settings(tmp_path, [srv.url], degenerate_window=30, degenerate_min_samples=5)
        code, _ = run(s)
    assert code == 0
    kept = records(s.output_dir)
    assert len(kept) == 30
    assert {rid for rid, r in kept.items() if r.get("quality")} == {"p3", "p17"}
    status = json.loads((s.output_dir / "status.json").read_text())
    assert status["degeneration"]["degenerate_total"] == 2 and status["degeneration"]["tripped"] is False


def test_degeneration_settings_that_cannot_work_are_refused():
    from regen.jobs.generate.cli import build_parser, settings_from_args

    parser = build_parser()
    args = parser.parse_args(["--input", "x", "--output-dir", "o", "--endpoint", "http://127.0.0.1:1",
                              "--model", "m", "--degenerate-threshold", "1.5"])
    with pytest.raises(JobError, match="--degenerate-threshold"):
        settings_from_args(args)


def test_a_first_run_builds_no_map_of_prompt_keys_and_an_edited_set_is_reconciled(
    tmp_path, stub, monkeypatch
):
    # With no completion in the directory none can be stale: the map of every prompt's key (a JSON parse
    # and ~200 bytes per prompt, held at once) is not built. Once there are completions, an edited prompt
    # set is reconciled as before.
    from regen.jobs.generate import job as job_module

    built = []
    real = job_module.input_keys

    def counted(files):
        built.append(files)
        return real(files)

    monkeypatch.setattr(job_module, "input_keys", counted)
    simple_prompts(tmp_path, 5)
    code, _ = run(settings(tmp_path, [stub.url]))
    assert code == 0 and len(records(tmp_path / "out")) == 5
    assert built == []
    write_prompts(
        tmp_path,
        [
            {"id": f"p{i}", "conversations": turns(("user", f"question {i}{'!' if i == 2 else ''}"))}
            for i in range(5)
        ],
    )
    code, job = run(settings(tmp_path, [stub.url]))
    assert code == 0 and len(built) == 1
    assert job._moved and len(records(tmp_path / "out")) == 5
