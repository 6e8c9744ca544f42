"""The evaluation's figures from per-step traces: acceptance length (bonus included), by-position rates,
bootstrap intervals, speedup, and the report documents built from them (no torch needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from regen.evaluate import report, stats
from regen.jobs import evaluate as job


def test_acceptance_length_counts_the_bonus_token_per_step() -> None:
    # Two prompts: steps that accepted 0, 3 and 15 drafts commit 1, 4 and 16 tokens.
    assert stats.acceptance_length([[0, 3], [15]]) == pytest.approx((1 + 4 + 16) / 3)
    assert stats.acceptance_length([[0, 0, 0]]) == 1.0
    assert stats.acceptance_length([]) is None


def test_acceptance_by_position_is_the_share_of_steps_reaching_each_slot() -> None:
    rates = stats.acceptance_by_position([[0, 2], [3, 1]], block_size=5)
    assert rates == [0.75, 0.5, 0.25, 0.0]
    # The rates sum to the acceptance length minus the bonus token.
    assert sum(rates) + 1 == pytest.approx(stats.acceptance_length([[0, 2], [3, 1]]))


def test_bootstrap_interval_is_seeded_and_brackets_the_point() -> None:
    traces = [[0, 1, 2], [5, 5], [0], [3, 4, 1, 0], [7]]
    a = stats.bootstrap_ci(traces, stats.acceptance_length)
    b = stats.bootstrap_ci(traces, stats.acceptance_length)
    assert a == b  # the same traces give the same report on every run
    point = stats.acceptance_length(traces)
    assert a[0] < point < a[1]
    # Identical prompts leave nothing to resample: the interval collapses on the point.
    assert stats.bootstrap_ci([[2, 2]] * 4, stats.acceptance_length) == [3.0, 3.0]


def test_speedup_pairs_each_prompt_with_its_plain_run() -> None:
    spec = [(10, 1.0), (10, 2.0)]
    plain = [(10, 2.0), (10, 4.0)]
    assert stats.throughput(spec) / stats.throughput(plain) == pytest.approx(2.0)
    assert stats.speedup_ci(spec, plain) == [pytest.approx(2.0), pytest.approx(2.0)]


def _row(
    drafter: str,
    pid: str,
    accepted: list[int],
    category: str | None = None,
    lossless: bool = True,
    turn_kind: str = "default",
):
    return {
        "drafter": drafter,
        "prompt_id": pid,
        "turn_kind": turn_kind,
        "category": category,
        "accepted": accepted,
        "tokens": sum(a + 1 for a in accepted),
        "seconds": len(accepted) * 0.1,
        "plain_tokens": sum(a + 1 for a in accepted),
        "plain_seconds": sum(a + 1 for a in accepted) * 0.1,
        "lossless": lossless,
    }


def test_report_has_the_keys_the_issue_names(tmp_path: Path) -> None:
    rows = [
        _row("trained", "a", [2, 3], "code"),
        _row("trained", "b", [1, 0], "chat"),
        _row("untrained", "a", [0, 0, 0]),
        _row("untrained", "b", [0, 0]),
        _row("oracle", "a", [3]),
        _row("oracle", "b", [3]),
    ]
    doc = report.build_report(rows, block_size=4, settings={"dtype": "float32"}, inputs={})
    for name in ("trained", "untrained", "oracle"):
        d = doc["drafters"][name]
        assert {"acceptance_length", "acceptance_length_ci95", "acceptance_by_position"} <= set(d)
        assert len(d["acceptance_by_position"]) == 3
    assert doc["drafters"]["oracle"]["acceptance_length"] == 4.0
    assert doc["drafters"]["untrained"]["acceptance_length"] == 1.0
    assert doc["block_size"] == 4 and doc["lossless"] is True
    assert doc["speedup"]["value"] == doc["drafters"]["trained"]["speedup"]["value"]
    assert set(doc["drafters"]["trained"]["categories"]) == {"code", "chat"}
    assert doc["tree"]["measured"] is False
    json.dumps(doc)  # plain JSON
    text = report.render_markdown(doc, [])
    assert "| oracle | 4.00 |" in text and "lossless" in report.headline(doc)


def test_turn_kinds_training_steps_and_the_batch_setting_are_reported(tmp_path: Path) -> None:
    rows = [
        _row(name, pid, accepted, "chat", turn_kind=kind)
        for kind, shift in (("non-thinking", 1), ("thinking", 0))
        for pid in ("a", "b")
        for name, accepted in (("trained", [shift + 1, shift]), ("untrained", [0, 0, 0]), ("oracle", [3]))
    ]
    steps = [
        {"drafter": "trained@10", "step": 10, "prompt_id": p, "turn_kind": "non-thinking", "accepted": [0, 1]}
        for p in ("a", "b")
    ]
    doc = report.build_report(
        rows, block_size=4, settings={}, inputs={}, step_rows=steps, exported_step=20
    )
    assert doc["turn_kinds"] == ["non-thinking", "thinking"]
    kinds = doc["drafters"]["trained"]["turn_kinds"]
    assert kinds["non-thinking"]["acceptance_length"] == 2.5 and kinds["thinking"]["acceptance_length"] == 1.5
    assert doc["drafters"]["untrained"]["turn_kinds"]["thinking"]["acceptance_length"] == 1.0
    # The series: the earlier checkpoint, then the export on the same (first) turn kind.
    points = doc["training_steps"]["points"]
    assert [(p["step"], p["exported"], p["acceptance_length"]) for p in points] == [
        (10, False, 1.5),
        (20, True, 2.5),
    ]
    batch = doc["speedup"]["batch"]
    assert batch["measured"] is False and "one request at a time" in batch["reason"]
    text = report.render_markdown(doc, [])
    assert "## Per kind of turn" in text and "| thinking | trained | 1.50 |" in text
    assert "| 20 (exported) | 2.50 |" in text and "Batch setting: not measured" in text
    files, _ = report.draw_plots(doc, tmp_path)
    assert "acceptance_by_step.png" in {f.name for f in files}


def test_without_earlier_checkpoints_the_step_series_says_why(tmp_path: Path) -> None:
    doc = report.build_report([_row("trained", "a", [1])], block_size=4, settings={}, inputs={})
    series = doc["training_steps"]
    assert series["measured"] is False and "one checkpoint only" in series["reason"]
    files, _ = report.draw_plots(doc, tmp_path)
    assert "acceptance_by_step.png" not in {f.name for f in files}
    assert "one checkpoint only" in report.render_markdown(doc, [])


def test_turn_kinds_come_from_the_thinking_switch() -> None:
    from regen.jobs._common import JobError
    from regen.jobs.evaluate import turn_kinds

    assert turn_kinds("{}", "", "") == {"default": {}}
    assert turn_kinds('{"thinking": false}', "thinking", "") == {"non-thinking": {"thinking": False}}
    assert turn_kinds('{"thinking": true, "x": 1}', "thinking", "non-thinking,thinking") == {
        "non-thinking": {"thinking": False, "x": 1},
        "thinking": {"thinking": True, "x": 1},
    }
    for kwargs, switch, kinds, message in (
        ("[]", "thinking", "", "must be a JSON object"),
        ("{oops", "thinking", "", "is not valid JSON"),
        ("{}", "", "thinking", "needs --thinking-switch"),
        ("{}", "thinking", "deep", "choose from thinking, non-thinking"),
        ('{"reasoning_effort": "high"}', "reasoning_effort", "thinking", "true/false switch"),
    ):
        with pytest.raises(JobError, match=message):
            turn_kinds(kwargs, switch, kinds)


def test_one_differing_output_makes_the_report_not_lossless() -> None:
    rows = [_row("trained", "a", [1]), _row("oracle", "a", [3], lossless=False)]
    doc = report.build_report(rows, block_size=4, settings={}, inputs={})
    assert doc["lossless"] is False
    assert doc["drafters"]["oracle"]["lossless"] is False
    assert "NOT lossless" in report.headline(doc)


def test_plots_are_drawn_and_identical_on_redraw(tmp_path: Path) -> None:
    rows = [_row("trained", "a", [2, 3], "code"), _row("oracle", "a", [3], "code")]
    doc = report.build_report(rows, block_size=4, settings={}, inputs={})
    files, note = report.draw_plots(doc, tmp_path)
    assert note is None and {f.name for f in files} == {
        "acceptance_by_position.png",
        "speedup_by_category.png",
    }
    first = [f.read_bytes() for f in files]
    assert first[0][:8] == b"\x89PNG\r\n\x1a\n"
    report.draw_plots(doc, tmp_path)
    assert [f.read_bytes() for f in files] == first


def test_prompts_are_the_first_user_turn_and_a_stable_selection(tmp_path: Path) -> None:
    rows = [
        {
            "id": f"p{i}",
            "category": "math",
            "conversations": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": "again"},
            ],
        }
        for i in range(10)
    ]
    (tmp_path / "prompts-x-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    (tmp_path / "prompts-x-00001.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows[5:]) + "not json\n"
    )
    (tmp_path / "rejects.jsonl").write_text('{"id": "bad"}\n')
    picked = job.load_prompts(tmp_path, 4, seed=0)
    assert len(picked) == 4
    assert picked[0]["turns"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": picked[0]["turns"][1]["content"]},
    ]
    assert picked[0]["category"] == "math"
    # The same set from one file holding the rows in reverse order.
    single = tmp_path / "one.jsonl"
    single.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))
    assert [p["id"] for p in job.load_prompts(single, 4, seed=0)] == [p["id"] for p in picked]
    assert [p["id"] for p in job.load_prompts(single, 4, seed=1)] != [p["id"] for p in picked]


def test_no_prompts_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(job.JobError, match="no prompts at"):
        job.load_prompts(tmp_path / "missing", 4, seed=0)
    (tmp_path / "p.jsonl").write_text(
        '{"id": "a", "conversations": [{"role": "assistant", "content": "x"}]}\n'
    )
    with pytest.raises(job.JobError, match="no usable prompt"):
        job.load_prompts(tmp_path / "p.jsonl", 4, seed=0)


def test_a_missing_checkpoint_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p.jsonl").write_text('{"id": "a", "conversations": [{"role": "user", "content": "x"}]}\n')
    rc = job.run_main(
        job.main,
        [
            "--target-model",
            str(tmp_path),
            "--checkpoint",
            str(tmp_path / "nope"),
            "--prompts",
            str(tmp_path / "p.jsonl"),
            "--output-dir",
            str(tmp_path / "out"),
        ],
    )
    assert rc == job.EXIT_USAGE
    assert "has no config.json" in capsys.readouterr().err


def test_the_run_summary_shows_the_evaluation_headline(tmp_path: Path) -> None:
    from regen import summary

    rows = [_row("trained", "a", [2, 3]), _row("untrained", "a", [0, 0]), _row("oracle", "a", [3])]
    doc = report.build_report(rows, block_size=4, settings={}, inputs={})
    (tmp_path / "evaluate").mkdir()
    (tmp_path / "evaluate" / "report.json").write_text(json.dumps(doc))
    text = summary.render(summary.collect(tmp_path), tmp_path)
    assert "evaluate  acceptance length trained 3.50" in text and "oracle 4.00" in text
    (tmp_path / "evaluate" / "report.json").write_text('{"drafters": 3}')
    assert "evaluate  record unreadable" in summary.render(summary.collect(tmp_path), tmp_path)


def test_the_reports_prompt_and_category_counts_add_up() -> None:
    """Item 6 of issue 26: measured in two turn kinds, a prompt counts once; the categories' prompts (a
    prompt without a category under "(none)") add up to the report's."""
    from regen.evaluate.report import UNGROUPED, build_report, render_markdown

    def row(prompt: str, category: str | None, kind: str) -> dict:
        return {"drafter": "trained", "prompt_id": prompt, "turn_kind": kind, "category": category,
                "accepted": [2, 1], "tokens": 3, "seconds": 0.5, "plain_tokens": 3, "plain_seconds": 1.0,
                "lossless": True}  # fmt: skip

    prompts = {"p1": "code", "p2": "code", "p3": "math", "p4": None}
    rows = [row(p, c, kind) for p, c in prompts.items() for kind in ("thinking", "non-thinking")]
    report = build_report(rows, block_size=4, settings={}, inputs={})
    trained = report["drafters"]["trained"]
    assert report["prompts"] == trained["prompts"] == 4 and trained["runs"] == 8
    categories = trained["categories"]
    assert {name: c["prompts"] for name, c in categories.items()} == {"code": 2, "math": 1, UNGROUPED: 1}
    assert sum(c["prompts"] for c in categories.values()) == report["prompts"]
    assert {k: t["prompts"] for k, t in trained["turn_kinds"].items()} == {"thinking": 4, "non-thinking": 4}
    markdown = render_markdown(report, [])
    assert "| code | trained | 2.50 | [2.50, 2.50] | 2 | 4 | 2.00 |" in markdown
