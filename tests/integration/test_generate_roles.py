"""The prompts and generate stages through the real playbooks and inventory, against the STUB server.

What the serve and introspect stages would publish (endpoint, served model name, the facts' plan with
its chat-template kwargs) is passed as extra vars, so the roles resolve them exactly as in a full run;
data and artifacts go to a temporary directory. Real-model generation runs in the e2e pipeline.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tests.helpers.ansible import run_playbook
from tests.helpers.stub_openai_server import StubConfig, StubServer

# The prompts regen ships for the embedded default (`builtin: demo`).
DEMO_PROMPTS = len(resources.files("regen.data").joinpath("demo_prompts.jsonl").read_text().splitlines())


def play(extra_vars: dict, *args: str) -> tuple[int, int, str]:
    run = run_playbook(
        ("playbooks/prompts.yml", "playbooks/generate.yml"), *args, extra_vars=extra_vars, timeout=300
    )
    # one recap per playbook, each counting the whole run so far: counts() holds the last, the total
    return run.returncode, run.counts("localhost")["changed"], run.output


def test_prompts_and_generate_stages(tmp_path):
    # two poison prompts fail on the first run, as prompts a real server rejects would
    config = StubConfig(
        delay=0.01, reasoning="when_thinking", record=True, fail_match="POISON", fail_kind="500"
    )
    with StubServer(config) as stub:
        extra = {
            "regen_work_dir": str(tmp_path / "work"),
            "regen_artifacts_dir": str(tmp_path / "artifacts"),
            # what the serve and introspect stages publish
            "regen_serving_endpoint": stub.url,
            "regen_served_model_name": "regen-demo-kimi",
            "regen_model_facts": {
                "plan": {
                    "generation": {
                        "chat_template_kwargs": {
                            "value": {"thinking": True},
                            "reason": "the template reads it",
                        }
                    },
                    # the one length budget: max_tokens per turn (no role falls back to a number)
                    "length": {"max_tokens": {"value": 4096, "reason": "the default per turn"}},
                }
            },
            "prompt_data_sources": [
                {"builtin": "demo"},
                {"path": str(write_poison(tmp_path)), "name": "poison"},
            ],
            "completions_poll_interval_s": 1,
            "completions_concurrency": 8,
            "completions_max_retries": 1,
            # every prompt is generated (the local inventory holds a quarter out for the evaluate stage)
            "prompt_data_eval_fraction": 0.0,
        }
        rc, changed, out = play(extra, "--check")
        assert (rc, changed) == (0, 2), out[-4000:]
        assert not (tmp_path / "work").exists()

        # a failing prompt fails the play with the job's summary and the way out
        rc, changed, out = play(extra)
        assert (
            rc != 0
            and f"done={DEMO_PROMPTS} failed=2" in out
            and "errors.jsonl; those that failed on the server side are retried" in out
        ), out[-4000:]
        completions = tmp_path / "work" / "completions"
        recs = [
            json.loads(x)
            for p in sorted(completions.glob("completions-*.jsonl"))
            for x in p.read_text().splitlines()
        ]
        assert len(recs) == len({r["id"] for r in recs}) == DEMO_PROMPTS
        # the facts decided the kwargs and the served name; the stub answered with reasoning because of them
        assert all(r["body"]["chat_template_kwargs"] == {"thinking": True} for r in stub.requests)
        assert all(r["body"]["model"] == "regen-demo-kimi" for r in stub.requests)
        assert all(r["conversations"][-1].get("reasoning_content") for r in recs)

        # the server recovers: the next run retries only the two, then everything is up to date
        stub.configure(fail_match=None)
        rc, changed, out = play(extra)
        assert rc == 0 and changed >= 1 and f"done=2 failed=0 skipped={DEMO_PROMPTS}" in out, out[-4000:]
        status = json.loads((tmp_path / "artifacts" / "completions" / "status-localhost.json").read_text())
        assert status["state"] == "done" and status["skipped"] == DEMO_PROMPTS
        sent = len(stub.requests)

        rc, changed, out = play(extra)
        assert (rc, changed) == (0, 0), out[-4000:]
        total = DEMO_PROMPTS + 2
        assert f"completions up to date: {total} of {total}" in out and len(stub.requests) == sent

        rc, changed, out = play(extra, "--check")
        assert (rc, changed) == (0, 0), out[-4000:]


def write_poison(tmp_path: Path) -> Path:
    path = tmp_path / "poison.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"x{i}", "prompt": f"POISON prompt {i}"}) + "\n" for i in range(2))
    )
    return path


def test_a_stage_run_alone_reaches_the_recorded_server_or_fails_naming_the_variable(tmp_path):
    """`--tags generate` on its own: no endpoint is set or published in this run. Without a serving record
    the stage fails naming completions_endpoints and the records' directory (no default port is tried);
    with the record the serve stage writes (serving/<host>-<instance>/state.json) it sends every request
    to the recorded server, here on a port that is not SGLang's default."""
    with StubServer(StubConfig(delay=0.0, record=True)) as stub:
        assert not stub.url.endswith(":30000")
        extra = {
            "regen_work_dir": str(tmp_path / "work"),
            "regen_artifacts_dir": str(tmp_path / "artifacts"),
            "regen_model_facts": {
                "plan": {
                    "generation": {"chat_template_kwargs": {"value": {}, "reason": "none"}},
                    "length": {"max_tokens": {"value": 16, "reason": "short answers"}},
                }
            },
            "prompt_data_sample": 3,
            "prompt_data_eval_fraction": 0.0,
            "completions_concurrency": 2,
            "completions_poll_interval_s": 1,
        }
        rc, _, out = play(extra)
        said = " ".join(out.split())
        assert rc != 0 and "completions_endpoints is not set" in said, out[-4000:]
        assert f"{tmp_path}/artifacts/serving" in said and stub.requests == []

        # what the serving role records while its server runs (roles/sglang_server/tasks/record.yml)
        record = tmp_path / "artifacts" / "serving" / "localhost-main"
        record.mkdir(parents=True)
        state = {"state": "running", "kind": "server", "endpoint": stub.url, "served_model_name": "recorded"}
        (record / "state.json").write_text(json.dumps(state))
        rc, _, out = play(extra)
        assert rc == 0, out[-4000:]
        assert len(stub.requests) >= 3 and all(r["body"]["model"] == "recorded" for r in stub.requests)
