"""playbooks/introspect.yml on localhost against the demo model: facts file, plan, idempotence, check mode,
and the early failure (with the remedy) when the serving venv cannot load the tokenizer; without tokenizer
files the facts and the config-decided plan are written and only the stages that need the rest stop.

Each run uses a temporary inventory that names only localhost (connection local).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tests.helpers.ansible import localhost_inventory, run_playbook


def _inventory(tmp_path: Path, model: Path, python: Path, **extra: object) -> Path:
    variables = {
        "regen_model_path": str(model),
        "regen_serving_python": str(python),
        "regen_artifacts_dir": str(tmp_path / "artifacts"),
        "regen_profile": "cpu",
        # Keep the import probe short: torch and sglang are not what these tests are about.
        "model_facts_env_modules": ["tiktoken", "jinja2"],
        **extra,
    }
    return localhost_inventory(tmp_path / "inventory.yml", groups=("regen_serve",), variables=variables)


def _play(inventory: Path, *args: str) -> tuple[str, tuple[int, int, int, int]]:
    run = run_playbook("playbooks/introspect.yml", *args, inventory=inventory, timeout=600)
    counts = run.counts("localhost")
    return run.output, (counts["ok"], counts["changed"], counts["unreachable"], counts["failed"])


def test_facts_written_and_second_run_changes_nothing(tmp_path: Path, demo_model_dir: Path) -> None:
    project_python = Path(sys.executable)
    inventory = _inventory(
        tmp_path, demo_model_dir, project_python, model_facts_plan_overrides={"drafter": {"block_size": 8}}
    )
    output, (_, changed, _, failed) = _play(inventory)
    assert failed == 0, output[-4000:]
    facts_file = tmp_path / "artifacts" / "model_facts.json"
    facts = json.loads(facts_file.read_text())
    assert set(facts) >= {"architecture", "tokenizer", "environment", "plan"}
    assert facts["tokenizer"]["loaded_with"] == "library"
    assert facts["environment"]["gpu"]["count"] == 0 or facts["environment"]["gpu"]["count"] > 0
    plan = facts["plan"]
    gpus = facts["environment"]["gpu"]["count"]
    if gpus == 0:
        assert (plan["serving"]["tp_size"]["value"], plan["serving"]["ep_size"]["value"]) == (1, 1)
    assert plan["generation"]["chat_template_kwargs"]["value"] == {"thinking": True}
    assert plan["drafter"]["mask_token_id"]["value"] == facts["tokenizer"]["mask_token"]["id"]
    assert plan["drafter"]["block_size"] == {
        "value": 8,
        "derived": 16,
        "reason": "set in inventory (model_facts_plan_overrides.drafter.block_size)",
    }
    assert changed >= 1
    before = facts_file.stat().st_mtime_ns
    output, (_, changed, _, failed) = _play(inventory)
    assert (changed, failed) == (0, 0), output[-4000:]
    assert facts_file.stat().st_mtime_ns == before
    output, (_, changed, _, failed) = _play(inventory, "--check")
    assert (changed, failed) == (0, 0), output[-4000:]


def test_unknown_override_fails_early(tmp_path: Path, demo_model_dir: Path) -> None:
    inventory = _inventory(
        tmp_path, demo_model_dir, Path(sys.executable), model_facts_plan_overrides={"serving": {"tp_szie": 2}}
    )
    output, (_, _, _, failed) = _play(inventory)
    assert failed == 1
    assert "model_facts_plan_overrides.serving.tp_szie is not a plan value" in output
    assert "Read GPU facts" not in output  # checked before any module runs
    assert not (tmp_path / "artifacts" / "model_facts.json").exists()


def test_serving_venv_without_tiktoken_fails_early_with_the_remedy(
    tmp_path: Path, demo_model_dir: Path, python_without_tiktoken: Path
) -> None:
    inventory = _inventory(tmp_path, demo_model_dir, python_without_tiktoken)
    output, (_, _, _, failed) = _play(inventory)
    venv = str(python_without_tiktoken.parent.parent)
    assert failed == 1, output[-4000:]
    assert "Check the serving venv can load the tokenizer" in output
    assert f"tiktoken is not installed in {venv}; add it to regen_serving_packages" in output
    # The facts are written first, so the artifact explains the failure.
    facts = json.loads((tmp_path / "artifacts" / "model_facts.json").read_text())
    assert facts["tokenizer"]["loaded_with"] == "raw_files"
    assert facts["tokenizer"]["load"]["missing_modules"] == ["tiktoken"]
    assert facts["plan"]["drafter"]["mask_token_id"]["value"] is not None


def test_check_mode_before_the_model_exists_ends_the_preview_and_says_why(tmp_path: Path) -> None:
    missing = tmp_path / "models" / "not-built-yet"
    inventory = _inventory(tmp_path, missing, Path(sys.executable))
    output, (_, changed, _, failed) = _play(inventory, "--check")
    assert (changed, failed) == (0, 0), output[-4000:]
    flowing = " ".join(output.split())  # the YAML callback folds long messages at spaces
    assert f"check mode: {missing} does not exist yet" in flowing
    assert "Read the model architecture" not in output
    assert not (tmp_path / "artifacts" / "model_facts.json").exists()
    # Outside check mode the same inventory still fails, naming the directory.
    output, (_, _, _, failed) = _play(inventory)
    assert failed == 1
    assert f"model directory {missing} does not exist" in " ".join(output.split())


def _config_only_copy(demo: Path, dest: Path) -> Path:
    """The demo model without its tokenizer files (and without weight shards: the index's total_size is
    what the plan reads): what a user has who copied only the config and the index."""
    dest.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        shutil.copy(demo / name, dest / name)
    for code in demo.glob("*.py"):
        if not code.name.startswith("tokenization"):
            shutil.copy(code, dest / code.name)
    return dest


def test_without_tokenizer_files_the_facts_and_the_config_plan_are_written(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    model = _config_only_copy(demo_model_dir, tmp_path / "models" / "config-only")
    inventory = localhost_inventory(
        tmp_path / "inventory.yml",
        groups=("regen_serve", "regen_generate"),
        variables={
            "regen_model_path": str(model),
            "regen_serving_python": sys.executable,
            "regen_artifacts_dir": str(tmp_path / "artifacts"),
            "regen_work_dir": str(tmp_path / "work"),
            "regen_profile": "cpu",
            "model_facts_env_modules": ["jinja2"],
        },
    )
    output, (_, changed, _, failed) = _play(inventory)
    assert failed == 0, output[-4000:]
    assert changed >= 1
    facts = json.loads((tmp_path / "artifacts" / "model_facts.json").read_text())
    assert facts["tokenizer"]["available"] is False
    assert facts["architecture"]["num_layers"] and facts["plan"]["drafter"]["target_layer_ids"]["value"]
    assert facts["plan"]["serving"]["tp_size"]["value"] == 1
    unknown = {f"{s}.{k}" for s, entries in facts["plan"].items() if isinstance(entries, dict)
               for k, e in entries.items() if isinstance(e, dict) and e.get("unknown")}
    needed = {"drafter.mask_token_id", "generation.chat_template_kwargs", "generation.reasoning_parser"}
    assert needed <= unknown
    flowing = " ".join(output.split())
    assert f"no tokenizer facts for {model}" in flowing and "are unknown" in flowing

    output, (_, changed, _, failed) = _play(inventory)
    assert (changed, failed) == (0, 0), output[-4000:]

    # The stages that need the unknown parts stop, with the reason; nothing else is asked of them first.
    tokenize = run_playbook("playbooks/tokenize.yml", inventory=inventory, timeout=600)
    flowing = " ".join(tokenize.output.split())
    assert tokenize.counts("localhost")["failed"] == 1, flowing[-3000:]
    assert "the plan's drafter.mask_token_id is unknown" in flowing and "holds no tokenizer files" in flowing
    assert "or set tokenized_data_mask_token_id" in flowing


def _two_serving_hosts(tmp_path: Path, model: Path, second: dict) -> Path:
    """Two serving hosts on this machine (local connection each, as a router's workers would be), the second
    with `second` as its own variables."""
    import yaml

    inventory = _inventory(tmp_path, model, Path(sys.executable))
    document = yaml.safe_load(inventory.read_text())
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    document["all"]["hosts"] = {"serve-a": dict(local), "serve-b": {**local, **second}}
    document["all"]["children"] = {"regen_serve": {"hosts": {"serve-a": None, "serve-b": None}}}
    inventory.write_text(yaml.safe_dump(document))
    return inventory


def test_two_alike_serving_hosts_write_one_facts_file_and_a_second_run_changes_nothing(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """Several serving hosts (behind a router) share one plan: the facts file is the first host's, written
    once, so a second run changes nothing (each host used to write its own over the other's)."""
    inventory = _two_serving_hosts(tmp_path, demo_model_dir, {})
    first = run_playbook("playbooks/introspect.yml", inventory=inventory, timeout=600)
    for host in ("serve-a", "serve-b"):
        assert first.counts(host)["failed"] == 0, first.output[-4000:]
    facts = json.loads((tmp_path / "artifacts" / "model_facts.json").read_text())
    assert facts["host"] == "serve-a"
    second = run_playbook("playbooks/introspect.yml", inventory=inventory, timeout=600)
    for host in ("serve-a", "serve-b"):
        counts = second.counts(host)
        assert (counts["changed"], counts["failed"]) == (0, 0), second.output[-4000:]


def test_serving_hosts_that_plan_differently_are_refused_naming_the_host(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    inventory = _two_serving_hosts(tmp_path, demo_model_dir, {"model_facts_length_budget": 3000})
    run = run_playbook("playbooks/introspect.yml", inventory=inventory, timeout=600)
    assert run.counts("serve-a")["failed"] + run.counts("serve-b")["failed"] >= 1, run.output[-4000:]
    assert "the serving hosts serve-b get another plan than serve-a" in " ".join(run.output.split())
    assert not (tmp_path / "artifacts" / "model_facts.json").exists()
