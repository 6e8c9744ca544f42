"""Every custom module documents itself the way users read it: `ansible-doc` parses its DOCUMENTATION, its
options are exactly its argument_spec (same types), its EXAMPLES are a YAML list of tasks that call it, and
the keys it really returns (each module run here for real, in check mode where it has one) are the ones its
RETURN names, with every `returned: always` key present."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.module_utils import basic
from ansible.module_utils.testing import patch_module_args

from tests.helpers.ansible import ansible_env
from tests.helpers.modules import run_module

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "library"
MODULES = sorted(path.stem for path in LIBRARY.glob("*.py"))
ANSIBLE_DOC = str(Path(sys.executable).parent / "ansible-doc")
FIXTURES = ROOT / "tests" / "fixtures"
KIMI_FACTS = json.loads((FIXTURES / "serving" / "facts-kimi-k2.6.json").read_text())
# Keys Ansible itself adds to every result, and the file attributes it adds when a result names a `dest`.
ANSIBLE_KEYS = {"changed", "failed", "msg", "invocation", "warnings", "deprecations", "diff", "skipped"}
FILE_ATTRIBUTES = {"uid", "gid", "owner", "group", "mode", "state", "size", "secontext"}


@pytest.fixture(scope="module")
def docs() -> dict[str, Any]:
    """ansible-doc's JSON for every module in library/, in one run."""
    run = subprocess.run(
        [ANSIBLE_DOC, "-M", str(LIBRARY), "-t", "module", "--json", *MODULES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=ansible_env(),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout)
    assert sorted(found) == MODULES, run.stderr[-3000:]
    return found


class _SpecSeen(Exception):
    pass


def _argument_spec(name: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The argument_spec a module's main() hands to AnsibleModule (main stops right there)."""
    seen: dict[str, Any] = {}

    def record(self, argument_spec, **_):
        seen.update(argument_spec)
        raise _SpecSeen

    monkeypatch.setattr(basic.AnsibleModule, "__init__", record)
    module = __import__(name)
    with patch_module_args({}), pytest.raises(_SpecSeen):
        module.main()
    return seen


@pytest.mark.parametrize("name", MODULES)
def test_documentation_matches_the_argument_spec(
    name: str, docs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = docs[name]["doc"]
    assert doc["module"] == name and doc["short_description"]
    spec = _argument_spec(name, monkeypatch)
    options = doc.get("options") or {}
    assert set(options) == set(spec), f"{name}: documented {sorted(options)}, accepted {sorted(spec)}"
    for option, accepted in spec.items():
        assert options[option].get("type", "str") == accepted.get("type", "str"), f"{name}.{option}"
        assert bool(options[option].get("required")) == bool(accepted.get("required")), f"{name}.{option}"


@pytest.mark.parametrize("name", MODULES)
def test_examples_are_tasks_that_call_the_module(name: str, docs: dict[str, Any]) -> None:
    tasks = yaml.safe_load(docs[name]["examples"])
    assert isinstance(tasks, list) and tasks, name
    assert all(isinstance(task, dict) and task.get("name") for task in tasks), name
    assert any(name in task for task in tasks), f"no example of {name} calls {name}"


# -- RETURN against what each module really returns -----------------------------------------------------


def _project_copy(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    return project


def _args(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], request) -> dict[str, Any]:
    """Real inputs for one run of module `name` on this machine (check mode: nothing is changed)."""
    kimi = str(FIXTURES / "configs" / "kimi-k2.5")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    if name in ("gpu_info", "python_env_info"):
        return {"modules": ["json", "jinja2"]} if name == "python_env_info" else {}
    if name == "model_config_info":
        return {"path": kimi}
    if name == "tokenizer_info":
        return {"path": str(request.getfixturevalue("demo_model_dir")), "mode": "raw_files"}
    if name == "model_plan_info":
        architecture = run_module("model_config_info", {"path": kimi}, capsys)["architecture"]
        return {"architecture": architecture, "gpu": KIMI_FACTS["environment"]["gpu"]}
    if name == "pcie_info":
        return {"want_kernel_args": ["iommu=pt"]}
    if name == "lxc_gpu_config_info":
        # Limits any node grants (a sandboxed test host may not raise its hard limits to memlock unlimited).
        return {"style": "lxc", "gpu_count": 1, "nofile": 1024, "memlock": "65536", "shm_size_gib": 1,
                "node_names": ["null"]}
    if name == "model_weights":
        return {"state": "check", "dest": str(model), "source": "mirror:/nowhere"}
    if name == "preflight_info":
        work = str(tmp_path / "work")
        return {
            "profile": "cpu",
            "gpu": run_module("gpu_info", {}, capsys)["gpu"],
            "model_path": str(model),
            "paths": {"weights": str(model), "completions": work, "features": work, "checkpoints": work},
        }
    if name == "gpu_requirements_info":
        return {"facts": run_module("gpu_info", {}, capsys)["gpu"], "profile": "cpu"}
    if name == "serving_launch_info":
        return {"model_path": str(model), "python": sys.executable, "facts": KIMI_FACTS, "gpu_count": 8}
    if name == "drafter_plan_info":
        architecture = run_module("model_config_info", {"path": kimi}, capsys)["architecture"]
        tokenizer = {"mask_token": {"id": 163838, "reason": "test", "needs_new_token": False}}
        gpu = KIMI_FACTS["environment"]["gpu"]
        plan = run_module(
            "model_plan_info", {"architecture": architecture, "tokenizer": tokenizer, "gpu": gpu}, capsys
        )
        facts = {"architecture": architecture, "tokenizer": tokenizer, "plan": plan["plan"]}
        return {
            "facts": facts,
            "model_path": str(model),
            "hidden_states_dir": str(tmp_path / "hidden"),
            "hosts": ["ct200"],
            "host": "ct200",
            "gpus_per_host": 8,
            "samples": 100,
            "tokens": 100000,
            "work_dir": str(tmp_path / "drafter"),
            "require_model": False,
        }
    if name == "python_venv":
        return {"name": "project", "path": sys.prefix, "manage": False, "verify_imports": ["json"]}
    if name == "wheelhouse":
        dest = tmp_path / "wheelhouse"
        dest.mkdir()
        (dest / "tqdm-4.70.1-py3-none-any.whl").write_bytes(b"")
        sha = "0" * 64  # the wheel below is empty: a hashed pin whose file is already there is not fetched
        lock = f"tqdm==4.70.1 \\\n    --hash=sha256:{sha}\n"
        return {"name": "t", "lock": lock, "dest": str(dest), "build": False}
    if name == "directory_archive":
        (tmp_path / "tree").mkdir()
        (tmp_path / "tree" / "a.txt").write_text("a\n")
        return {"src": str(tmp_path / "tree"), "dest": str(tmp_path / "tree.tar.gz")}
    if name == "project_wheel":
        project = _project_copy(tmp_path)
        return {"project": str(project), "dest": str(tmp_path / "wheels"), "python": sys.executable}
    if name == "model_facts_info":
        facts = tmp_path / "model_facts.json"
        facts.write_text(json.dumps({"plan": {"serving": {"tp_size": {"value": 1, "reason": "r"}}}}))
        return {"path": str(facts)}
    if name == "sglang_capture_patch":
        # A venv whose sglang is a one-file package, and a SpecForge-shaped tree with a patch for it.
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
        site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
        (site / "sglang").mkdir()
        (site / "sglang" / "__init__.py").write_text('__version__ = "0.5.23"\n')
        (site / "sglang" / "a.py").write_text("x = 1\n")
        patches = tmp_path / "specforge" / "patches" / "sglang" / "v0.5.23"
        patches.mkdir(parents=True)
        (patches / "spec-capture.patch").write_text(
            "--- a/python/sglang/a.py\n+++ b/python/sglang/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
        )
        python = tmp_path / "venv" / "bin" / "python"
        return {"python": str(python), "specforge_source": str(tmp_path / "specforge")}
    if name == "layout_simulation_info":
        architecture = run_module("model_config_info", {"path": kimi}, capsys)["architecture"]
        return {"architecture": architecture, "gpu": KIMI_FACTS["environment"]["gpu"]}
    if name == "evaluation_servers_info":
        serving = {"tp_size": 8, "ep_size": 8, "attn_dp_size": 8}
        return {"serving": serving, "checkpoint": "/d", "block_size": 16, "batch_concurrency": 16}
    if name == "bind_address_info":
        return {"address": "127.0.0.1", "service": "s", "variable": "v", "allow_variable": "a"}
    if name == "sweep_layouts_info":
        return {"facts": KIMI_FACTS, "layouts": [{"name": "tp4", "tp_size": 4}]}
    if name == "serving_endpoints_info":
        record = tmp_path / "serving" / "ct200-main"
        record.mkdir(parents=True)
        (record / "state.json").write_text(json.dumps({"state": "running", "endpoint": "http://127.0.0.1:30001"}))
        return {"path": str(tmp_path / "serving")}
    if name == "stage_settings_info":
        overrides = {"completions_max_tokens": None, "completions_concurrency": None,
                     "completions_chat_template_kwargs": None}
        return {"stage": "generate", "plan": KIMI_FACTS["plan"], "overrides": overrides}
    if name == "data_dirs_claim":
        inventory = str(ROOT / "inventory" / "local")
        return {"directories": [{"path": str(tmp_path / "a")}], "inventory": inventory}
    if name == "variable_names_check":
        return {"names": ["regen_profile", "ansible_host"], "roles_path": [str(ROOT / "roles")], "host": "h"}
    if name == "cluster_firewall_info":
        service = {"name": "capture server", "ports": [30200], "servers": ["a"], "clients": ["b"]}
        return {"services": [service], "groups": {"all": ["a", "b"]}, "host": "a", "table": "regen_cluster",
                "inventory_addresses": {"a": "192.0.2.1", "b": "192.0.2.2"}}
    raise AssertionError(f"no test inputs for library/{name}.py: add them here")


@pytest.mark.parametrize("name", MODULES)
def test_return_names_what_the_module_returns(
    name: str, docs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], request
) -> None:
    args = dict(_args(name, tmp_path, capsys, request), _ansible_check_mode=True)
    result = run_module(name, args, capsys)
    assert not result.get("failed"), result.get("msg")
    documented = docs[name].get("return") or {}
    returned = set(result) - ANSIBLE_KEYS
    if "dest" in result or "path" in result:
        returned -= FILE_ATTRIBUTES
    assert returned <= set(documented), f"{name} returns undocumented {sorted(returned - set(documented))}"
    always = {key for key, value in documented.items() if value.get("returned") == "always"}
    assert always <= returned, f"{name} documents as always but did not return {sorted(always - returned)}"
