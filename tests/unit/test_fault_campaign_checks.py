"""The fault campaign's own checks and verdicts (tests.helpers.fault_campaign) can fail: each finds what it
is there to find in a pipeline output made by hand, and a stage's verdict follows its exit code, its
status file and its output. No server, no job runs here (tests/e2e/test_fault_campaign.py runs them)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from regen.jobs.generate.stale import prompt_key, settings_key
from tests.helpers.fault_campaign import FAULT_KINDS, Campaign, CampaignConfig, StageRun, render_markdown


@pytest.fixture
def campaign(tmp_path: Path) -> Campaign:
    c = Campaign(CampaignConfig(workdir=tmp_path / "c", model_dir=tmp_path / "model", mount_disk=False))
    c.source.add(4)
    c.source.write()
    yield c
    c.close()


def _settings(c: Campaign) -> str:
    return settings_key(
        {
            "model": str(c.c.model_dir),
            "max_tokens": c.c.max_tokens,
            "sampling": {},
            "chat_template_kwargs": {"thinking": False},
            "reasoning": "field",
        }
    )


def _pipeline(c: Campaign, *, completions=None, samples=None) -> None:
    """What the three stages would have written for the current source set (or the given parts)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(c.source.rows.values())
    c.prompts_dir.mkdir(parents=True, exist_ok=True)
    (c.prompts_dir / "prompts-00000000-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (c.prompts_dir / "manifest.json").write_text(
        json.dumps({"shards": [{"path": "prompts-00000000-00000.jsonl"}]})
    )
    if completions is None:
        completions = []
        for r in rows:
            conv = [*r["conversations"], {"role": "assistant", "content": f"answer to {r['id']}"}]
            completions.append(
                {
                    "id": r["id"],
                    "prompt_key": prompt_key(r["conversations"]),
                    "settings_key": _settings(c),
                    "conversations": conv,
                }
            )
    c.completions_dir.mkdir(parents=True, exist_ok=True)
    (c.completions_dir / "completions-00000.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in completions)
    )
    samples = completions if samples is None else samples
    (c.tokenized_dir / "data").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": [x["id"] for x in samples]}), c.tokenized_dir / "data" / "s.parquet")
    (c.tokenized_dir / "conversations.jsonl").write_text(
        "".join(json.dumps({"id": x["id"], "conversations": x["conversations"]}) + "\n" for x in samples)
    )


def test_a_whole_pipeline_output_passes_every_check(campaign):
    _pipeline(campaign)
    counts, problems, sizes = campaign.check()
    assert counts == dict.fromkeys(counts, 0), problems
    assert sizes == {"prompts": 4, "completions": 4, "samples": 4}


def test_the_checks_find_lost_duplicated_stale_and_torn_records(campaign):
    _pipeline(campaign)
    good = [
        json.loads(x) for x in (campaign.completions_dir / "completions-00000.jsonl").read_text().splitlines()
    ]
    campaign.check()  # the checks remember every completion they saw
    edited = campaign.source.edit(1, "now", set())[0]
    campaign.source.write()
    rows = list(campaign.source.rows.values())
    c = campaign.prompts_dir / "prompts-00000000-00000.jsonl"
    c.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lost = good[0]["id"] if good[0]["id"] != edited else good[1]["id"]
    kept = [x for x in good if x["id"] != lost]
    other = dict(kept[-1], settings_key="0" * 32)
    broken = [*kept[:-1], other, kept[0]]  # one lost, one with other settings, one twice
    path = campaign.completions_dir / "completions-00000.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in broken) + '{"id": "torn')
    counts, problems, _ = campaign.check()
    text = "\n".join(problems)
    assert counts["lost"] >= 2 and "prompts without a completion" in text  # lost, and gone unrecorded
    assert "completions gone without a line in superseded.jsonl" in text
    assert counts["duplicated"] >= 1 and "ids twice in the completions" in text
    assert "completions of edited prompts" in text and "completions made with other settings" in text
    assert counts["torn"] == 1 and "completions-00000.jsonl: 1 torn line" in text


def test_a_sample_of_an_old_completion_is_stale_downstream(campaign):
    _pipeline(campaign)
    comps = [
        json.loads(x) for x in (campaign.completions_dir / "completions-00000.jsonl").read_text().splitlines()
    ]
    old = [dict(x) for x in comps]
    old[0] = dict(
        old[0], conversations=[*old[0]["conversations"][:-1], {"role": "assistant", "content": "old"}]
    )
    _pipeline(campaign, completions=comps, samples=old)
    counts, problems, _ = campaign.check()
    assert counts["stale"] == 1 and "conversations.jsonl entries that do not match" in "\n".join(problems)


def _run(stage: str, rc: int, **status) -> StageRun:
    doc = {"state": status.pop("state", None), "exit_code": status.pop("exit_code", None), **status}
    return StageRun(stage=stage, rc=rc, seconds=1.0, stderr="", stdout="", status=doc, fault_hit=True)


def test_a_stage_that_reports_success_with_missing_output_is_a_silent_pass(campaign):
    _pipeline(campaign)
    assert campaign.judge("sigkill", _run("generate", 0, state="done", exit_code=0))[0] == "finished"
    campaign.source.add(1)  # a prompt the stage never answered
    campaign.source.write()
    rows = list(campaign.source.rows.values())
    (campaign.prompts_dir / "prompts-00000000-00000.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
    )
    outcome, detail = campaign.judge("sigkill", _run("generate", 0, state="done", exit_code=0))
    assert outcome == "silent_pass" and "have no completion" in detail
    outcome, _ = campaign.judge("sigterm", _run("generate", 143, state="done", exit_code=0))
    assert outcome == "silent_pass"


def test_a_failure_must_name_its_fault(campaign):
    _pipeline(campaign)
    killed = _run("generate", -signal.SIGKILL, state="running", pid=2**22 + 7)  # a pid that is gone
    assert campaign.judge("sigkill", killed)[0] == "failed_named"
    term = _run("tokenize", 143, state="interrupted", exit_code=143)
    assert campaign.judge("sigterm", term)[0] == "failed_named"
    full = _run("generate", 5, state="failed", exit_code=5, error="cannot write: the disk is full (...)")
    assert campaign.judge("disk_full", full)[0] == "failed_named"
    crashed = _run("generate", 4, state="failed", exit_code=4, error="the job crashed: KeyError: 'x'")
    assert campaign.judge("disk_full", crashed)[0] == "failed_unnamed"
    mismatch = _run("generate", 5, state="failed", exit_code=1, error="the disk is full")
    assert campaign.judge("disk_full", mismatch)[0] == "failed_unnamed"


def test_the_schedule_takes_every_kind_first_and_never_starts_with_an_edit(tmp_path):
    def schedule(seed: int, name: str) -> list[tuple[str, str]]:
        config = CampaignConfig(
            workdir=tmp_path / name, model_dir=tmp_path, rounds=12, seed=seed, mount_disk=False
        )
        c = Campaign(config)
        try:
            return c.schedule()
        finally:
            c.close()

    for seed in range(6):
        plan = schedule(seed, f"a{seed}")
        assert len(plan) == 12 and {k for k, _ in plan[:8]} == set(FAULT_KINDS)
        assert plan[0][0] not in ("prompt_edited", "prompt_removed")
        assert plan == schedule(seed, f"b{seed}"), "seeded"


def test_the_report_table_counts_outcomes_by_kind(campaign):
    _pipeline(campaign)
    report = campaign.report()
    assert report["ok"] is True and report["rounds"] == 0
    assert "| sigkill | 0 |" in render_markdown(report)


def test_a_second_campaign_on_one_work_directory_is_refused(campaign):
    from regen.jobs._common import JobError

    with pytest.raises(JobError, match=r"another fault campaign job \(pid \d+\)"):
        Campaign(CampaignConfig(workdir=campaign.c.workdir, model_dir=campaign.c.model_dir, mount_disk=False))
