"""The sweep report (table, recommendation, plots) and SGLang's bench_serving line for the same mix."""

from __future__ import annotations

import ast
import json
import struct
from pathlib import Path

import pytest

from regen.bench import sglang_bench
from regen.bench.report import PLOTS, build_report, render_markdown, write_plots
from regen.jobs.sweep import main as sweep_main
from regen.jobs.sweep import request_mix

ROOT = Path(__file__).resolve().parents[2]


def _level(c: int, tps: float) -> dict:
    return {
        "concurrency": c,
        "requests": 4,
        "completed": 4,
        "failed": 0,
        "output_tokens_per_s": tps,
        "ttft_ms": {"mean": 10.0 * c, "p50": 9.0 * c, "p90": 12.0 * c, "p99": 13.0 * c},
        "tpot_ms": {"mean": 5.0, "p50": 5.0, "p90": 6.0, "p99": 7.0},
    }


LAYOUTS = [
    {
        "name": "plan",
        "settings": {},
        "status": "measured",
        "levels": [_level(1, 10.0), _level(2, 15.0)],
        "estimate": {"output_tokens_per_s": 30.0, "rank": 2},
    },
    {
        "name": "torch-threads-1",
        "settings": {"environment": {"OMP_NUM_THREADS": "1"}},
        "status": "measured",
        "levels": [_level(1, 20.0), _level(2, 19.0)],
        "estimate": {"output_tokens_per_s": None, "reason": "no GPU"},
    },
    {
        "name": "tp16",
        "settings": {"tp_size": 16},
        "status": "infeasible",
        "reason": "needs 16 GPUs",
        "levels": [],
        "estimate": {},
    },
    {
        "name": "cb",
        "settings": {"extra_args": ["--continuous-batching"]},
        "status": "failed",
        "reason": "quality gate failed",
        "levels": [],
        "diagnosis": {"summary": "the server raised an exception", "hint": "read the log lines above"},
    },
]


def test_report_recommends_tabulates_and_explains_every_layout() -> None:
    report = build_report(
        LAYOUTS,
        inputs={
            "model": "m",
            "backend": "transformers",
            "client": "regen",
            "requests_per_level": 4,
            "max_tokens": 8,
            "concurrencies": [1, 2],
        },
        inputs_digest="d1",
    )
    rec = report["recommended"]
    assert (rec["layout"], rec["concurrency"]) == ("torch-threads-1", 1)
    plan = report["layouts"][0]
    assert plan["best"]["concurrency"] == 2 and plan["measured_vs_estimated"] == 0.5
    text = render_markdown(report)
    assert "**Recommended for the generate stage: `torch-threads-1` at concurrency 1**" in text
    assert (
        "| `plan` | (the plan's) | measured | 2 | 15.0 | 18.0 / 24.0 / 26.0 | 5.0 / 6.0 / 7.0 | 30.0 | 0.50 |"
        in text
    )
    assert "- `tp16` infeasible: needs 16 GPUs" in text
    assert (
        "- `cb` failed: quality gate failed" in text
        and "log diagnosis: the server raised an exception" in text
    )
    assert "- `torch-threads-1` has no simulator estimate: no GPU" in text
    for name in PLOTS.values():
        assert f"]({name})" in text


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plots_are_real_pngs(tmp_path: Path) -> None:
    report = build_report(LAYOUTS, inputs={}, inputs_digest="d1")
    written = write_plots(report, tmp_path)
    assert sorted(written) == sorted(PLOTS.values())
    for name in written:
        width, height = _png_size(tmp_path / name)
        assert width > 300 and height > 200 and (tmp_path / name).stat().st_size > 10_000


def test_the_job_writes_the_report_from_layout_records(tmp_path: Path, capsys) -> None:
    paths = []
    for index, layout in enumerate(LAYOUTS):
        paths.append(tmp_path / f"layout-{index}.json")
        paths[-1].write_text(json.dumps(layout))
    out = tmp_path / "report"
    assert (
        sweep_main(
            [
                "report",
                "--results",
                *map(str, paths),
                "--output-dir",
                str(out),
                "--inputs-digest",
                "d1",
                "--inputs-json",
                '{"model": "m"}',
                "--max-ttft-ms",
                "15",
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed["recommended"]["layout"] == "torch-threads-1"  # 24 ms TTFT p90 at c2 is over 15 ms
    doc = json.loads((out / "report.json").read_text())
    assert doc["inputs_digest"] == "d1" and doc["objective"]["max_ttft_ms"] == 15.0
    assert (out / "report.md").read_text().startswith("# Layout sweep")


def test_the_request_mix_is_fixed_and_cycled() -> None:
    mix = request_mix(["builtin:demo"], 5)
    assert len(mix) == 5 and all(m[-1]["role"] == "user" for m in mix)
    assert mix == request_mix(["builtin:demo"], 5)


# -- SGLang's bench_serving: the flags must be 0.5.23's own (read from its source in the pinned release) --


def _bench_serving_flags() -> tuple[set[str], dict[str, list[str]]]:
    from tests.fixtures.serving.sglang_venv import sglang_venv_python

    python = sglang_venv_python()
    source = next(python.parent.parent.glob("lib/python3*/site-packages/sglang/benchmark/serving.py"))
    tree = ast.parse(source.read_text())
    flags: set[str] = set()
    choices: dict[str, list[str]] = {}
    backends: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            names = [
                a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")
            ]
            flags.update(names)
            for kw in node.keywords:
                if kw.arg == "choices" and isinstance(kw.value, ast.List) and names:
                    choices[names[0]] = [e.value for e in kw.value.elts if isinstance(e, ast.Constant)]
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", "") == "ASYNC_REQUEST_FUNCS" for t in node.targets
        ):
            backends = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
    choices["--backend"] = backends
    return flags, choices


def test_the_rendered_bench_serving_line_uses_only_flags_and_choices_of_sglang_0_5_23() -> None:
    argv = sglang_bench.bench_serving_argv(
        python="/venv/bin/python",
        base_url="http://127.0.0.1:30000",
        served_model="kimi",
        tokenizer="/models/k",
        dataset="/tmp/mix.json",
        num_prompts=64,
        max_tokens=512,
        concurrency=32,
        output_file="/tmp/c32.jsonl",
    )
    assert argv[:3] == ["/venv/bin/python", "-m", "sglang.benchmark.serving"]
    flags, choices = _bench_serving_flags()
    used = [a for a in argv[3:] if a.startswith("--")]
    assert set(used) <= flags, set(used) - flags
    assert argv[argv.index("--backend") + 1] in choices["--backend"]
    assert argv[argv.index("--dataset-name") + 1] in choices["--dataset-name"]
    assert "--no-such-flag" not in flags  # the check can fail
    with pytest.raises(ValueError, match="max_tokens >= 4"):
        sglang_bench.bench_serving_argv(
            python="p",
            base_url="u",
            served_model="m",
            tokenizer="t",
            dataset="d",
            num_prompts=1,
            max_tokens=2,
            concurrency=1,
            output_file="o",
        )


def test_the_sharegpt_file_carries_the_same_mix(tmp_path: Path) -> None:
    mix = request_mix(["builtin:demo"], 3)
    assert sglang_bench.write_dataset(tmp_path / "mix.json", mix) == 3
    rows = json.loads((tmp_path / "mix.json").read_text())
    # bench_serving keeps rows with two or more turns and sends conversations[0]["value"] as the prompt.
    assert [row["conversations"][0]["value"] for row in rows] == [m[-1]["content"] for m in mix]
    assert all(len(row["conversations"]) >= 2 for row in rows)
