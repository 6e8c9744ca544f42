"""The evaluate stage's GPU path (drafter_evaluation_backend: sglang) through real ansible-playbook runs.

The CT200 example inventory (inventory/production.example: Kimi K2.6, 8 GPUs, EP8, profile gpu) with only the
connection, the interpreters and the paths pointed at this machine: the model directory holds Kimi K2.6's
real config.json, the facts are the recorded Kimi K2.6 facts of tests/fixtures/serving, the drafter is a
train-stage export directory (config.json and the sglang_dflash.args the train stage writes beside it).
Nothing connects to the example's address.

* Check mode renders the whole orchestration in its order: the generate stage's server stopped, the target
  served alone through the serving role (its launch line shown), the client, that server stopped, the target
  served with the drafter, the client, that server stopped, the report. Nothing is written on the host.
* An evaluation whose report is current starts nothing (no server is stopped or served), and a second run
  changes nothing. The records behind that report are written through the job's own results file from
  SGLang's recorded per-request metadata (no SGLang server can run here), and the report by the real job.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from regen.evaluate import serving as S
from regen.module_utils.regen_plan import make_plan
from tests.helpers.ansible import ansible_env, run_playbook

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
PY = sys.executable


@pytest.fixture
def ct200(tmp_path: Path) -> dict:
    """The production example's inputs, on this machine."""
    model = tmp_path / "models" / "Kimi-K2.6"
    model.mkdir(parents=True)
    (model / "config.json").write_text((FIXTURES / "drafter/targets/kimi-k2.6/config.json").read_text())
    facts = json.loads((FIXTURES / "serving" / "facts-kimi-k2.6.json").read_text())
    facts.pop("_comment", None)
    facts.update(schema_version=1, model_path=str(model))
    # The recorded facts predate the length budget and the generation settings the evaluate stage now
    # reads from the plan (no fallback number any more): those parts are planned here from the same
    # architecture and GPUs, as the introspect stage plans them; the recorded serving plan is kept.
    planned = make_plan(facts["architecture"], None, facts["environment"]["gpu"])
    facts["plan"]["length"] = planned["length"]
    facts["plan"]["generation"] = {**planned["generation"], **facts["plan"]["generation"]}
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    (artifacts / "model_facts.json").write_text(json.dumps(facts))
    export = tmp_path / "work" / "drafter" / "runs" / "dflash-test" / "export"
    export.mkdir(parents=True)
    config = {"architectures": ["DFlashDraftModel"], "block_size": 16, "num_hidden_layers": 6}
    config["dflash_config"] = {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838}
    (export / "config.json").write_text(json.dumps(config))
    (export.parent / "sglang_dflash.args").write_text(
        "\n".join(
            [
                "--speculative-algorithm",
                "DFLASH",
                "--speculative-draft-model-path",
                str(export),
                "--speculative-num-draft-tokens",
                "16",
            ]
        )
        + "\n"
    )
    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {
            "id": f"p{i}",
            "category": ("code", "chat")[i % 2],
            "conversations": [{"role": "user", "content": f"Q{i}?"}],
        }
        for i in range(3)
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = {
        "ansible_connection": "local",
        "ansible_python_interpreter": PY,
        "regen_job_python": PY,
        "regen_artifacts_dir": str(artifacts),
        "regen_work_dir": str(tmp_path / "work"),
        "regen_model_path": str(model),
        "evaluate_checkpoint": str(export),
        "evaluate_prompts": str(prompts),
        "drafter_evaluation_max_prompts": 3,
        "drafter_evaluation_max_new_tokens": 106,
        # The recorded facts hold no tokenizer facts (the checkpoint's tokenizer is not among the fixtures),
        # so the plan cannot name the thinking switch: set as an operator would (Kimi's template variable).
        "drafter_evaluation_chat_template_kwargs": {"thinking": True},
    }
    return {"extra": extra, "export": export, "work": tmp_path / "work", "artifacts": artifacts}


def _play(ct200: dict, *args: str, json_results: bool = False):
    env = ansible_env(ANSIBLE_CALLBACK_RESULT_FORMAT="json") if json_results else None
    return run_playbook(
        "playbooks/evaluate.yml",
        *args,
        inventory="inventory/production.example",
        extra_vars=ct200["extra"],
        env=env,
        timeout=600,
    )


def test_check_mode_renders_the_orchestration_in_order(ct200: dict) -> None:
    run = _play(ct200, "--check")
    assert run.returncode == 0, run.output[-6000:]
    counts = run.counts("ct200")
    assert counts["failed"] == counts["unreachable"] == 0
    out = run.output
    order = [
        "TASK [Free the GPUs held by the generate stage's server]",
        "TASK [Serve the target alone]",
        "TASK [drafter_evaluation : Show the client command (check mode)]",
        "TASK [Stop the evaluation server, plain]",
        "TASK [Serve the target with the drafter]",
        "TASK [Stop the evaluation server, dflash]",
        "TASK [drafter_evaluation : Show the report command (check mode)]",
    ]
    positions = [out.find(task) for task in order]
    assert all(p >= 0 for p in positions), [t for t, p in zip(order, positions, strict=True) if p < 0]
    assert positions == sorted(positions), "the steps ran out of order"
    flat = re.sub(r"\s+", " ", out).replace("''", "'")  # YAML doubles a quote inside quotes
    assert "regen-serve-main: background process supervised" in flat  # the generate stage's server
    launch = re.findall(r"- (/root/venv_sglang/bin/python -m sglang\.launch_server .*?) - '", flat)
    plain = next(line for line in launch if "--port 30020" in line and "--speculative" not in line)
    dflash = next(line for line in launch if "--speculative-algorithm DFLASH" in line)
    assert "--tp-size 8 --ep-size 8 --attention-backend flashinfer" in plain
    assert plain.endswith("--enable-metrics --max-running-requests 16")
    # The same layout, plus the drafter's flags (the train stage's).
    assert dflash == (
        f"{plain} --speculative-algorithm DFLASH --speculative-draft-model-path {ct200['export']} "
        "--speculative-num-draft-tokens 16"
    )
    assert "(the train stage's sglang_dflash.args)" in flat
    assert "pp_size 1: DFLASH needs pp_size == 1" in flat and "overlap scheduler on for both servers" in flat
    assert "requests still to send: plain 9, dflash 6" in flat  # 3 prompts x (c1, c16, probe) / (c1, c16)
    assert "10.1.2.200" not in out
    assert not ct200["work"].joinpath("evaluate").exists() and not ct200["work"].joinpath("serving").exists()


def _report_argv(ct200: dict) -> list[str]:
    """The report command the role would run, as check mode shows it (JSON results: exact strings)."""
    run = _play(ct200, "--check", json_results=True)
    assert run.returncode == 0, run.output[-6000:]
    found = re.findall(r'"msg": "(PYTHONPATH=(?:[^"\\]|\\.)*)"', run.output)
    (command,) = [json.loads(f'"{m}"') for m in found if "evaluate_serving report" in json.loads(f'"{m}"')]
    argv = shlex.split(command)[1:]  # without PYTHONPATH=...
    assert argv[:4] == [PY, "-m", "regen.jobs.evaluate_serving", "report"]
    return argv


def _write_records(argv: list[str]) -> None:
    """Both servers' records for the role's exact inputs, from SGLang's recorded metadata (sglang#33518)."""
    from regen.jobs import evaluate_serving as E

    args = E.build_parser().parse_args(argv[3:])
    inputs = E.Inputs(args)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    results = E.Results(args.output_dir / "results.jsonl", inputs.digests)
    record = json.loads((FIXTURES / "sglang" / "spec_meta_info.json").read_text())["records"][0]
    meta = dict(record["meta_info"], completion_tokens=record["completion_tokens"])
    ids = list(range(1000, 1000 + record["completion_tokens"]))
    for server in ("plain", "dflash"):
        for key in inputs.expected(server):
            answer = {
                "output_ids": ids,
                "meta_info": meta if server == "dflash" else {"completion_tokens": len(ids)},
            }
            parsed = S.parse_generate_response(answer, want_top=key[1] == "probe")
            results.add(
                {
                    "kind": "request",
                    "server": server,
                    "setting": key[1],
                    "prompt_id": key[2],
                    "turn_kind": key[3],
                    "category": "chat",
                    "api": "native",
                    "seconds": 2.0 if server == "plain" else 1.0,
                    **parsed,
                }
            )
        results.add(
            {
                "kind": "segment",
                "server": server,
                "setting": "c16",
                "concurrency": 16,
                "requests": 3,
                "tokens": 318,
                "seconds": 3.0 if server == "plain" else 2.0,
                "complete": True,
            }
        )


def test_a_current_report_starts_nothing_and_a_second_run_changes_nothing(ct200: dict) -> None:
    argv = _report_argv(ct200)
    _write_records(argv)
    made = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert made.returncode == 0, made.stderr[-3000:]
    report = json.loads((ct200["work"] / "evaluate" / "sglang" / "report.json").read_text())
    assert report["drafters"]["trained"]["acceptance_length"] == round(106 / 43, 4)
    assert report["speedup"]["value"] == 2.0 and report["speedup"]["batch"]["value"] == 1.5

    first = _play(ct200)
    assert first.returncode == 0, first.output[-6000:]
    flat = re.sub(r"\s+", " ", first.output)
    assert "nothing is served again" in flat
    assert "TASK [Serve the target" not in flat and "Free the GPUs" not in flat
    published = json.loads((ct200["artifacts"] / "evaluate" / "report.json").read_text())
    assert published == report and (ct200["artifacts"] / "evaluate" / "report.md").exists()
    assert "speedup 2.00x at concurrency 1, 1.50x at concurrency 16; lossless" in flat

    second = _play(ct200)
    assert second.returncode == 0, second.output[-6000:]
    assert second.counts("ct200")["changed"] == 0, second.output[-6000:]
