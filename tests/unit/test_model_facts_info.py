"""library/model_facts_info.py through real `ansible` ad-hoc runs on localhost: which facts win, the plan's
values unwrapped, and the failure (with the fix) for a facts file that is not JSON."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.helpers.ansible import localhost_inventory, run_playbook

PLAN = {
    "serving": {"tp_size": {"value": 8, "reason": "fits at TP8"}, "ep_size": 8},
    "generation": {"chat_template_kwargs": {"value": {"thinking": True}, "reason": "the template reads it"}},
    "warnings": [],
}


def _run(tmp_path: Path, *calls: dict) -> list[dict]:
    """One real playbook run on localhost calling the module once per entry of `calls`; their results."""
    results = tmp_path / "results"
    tasks = []
    for i, args in enumerate(calls):
        tasks += [
            {"name": f"call {i}", "model_facts_info": args, "register": f"r{i}", "ignore_errors": True},
            {"name": f"keep {i}", "ansible.builtin.copy": {"content": f"{{{{ r{i} | to_json }}}}",
                                                          "dest": f"{results}/{i}.json", "mode": "0644"}},
        ]
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": tasks}]))
    results.mkdir()
    run = run_playbook(str(playbook), inventory=localhost_inventory(tmp_path / "inventory.yml"), timeout=300)
    assert run.counts()["unreachable"] == 0, run.output[-3000:]
    return [json.loads((results / f"{i}.json").read_text()) for i in range(len(calls))]


def test_memory_wins_then_the_file_then_nothing(tmp_path: Path) -> None:
    path = tmp_path / "model_facts.json"
    path.write_text(json.dumps({"plan": PLAN, "architecture": {"num_layers": 61}}))
    memory = {"plan": {"drafter": {"block_size": {"value": 16, "reason": "r"}}}}

    first, second, none = _run(
        tmp_path,
        {"documents": [{}, memory], "path": str(path)},
        {"documents": [{}], "path": str(path)},
        {"path": str(tmp_path / "absent.json")},
    )
    assert first["source"] == "memory" and first["facts"] == memory
    assert first["plan_values"] == {
        "serving": {}, "generation": {}, "drafter": {"block_size": 16}, "length": {}, "nccl": {},
        "estimate": {}}

    assert second["source"] == str(path) and second["facts"]["architecture"] == {"num_layers": 61}
    # {value, reason} entries unwrapped, a bare value (an inventory override) kept as it is
    assert second["plan_values"]["serving"] == {"tp_size": 8, "ep_size": 8}
    assert second["plan_values"]["generation"] == {"chat_template_kwargs": {"thinking": True}}
    assert second["plan_values"]["drafter"] == {} and second["changed"] is False

    assert none["source"] == "none" and none["facts"] == {}
    assert none["plan_values"] == {"serving": {}, "generation": {}, "drafter": {}, "length": {}, "nccl": {},
                                   "estimate": {}}


def test_a_broken_facts_file_fails_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "model_facts.json"
    path.write_text('{"plan": ')  # cut short, as an interrupted copy leaves it
    (result,) = _run(tmp_path, {"path": str(path)})
    assert result["failed"] is True
    assert str(path) in result["msg"] and "--tags introspect" in result["msg"]
