"""Item 6 of issue 26 (the wait loops): with the checkout's ansible.cfg, a wait loop on a running job prints
the job's own progress line from its status document and no "FAILED - RETRYING" line; -v brings the retry
lines back. tests/e2e/test_demo_pipeline.py asserts the same of a whole `regen.yml` run."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.ansible import ROOT, ansible_env, run_playbook

PLAYBOOK = ROOT / "tests" / "fixtures" / "playbooks" / "progress" / "wait.yml"


def test_a_wait_loop_shows_the_jobs_progress_instead_of_retries(tmp_path: Path) -> None:
    env = ansible_env(FIXTURE_DIR=str(tmp_path), REGEN_PROGRESS_INTERVAL_S="0")
    run = run_playbook(PLAYBOOK, env=env, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "FAILED - RETRYING" not in output
    assert "[localhost] Wait for the counting job: waiting 0s" in output  # the first poll
    assert re.search(r"waiting \d+s: \d/4 steps \(\d+%\), counting: \d/4 steps", output), output


def test_verbose_runs_keep_the_retry_lines(tmp_path: Path) -> None:
    env = ansible_env(FIXTURE_DIR=str(tmp_path))
    run = run_playbook(PLAYBOOK, "-v", env=env, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FAILED - RETRYING" in run.stdout
