"""The generate stage through the real playbooks when the job does not end well (issue 15), and its key.

Against the fault-injection STUB server on loopback; the full disk is a small tmpfs (root only), unmounted
by the fixture. A failed job must fail the play with the job's own words, never pass it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.ansible import run_playbook
from tests.helpers.stub_openai_server import StubConfig, StubServer

PLAYBOOKS = ("playbooks/prompts.yml", "playbooks/generate.yml")


def stage_vars(tmp_path: Path, stub: StubServer, **more) -> dict:
    return {
        "regen_work_dir": str(tmp_path / "work"),
        "regen_artifacts_dir": str(tmp_path / "artifacts"),
        "regen_serving_endpoint": stub.url,
        "regen_served_model_name": "regen-demo-kimi",
        # what the introspect stage publishes: the kwargs and the length budget's max_tokens
        "regen_model_facts": {
            "plan": {
                "generation": {"chat_template_kwargs": {"value": {}, "reason": "none"}},
                "length": {"max_tokens": {"value": 4096, "reason": "the default per turn"}},
            }
        },
        "prompt_data_sources": [{"builtin": "demo"}],
        "completions_poll_interval_s": 1,
        "completions_concurrency": 4,
        **more,
    }


@pytest.fixture
def small_tmpfs(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    point = tmp_path / "disk"
    point.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "regen-test", str(point)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    # a disk others filled: six pages are left, less than the demo's completions and their ledger need
    (point / "filler").write_bytes(b"\0" * (256 - 24) * 1024)
    yield point
    subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_full_disk_fails_the_stage_with_the_jobs_own_message(tmp_path, small_tmpfs):
    with StubServer(StubConfig(tokens=400)) as stub:
        extra = stage_vars(tmp_path, stub, completions_output_dir=str(small_tmpfs / "completions"))
        run = run_playbook(PLAYBOOKS, extra_vars=extra, timeout=300)
    out = run.output
    assert run.returncode != 0 and run.counts("localhost")["failed"] == 1, out[-4000:]
    assert "the generation job exited with 5 (the output cannot be written" in out, out[-4000:]
    assert "disk is full" in out or "No space left on device" in out, out[-4000:]


def test_the_api_key_and_the_hf_token_reach_the_jobs_in_files_and_never_show(tmp_path):
    key, token = "sk-role-secret-4242", "hf_role_token_5151"
    with StubServer(StubConfig(record=True)) as stub:
        # the pipeline's one key (regen_api_key), handed to the job as the serve stage hands its own
        extra = stage_vars(tmp_path, stub, regen_api_key=key, prompt_data_hf_token=token)
        run = run_playbook(PLAYBOOKS, "-vvv", extra_vars=extra, timeout=300)
        assert run.returncode == 0, run.output[-4000:]
        assert stub.requests and all(r["authorization"] == f"Bearer {key}" for r in stub.requests)
    assert "--api-key-env-file" in run.output and "DEPRECATED" not in run.output
    # not in the task results at -v (the old `_completions_environment` fact), not in the
    # `/bin/sh -c '... AnsiballZ'` command lines that -vvv prints (and `ps` shows)
    assert key not in run.output and token not in run.output
    assert "--hf-token-file" in run.output, "the prompts job got the token (through its file)"
    completions = tmp_path / "work" / "completions"
    assert not (completions / ".api-key").exists(), "the key file lives only while the job runs"
    status = json.loads((tmp_path / "artifacts" / "completions" / "status-localhost.json").read_text())
    assert status["state"] == "done"


def test_a_refused_api_key_fails_the_stage_at_once_naming_the_variable(tmp_path):
    with StubServer(StubConfig(error_rate=1.0, error_status=(401,))) as stub:
        extra = stage_vars(tmp_path, stub, completions_api_key="sk-wrong-7777")
        run = run_playbook(PLAYBOOKS, extra_vars=extra, timeout=300)
        sent = stub.stats["requests"]
    out = run.output
    assert run.returncode != 0, out[-4000:]
    assert "the generation job exited with 2 (bad arguments or input" in out, out[-4000:]
    assert "HTTP 401" in out and "completions_api_key" in out and "sk-wrong-7777" not in out, out[-4000:]
    # the role-level name still works, and says it is deprecated
    assert "DEPRECATED: completions_api_key set on its own: set regen_api_key" in " ".join(out.split())
    assert sent < 24, "stopped at the first refusals instead of sending every prompt"


def test_a_failed_prompts_job_fails_the_stage_with_its_own_words(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the prompts directory should go\n")
    extra = {
        "regen_work_dir": str(tmp_path / "work"),
        "regen_artifacts_dir": str(tmp_path / "artifacts"),
        "prompt_data_sources": [{"builtin": "demo"}],
        "prompt_data_output_dir": str(blocker / "prompts"),
    }
    run = run_playbook("playbooks/prompts.yml", extra_vars=extra, timeout=300)
    out = run.output
    assert run.returncode != 0 and "the prompts job exited with 5 (the output cannot be written)" in out, out[
        -3000:
    ]
    assert f"lies under {blocker}, which is a file, not a directory" in out, out[-3000:]


def test_an_endpoint_password_never_shows_and_the_job_still_uses_it(tmp_path):
    secret = "pw-route-9191"
    with StubServer(StubConfig(record=True)) as stub:
        url = stub.url.replace("http://", f"http://alice:{secret}@")
        extra = stage_vars(tmp_path, stub, completions_endpoints=[url])
        run = run_playbook(PLAYBOOKS, "-vvv", extra_vars=extra, timeout=300)
        assert run.returncode == 0, run.output[-4000:]
        # aiohttp sends the URL's credentials as Basic auth: the job really used the file's URL
        assert stub.requests and all(r["authorization"].startswith("Basic ") for r in stub.requests)
    assert secret not in run.output, "the password showed on a command line or in a task result"
    completions = tmp_path / "work" / "completions"
    assert not (completions / ".endpoints").exists()
    for path in [
        completions / "status.json",
        tmp_path / "artifacts" / "completions" / "status-localhost.json",
    ]:
        assert secret not in path.read_text() and "alice:***@" in path.read_text()


def test_a_server_answering_garbage_fails_the_stage_with_the_detectors_words(tmp_path):
    # Every answer is the "+" x 50 an NVFP4 model served on sm_120 (sgl-project/sglang issue 24321): with the
    # role's defaults the rolling stop trips after 20 answers and the stage fails, keeping what it wrote.
    # (The local inventory turns the stop off for its demo model: the role's default window is set again.)
    garbage = "+" * 50
    with StubServer(StubConfig(replies={"": garbage})) as stub:
        extra = stage_vars(tmp_path, stub, completions_concurrency=1, completions_degenerate_window=200)
        run = run_playbook(PLAYBOOKS, extra_vars=extra, timeout=300)
    out = run.output
    assert run.returncode != 0 and run.counts("localhost")["failed"] == 1, out[-4000:]
    assert "the generation job exited with 3" in out, out[-4000:]
    assert "completions are degenerate" in out and "the server is producing garbage" in out, out[-4000:]
    status = json.loads((tmp_path / "work" / "completions" / "status.json").read_text())
    assert status["state"] == "failed" and status["degeneration"]["tripped"] is True
    assert 20 <= status["done"] < 24
