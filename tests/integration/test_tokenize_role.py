"""The tokenized_data role through real ansible-playbook runs on localhost: facts in, dataset and report out,
a second run changes nothing, check mode writes nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.ansible import ansible_env, run_playbook


def _records(n: int, start: int = 0) -> str:
    return "".join(
        json.dumps(
            {
                "id": f"p{i}",
                "finish_reason": "stop",
                "conversations": [
                    {"role": "user", "content": f"Spell the number {i}."},
                    {
                        "role": "assistant",
                        "content": f"The number {i} is spelled out in words.",
                        "reasoning_content": "Easy.",
                    },
                ],
            }
        )
        + "\n"
        for i in range(start, start + n)
    )


def playbook(work: Path, model: Path, *extra: str) -> tuple[dict[str, int], str]:
    run = run_playbook(
        "playbooks/tokenize.yml",
        *("-e", f"regen_work_dir={work}"),
        *("-e", f"regen_artifacts_dir={work}/artifacts"),
        *("-e", f"regen_model_path={model}"),
        *("-e", f"regen_job_python={sys.executable}"),
        *("-e", "tokenized_data_workers=1"),
        *extra,
        env=ansible_env(ANSIBLE_CACHE_PLUGIN_CONNECTION=str(work / "facts")),
        timeout=600,
    )
    assert run.returncode == 0, run.output[-5000:]
    return run.counts("localhost"), run.output


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "completions").mkdir()
    (tmp_path / "completions" / "completions-00000.jsonl").write_text(_records(30))
    facts = {
        "plan": {
            "drafter": {"mask_token_id": {"value": 4000, "reason": "a reserved token"}},
            "generation": {"chat_template_kwargs": {"value": {"thinking": True}, "reason": "Kimi"}},
            # the plan's one length budget, what the introspect stage derives from the prompt set
            "length": {"budget": {"value": 96, "reason": "longest conversation: 40 + 1 x (48 + 8) = 96"}},
        }
    }
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "model_facts.json").write_text(json.dumps(facts))
    return tmp_path


def test_role_tokenizes_once_and_then_changes_nothing(work, demo_model_dir):
    first, output = playbook(work, demo_model_dir)
    assert first["changed"] > 0
    stats = json.loads((work / "artifacts" / "tokenized" / "stats.json").read_text())
    assert stats == json.loads((work / "tokenized" / "stats.json").read_text())
    assert stats["samples"] == 30 and stats["mask_token"]["id"] == 4000  # from the facts
    assert stats["config"]["max_length"] == 96  # the plan's length budget
    assert "overrides the plan's length budget" not in output
    assert stats["config"]["chat_template_kwargs"] == {"thinking": True}
    assert stats["config"]["reasoning"] == "last"
    assert stats["reasoning"]["placed_after_generation_prompt"] == 30
    assert (work / "artifacts" / "tokenized" / "length_histogram.png").read_bytes()[:4] == b"\x89PNG"

    second, output = playbook(work, demo_model_dir)
    assert second["changed"] == 0, output[-3000:]

    # More completions: check mode says it would work and writes nothing.
    with open(work / "completions" / "completions-00000.jsonl", "a") as fh:
        fh.write(_records(5, start=30))
    before = (work / "tokenized" / "stats.json").read_bytes()
    checked, output = playbook(work, demo_model_dir, "--check")
    assert checked["changed"] > 0 and "would tokenize 1 of 1 shard" in output
    assert (work / "tokenized" / "stats.json").read_bytes() == before


def test_check_mode_before_anything_exists_does_not_fail(tmp_path, demo_model_dir):
    result, output = playbook(tmp_path, demo_model_dir, "--check")
    assert result["failed"] == 0 and "once the earlier stages have run" in output
    assert not (tmp_path / "tokenized").exists()


def test_a_max_length_of_its_own_overrides_the_budget_and_says_so(work, demo_model_dir):
    _, output = playbook(work, demo_model_dir, "-e", "regen_max_length=64")
    stats = json.loads((work / "tokenized" / "stats.json").read_text())
    assert stats["config"]["max_length"] == 64
    said = " ".join(output.split())  # the callback wraps long messages
    assert "(regen_max_length) = 64 overrides the plan" in said and "budget of 96 tokens" in said
