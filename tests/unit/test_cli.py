"""The `regen` command without playbook runs: arguments, exit codes for bad input, stages, rendering."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from regen.cli import _plan_rows, build_parser, facts_tree, main, parse_extravars, parse_secret_env
from regen.runner import BadInput, ExitCode

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "tests" / "fixtures" / "playbooks" / "runner"


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")


def test_the_console_script_prints_help_with_the_exit_codes() -> None:
    regen = Path(sys.executable).parent / "regen"
    out = subprocess.run([str(regen), "--help"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    for word in ("run", "facts", "status", "plan", "exit codes", "130"):
        assert word in out.stdout
    run_help = subprocess.run([str(regen), "run", "--help"], capture_output=True, text=True, check=False)
    assert run_help.returncode == 0 and "--check" in run_help.stdout and "STAGE" in run_help.stdout


def test_version_comes_from_the_package_metadata() -> None:
    regen = Path(sys.executable).parent / "regen"
    out = subprocess.run([str(regen), "--version"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"regen {importlib.metadata.version('regen')}"
    for job in ("prompts", "generate", "tokenize"):  # the job CLIs share the flag through their parent parser
        job_out = subprocess.run(
            [sys.executable, "-m", f"regen.jobs.{job}", "--version"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert (job_out.returncode, job_out.stdout.strip()) == (0, out.stdout.strip()), job_out.stderr


def test_bad_usage_exits_4_not_argparses_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--no-such-flag"])
    assert exc.value.code == ExitCode.BAD_INPUT
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == ExitCode.BAD_INPUT
    assert "regen" in capsys.readouterr().err


def test_unknown_stage_and_missing_inventory_are_exit_4(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["run", "trian", "--project", str(PROJECT), "--private-data-dir", str(tmp_path)]) == 4
    assert "unknown stage 'trian'" in capsys.readouterr().err
    assert main(["run", "demo", "-i", "no/such/inventory", "--project", str(PROJECT)]) == 4
    assert "does not exist" in capsys.readouterr().err
    assert main(["run", "demo", "-e", "novalue", "--project", str(PROJECT)]) == 4
    assert "expected NAME=VALUE" in capsys.readouterr().err


def test_extra_vars_are_parsed_like_ansible(tmp_path: Path) -> None:
    varfile = tmp_path / "vars.yml"
    varfile.write_text("regen_max_tokens: 256\nnested: {a: [1, 2]}\n")
    assert parse_extravars(["a=1 b='two words'", f"@{varfile}", '{"c": true}']) == {
        "a": "1",
        "b": "two words",
        "regen_max_tokens": 256,
        "nested": {"a": [1, 2]},
        "c": True,
    }
    for bad, message in (
        (["=x"], "expected NAME=VALUE"),
        (["@/no/such/file"], "cannot read"),
        (["{not: [closed"], "not a JSON/YAML mapping"),
        (['["a"]'], "expected NAME=VALUE"),
    ):
        with pytest.raises(BadInput, match=message):
            parse_extravars(bad)


def test_secret_env_reads_values_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_ENDPOINT_KEY", "sk-1")
    assert parse_secret_env(["regen_api_key=MY_ENDPOINT_KEY"]) == {"regen_api_key": "sk-1"}
    monkeypatch.setenv("regen_hf_token", "hf-2")
    assert parse_secret_env(["regen_hf_token"]) == {"regen_hf_token": "hf-2"}
    monkeypatch.delenv("MISSING_KEY", raising=False)
    with pytest.raises(BadInput, match="MISSING_KEY is not set"):
        parse_secret_env(["x=MISSING_KEY"])


def test_stages_lists_the_checkouts_stages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stages", "--project", str(PROJECT), "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)
    assert [(s["name"], s["tag"], s["standalone"]) for s in stages] == [
        ("demo_model", "demo", False),
        ("introspect", "introspect", False),
        ("generate", "generate", False),
        ("teardown", "teardown", True),
    ]
    assert main(["stages", "--project", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert "demo_model" in out and "demo" in out


def test_status_with_no_runs_yet(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["status", "--project", str(PROJECT), "--private-data-dir", str(tmp_path)]) == 0
    assert "no runs recorded" in capsys.readouterr().out
    assert main(["status", "--project", str(PROJECT), "--private-data-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["status", "nope", "--project", str(PROJECT), "--private-data-dir", str(tmp_path)]) == 4


def test_the_plan_renders_values_with_their_reasons() -> None:
    plan = {
        "serving": {
            "tp_size": {"value": 8, "reason": "8 GPUs"},
            "ep_size": {"value": 8, "reason": "MoE: EP=TP"},
        },
        "drafter": {"block_size": 16, "target_layer_ids": [1, 15, 30, 45, 58], "reason": "SpecForge spread"},
        "warnings": [],
    }
    assert _plan_rows(plan) == [
        ("serving.tp_size", "8", "8 GPUs"),
        ("serving.ep_size", "8", "MoE: EP=TP"),
        ("drafter", '{"block_size": 16, "target_layer_ids": [1, 15, 30, 45, 58]}', "SpecForge spread"),
        ("warnings", "[]", ""),
    ]


def test_facts_render_as_a_tree() -> None:
    console = Console(width=120, record=True, color_system=None)
    moe = {f"field_{i}": i for i in range(20)}  # too long for one line: a subtree
    console.print(
        facts_tree(
            {
                "architecture": {
                    "model_type": "kimi_k25",
                    "moe": moe,
                    "attention": {"kind": "mla", "heads": 64},
                },
                "tokenizer": {"special": ["[BOS]", "[EOS]"]},
                "modules": [{"name": "torch", "ok": True}, {"name": "sglang", "ok": False}],
            }
        )
    )
    text = console.export_text()
    assert "model_type: kimi_k25" in text and "field_19: 19" in text
    assert 'attention: kind="mla", heads=64' in text
    assert 'tokenizer: special=["[BOS]", "[EOS]"]' in text
    assert '[1]: name="sglang", ok=false' in text


def test_parser_lists_every_command() -> None:
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == {"run", "facts", "status", "plan", "compare", "stages", "preflight"}
    from regen.cli import COMMANDS

    assert set(COMMANDS) == set(commands)  # every parsed command has its handler


def _render(renderable) -> str:
    console = Console(width=140, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_the_live_view_follows_a_recorded_run() -> None:
    from regen.cli import LiveView
    from regen.runner import StageStarted, TaskStarted, discover_stages, parse_events
    from regen.runner.stages import play_stage_map

    lines = (ROOT / "tests" / "fixtures" / "events" / "success.jsonl").read_text().splitlines()
    records = parse_events([json.loads(line) for line in lines], play_stage_map(discover_stages(PROJECT)))
    view = LiveView(["demo_model", "introspect", "generate"], "regen run · test")
    middle = None
    for record in records:
        view.handle(record)
        if isinstance(record, TaskStarted) and record.task == "Read config.json":
            middle = _render(view.render())
        if isinstance(record, StageStarted) and record.stage == "generate":
            assert view.notes == {}, "the rescued failure's note is gone once the host went on"
    assert middle is not None
    assert "✓  demo_model  changed" in middle and "▶  introspect  running" in middle
    assert "·  generate    pending" in middle and "task: Read config.json" in middle
    final = _render(view.render())
    assert "✓  generate    changed" in final
    assert "generate@localhost" in final and "4/4" in final and "tok/s" in final


def test_without_the_controller_packages_the_command_says_what_to_install(tmp_path: Path) -> None:
    # Fault injection: a stub `rich` package that fails to import, as on a host without the runner extra.
    stub = tmp_path / "stub-missing-rich" / "rich"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('No module named rich (stub)', name='rich')\n")
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from regen.cli import main; sys.exit(main(['run']))"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(stub.parent)},
    )
    assert out.returncode == 1
    assert "rich is missing" in out.stderr and "pip install 'regen[runner]'" in out.stderr
    assert "Traceback" not in out.stderr
