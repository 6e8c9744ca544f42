"""Event parsing over ansible-runner streams recorded from real runs (tests/fixtures/events/record.py).

The streams come from the fixture pipeline (tests/fixtures/playbooks/runner): a first run, a second run,
a check-mode run on a fresh directory, a failing task, a secret printed by mistake, an unreachable host
and a run cancelled in the middle of a task.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from regen.runner import (
    ExitCode,
    FactsProduced,
    JobProgress,
    NoHostsMatched,
    RunStats,
    StageFinished,
    StageStarted,
    TaskResult,
    TaskRetry,
    TaskStarted,
    TaskStatus,
    discover_stages,
    parse_events,
    summarize,
)
from regen.runner.events import EventParser, failure_message, host_stats, strip_ansi
from regen.runner.secrets import MASK
from regen.runner.stages import play_stage_map

ROOT = Path(__file__).resolve().parents[2]
EVENTS = ROOT / "tests" / "fixtures" / "events"
PROJECT = ROOT / "tests" / "fixtures" / "playbooks" / "runner"
STAGES = discover_stages(PROJECT)
PLAYS = play_stage_map(STAGES)
PIPELINE = ["demo_model", "introspect", "generate"]


def raw(name: str) -> list[dict]:
    return [json.loads(line) for line in (EVENTS / f"{name}.jsonl").read_text().splitlines() if line.strip()]


def records(name: str, selected: list[str] | None = None) -> list:
    return parse_events(raw(name), PLAYS, selected)


def of(kind: type, recs: list) -> list:
    return [r for r in recs if isinstance(r, kind)]


def test_the_fixture_pipeline_has_the_stages_the_streams_were_recorded_with() -> None:
    assert [s.name for s in STAGES if not s.standalone] == PIPELINE
    assert {s.name: s.tag for s in STAGES} == {
        "demo_model": "demo",
        "introspect": "introspect",
        "generate": "generate",
        "teardown": "teardown",
    }


def test_stages_start_and_finish_in_pipeline_order() -> None:
    recs = records("success")
    starts = [r.stage for r in of(StageStarted, recs)]
    finishes = [r.stage for r in of(StageFinished, recs)]
    assert starts == PIPELINE
    assert finishes == PIPELINE
    # every stage finishes before the next one starts
    order = [(type(r).__name__, r.stage) for r in recs if isinstance(r, StageStarted | StageFinished)]
    assert order == [(kind, stage) for stage in PIPELINE for kind in ("StageStarted", "StageFinished")]


def test_task_results_carry_their_stage_and_exclusive_counts_add_up() -> None:
    recs = records("success")
    results = of(TaskResult, recs)
    assert results, "no task results parsed"
    for finished in of(StageFinished, recs):
        mine = [r for r in results if r.stage == finished.stage]
        assert finished.counts.total == len(mine), finished
    demo = next(r for r in of(StageFinished, recs) if r.stage == "demo_model")
    assert (demo.counts.changed, demo.counts.skipped, demo.counts.ignored) == (2, 1, 1)
    ignored = [r for r in results if r.ignored]
    assert [r.task for r in ignored] == ["Note that the fixture has no GPU (a failure the play ignores)"]
    assert ignored[0].message == "no GPU on the fixture host"


def test_a_rescued_failure_is_not_the_runs_failure() -> None:
    recs = records("success")
    rescued = [r for r in of(TaskResult, recs) if r.status is TaskStatus.FAILED and not r.ignored]
    assert [r.task for r in rescued] == ["Read generation_config.json (the fixture has none)"]
    stats = of(RunStats, recs)[-1].hosts["localhost"]
    assert stats.rescued == 1 and stats.failed == 0
    introspect = next(r for r in of(StageFinished, recs) if r.stage == "introspect")
    assert (introspect.counts.failed, introspect.counts.rescued, introspect.failed) == (0, 1, False)
    result = summarize(recs, status="successful", rc=0, ident="success", selected=PIPELINE)
    assert result.failures == [] and result.failed_task is None
    assert [s.status for s in result.stages] == ["changed", "changed", "changed"]
    assert result.exit_code is ExitCode.OK


def test_introspection_facts_and_plan_come_out_of_the_stream() -> None:
    recs = records("success")
    facts = [r for r in of(FactsProduced, recs) if r.name == "regen_model_facts"]
    assert len(facts) == 1 and facts[0].stage == "introspect" and facts[0].host == "localhost"
    result = summarize(recs, status="successful", rc=0, ident="success")
    assert result.facts["architecture"] == {"model_type": "fixture", "num_layers": 4, "hidden_size": 64}
    assert result.plan["drafter_target_layers"]["value"] == [1, 2]
    assert result.facts_source == "run"


def test_job_progress_from_the_status_file_polling_task() -> None:
    recs = records("success")
    progress = of(JobProgress, recs)
    assert progress, "the watch task's retries carry the job's status"
    assert all(p.source == "task:Watch the job's status file" and p.job == "generate" for p in progress)
    done = [p.status.done for p in progress]
    assert done == sorted(done), "progress went backwards"
    last = progress[-1].status
    assert last.finished and last.done == last.total == 4 and last.state == "done"
    assert last.tokens == 128 and last.tokens_per_s and last.tokens_per_s > 0
    assert of(TaskRetry, recs), "the until loop's retries are records too"
    retry = of(TaskRetry, recs)[0]
    assert retry.attempt == 1 and retry.retries == 31


def test_the_second_run_changes_nothing() -> None:
    result = summarize(records("rerun"), status="successful", rc=0, ident="rerun", selected=PIPELINE)
    assert [(s.name, s.status, s.counts.changed) for s in result.stages] == [
        ("demo_model", "ok", 0),
        ("introspect", "ok", 0),
        ("generate", "ok", 0),
    ]
    assert all(h.changed == 0 for h in result.hosts.values())


def test_a_failing_task_names_its_stage_task_host_and_message() -> None:
    selected = ["demo_model", "generate"]
    recs = records("failed", selected)
    # --tags demo,generate: introspect's play starts but runs nothing, so it is not announced
    assert [r.stage for r in of(StageStarted, recs)] == selected
    result = summarize(recs, status="failed", rc=2, ident="failed", selected=selected)
    assert result.exit_code is ExitCode.TASK_FAILED
    failed = result.failed_task
    assert (failed.stage, failed.task, failed.host) == ("generate", "Refuse to generate", "localhost")
    assert failed.message == "generation endpoint refused: HTTP 503 from the fixture"
    # the path points at the task in the playbook (re-record the streams when the fixture playbooks change)
    file, line = failed.path.rsplit(":", 1)
    assert file.endswith("tests/fixtures/playbooks/runner/playbooks/generate.yml")
    playbook = (PROJECT / "playbooks" / "generate.yml").read_text().splitlines()
    assert playbook[int(line) - 1].strip() == "- name: Refuse to generate"
    assert [(s.name, s.status) for s in result.stages] == [("demo_model", "changed"), ("generate", "failed")]


def test_without_the_selection_every_started_play_is_a_stage() -> None:
    recs = records("failed")  # no selection known: the tag-filtered introspect play shows, empty
    assert [r.stage for r in of(StageStarted, recs)] == PIPELINE
    empty = next(r for r in of(StageFinished, recs) if r.stage == "introspect")
    assert empty.counts == type(empty.counts)()


def test_an_unreachable_host_is_exit_code_3() -> None:
    recs = records("unreachable", ["demo_model"])
    result = summarize(recs, status="failed", rc=4, ident="unreachable", selected=["demo_model"])
    assert result.exit_code is ExitCode.UNREACHABLE
    assert result.failed_task.unreachable and result.failed_task.host == "loopback-port-1"
    assert "Failed to connect" in result.failed_task.message
    assert result.hosts["loopback-port-1"].unreachable == 1


def test_a_cancelled_stream_closes_the_open_stage() -> None:
    recs = records("canceled", ["generate"])
    assert not of(RunStats, recs), "a cancelled run has no recap"
    assert [r.stage for r in of(StageStarted, recs)] == ["generate"]
    assert isinstance(recs[-1], StageFinished) and recs[-1].stage == "generate"
    assert of(TaskStarted, recs)[-1].task == "Hold the stage"
    result = summarize(recs, status="canceled", rc=254, ident="canceled", selected=["generate"])
    assert result.exit_code is ExitCode.CANCELED
    assert [(s.name, s.status) for s in result.stages] == [("generate", "canceled")]


def test_check_mode_on_a_fresh_directory_stops_where_inputs_are_missing() -> None:
    recs = records("check_fresh", PIPELINE)
    result = summarize(recs, status="failed", rc=2, ident="check", selected=PIPELINE, check=True)
    assert [(s.name, s.status) for s in result.stages] == [
        ("demo_model", "changed"),
        ("introspect", "failed"),
        ("generate", "not run"),
    ]
    assert result.failed_task.task == "Read config.json"
    assert "not found" in result.failed_task.message.lower()


def test_a_secret_printed_by_a_task_was_scrubbed_before_it_was_recorded() -> None:
    text = (EVENTS / "secret.jsonl").read_text()
    assert "sk-fixture-0123456789abcdef" not in text
    printed = [
        r
        for r in raw("secret")
        if r["event"] == "runner_on_ok" and r["event_data"]["task"].startswith("Print")
    ]
    assert printed and printed[0]["event_data"]["res"]["msg"] == f"key is {MASK}"
    assert MASK in strip_ansi(printed[0]["stdout"])


@pytest.mark.parametrize(
    "name", ["success", "rerun", "check_fresh", "failed", "secret", "unreachable", "canceled"]
)
def test_every_record_serialises_to_json(name: str) -> None:
    for record in records(name):
        data = json.loads(json.dumps(record.to_dict()))
        assert data["kind"] == record.kind


def test_records_are_ordered_by_the_runner_counter() -> None:
    recs = [r for r in records("success") if r.counter is not None]
    counters = [r.counter for r in recs]
    assert counters == sorted(counters)


def test_host_stats_follow_the_play_recap() -> None:
    stats_event = next(e for e in raw("success") if e["event"] == "playbook_on_stats")
    stats = host_stats(stats_event["event_data"])["localhost"]
    recap = dict(re.findall(r"(\w+)=(\d+)", strip_ansi(stats_event["stdout"])))
    assert recap, stats_event["stdout"]
    for field in ("ok", "changed", "unreachable", "failed", "skipped", "rescued", "ignored"):
        assert int(recap[field]) == getattr(stats, field), field


def test_no_hosts_matched_is_reported_for_the_stage() -> None:
    parser = EventParser({"Play A": "alpha"})
    out = parser.feed({"event": "playbook_on_play_start", "counter": 1, "event_data": {"name": "Play A"}})
    out += parser.feed({"event": "playbook_on_no_hosts_matched", "counter": 2, "event_data": {}})
    assert [type(r).__name__ for r in out] == ["StageStarted", "NoHostsMatched"]
    assert isinstance(out[1], NoHostsMatched) and out[1].stage == "alpha"
    result = summarize(out + parser.close(), status="successful", rc=0, ident="x")
    assert [(s.name, s.status) for s in result.stages] == [("alpha", "no hosts")]


def test_unknown_events_are_ignored_and_unknown_plays_are_their_own_stage() -> None:
    parser = EventParser(PLAYS)
    assert parser.feed({"event": "something_new", "counter": 1, "event_data": {"x": 1}}) == []
    out = parser.feed(
        {"event": "playbook_on_play_start", "counter": 2, "event_data": {"name": "Ad hoc play"}}
    )
    assert [r.stage for r in out] == ["Ad hoc play"]


def test_failure_message_prefers_msg_then_stderr_then_the_failed_item() -> None:
    assert failure_message({"msg": "non-zero return code", "stderr": "line1\nboom"}) == (
        "non-zero return code\nstderr: line1\nboom"
    )
    assert failure_message({"results": [{"failed": False}, {"failed": True, "msg": "item 2 broke"}]}) == (
        "item 2 broke"
    )
    assert failure_message({"censored": "hidden by no_log"}) == "hidden by no_log"
    assert len(failure_message({"msg": "x" * 5000})) == 2000


# The repository's own stages on inventory/local, recorded with `record.py --local`. Play names as they
# were at recording time, so later renames in playbooks/ do not break these tests (re-record instead).
LOCAL_PLAYS = {
    "Build the demo model": "demo_model",
    "Introspect the target model and the serving environment": "introspect",
}


def test_the_repository_pipeline_stream_parses_to_a_clean_run() -> None:
    recs = parse_events(raw("local_pipeline"), LOCAL_PLAYS)
    stages = [r.stage for r in of(StageStarted, recs)]
    assert stages[:2] == ["demo_model", "introspect"]
    result = summarize(recs, status="successful", rc=0, ident="local", selected=stages)
    assert result.exit_code is ExitCode.OK and result.failures == []
    assert {s.status for s in result.stages} <= {"ok", "changed"}
    facts = result.facts
    assert {"architecture", "tokenizer", "environment", "plan"} <= set(facts)
    assert facts["architecture"]["attention"]["kind"] == "mla" and facts["architecture"]["moe"]
    drafter = result.plan["drafter"]
    assert drafter["target_layer_ids"]["value"] and drafter["mask_token_id"]["reason"]


def test_a_roles_always_tagged_argument_check_does_not_announce_its_stage() -> None:
    # --tags introspect: the demo role's argument check (tagged always) still runs in the demo play
    raws = raw("local_introspect")
    assert any(
        r["event"] == "runner_on_ok" and r["event_data"]["play"] == "Build the demo model" for r in raws
    )
    recs = parse_events(raws, LOCAL_PLAYS, ["introspect"])
    assert [r.stage for r in of(StageStarted, recs)] == ["introspect"]
    assert [r.stage for r in of(StageFinished, recs)] == ["introspect"]
    result = summarize(recs, status="successful", rc=0, ident="facts", selected=["introspect"])
    assert [(s.name, s.status) for s in result.stages] == [("introspect", "ok")]
    assert result.facts["tokenizer"]["loaded_with"] in ("library", "raw_files")
