"""The introspection modules through real `ansible` runs on localhost, against the demo model.

Run once with the project venv (the tokenizer library loads) and once with a real venv that lacks tiktoken
(as a serving venv without it would): the second shows the raw-files fallback facts and the remedy.
A temporary inventory names only localhost (connection local), so nothing here reaches another host.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.ansible import ansible_env

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MODULES = ("model_config_info", "tokenizer_info", "gpu_info", "python_env_info")


def _inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inventory.yml"
    path.write_text("all:\n  hosts:\n    localhost:\n      ansible_connection: local\n")
    return path


def _adhoc(inventory: Path, python: Path, module: str, args: dict) -> dict:
    env = ansible_env(ANSIBLE_CALLBACK_RESULT_FORMAT="json")
    result = subprocess.run(
        [
            str(BIN / "ansible"),
            "localhost",
            "-i",
            str(inventory),
            "-m",
            module,
            "-a",
            json.dumps(args),
            "-e",
            f"ansible_python_interpreter={python}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    # The default callback prints "localhost | SUCCESS => {json}" (or "FAILED! =>") for ad-hoc runs.
    match = re.search(r"^localhost \| ([A-Z!]+) => ", result.stdout, flags=re.M)
    assert match, result.stdout[-3000:] + result.stderr[-3000:]
    outcome = json.loads(result.stdout[match.end() :])
    outcome["failed"] = match.group(1) == "FAILED!"
    return outcome


@pytest.fixture(scope="module")
def project_python() -> Path:
    return (
        ROOT / ".venv" / "bin" / "python"
        if (ROOT / ".venv" / "bin" / "python").exists()
        else Path(sys.executable)
    )


def test_ansible_doc_renders_every_module() -> None:
    for module in MODULES:
        result = subprocess.run(
            [str(BIN / "ansible-doc"), "-M", "library", module],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
            env=ansible_env(),
        )
        assert result.returncode == 0, result.stderr
        assert f"MODULE {module}" in result.stdout or module in result.stdout.splitlines()[0]
        for section in ("OPTIONS", "EXAMPLES", "RETURN VALUES"):
            assert section in result.stdout, (module, section)


@pytest.fixture(scope="module")
def library_result(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path, project_python: Path
) -> dict:
    inventory = _inventory(tmp_path_factory.mktemp("inventory"))
    return _adhoc(inventory, project_python, "tokenizer_info", {"path": str(demo_model_dir)})


def test_library_path_in_the_project_venv(
    tmp_path: Path, demo_model_dir: Path, project_python: Path, library_result: dict
) -> None:
    inventory = _inventory(tmp_path)
    tok = library_result
    assert tok.get("failed") is not True, tok
    facts = tok["tokenizer"]
    assert tok["changed"] is False
    assert facts["loaded_with"] == "library" and facts["agreement"] == []
    assert facts["chat_template"]["thinking_switch"] == "thinking"
    assert facts["rendered_sample"]["template_kwargs"] == {"thinking": True}
    arch = _adhoc(inventory, project_python, "model_config_info", {"path": str(demo_model_dir)})[
        "architecture"
    ]
    config = json.loads((demo_model_dir / "config.json").read_text())
    assert arch["text_model_type"] == config["text_config"]["model_type"]
    assert (
        arch["attention"]["kind"] == "mla"
        and arch["moe"]["routed_experts"] == config["text_config"]["n_routed_experts"]
    )
    assert arch["weight_bytes_source"] in ("safetensors_index", "safetensors_headers")


def test_fallback_without_tiktoken(
    tmp_path: Path, demo_model_dir: Path, python_without_tiktoken: Path, library_result: dict
) -> None:
    inventory = _inventory(tmp_path)
    with_lib = library_result["tokenizer"]
    result = _adhoc(inventory, python_without_tiktoken, "tokenizer_info", {"path": str(demo_model_dir)})
    assert result.get("failed") is not True, result
    facts = result["tokenizer"]
    venv = str(python_without_tiktoken.parent.parent)
    assert facts["loaded_with"] == "raw_files"
    assert facts["load"]["missing_modules"] == ["tiktoken"]
    assert facts["load"]["remedy"] == f"tiktoken is not installed in {venv}; add it to regen_serving_packages"
    assert facts["load"]["python"] == str(python_without_tiktoken)
    assert any("facts read from the raw files" in w for w in facts["warnings"])
    for key in ("named", "tokens", "end_of_turn", "think_tokens", "mask_token", "chat_template", "reserved"):
        assert facts[key] == with_lib[key], key
    assert facts["vocab"]["total"] == with_lib["vocab"]["total"]
    env = _adhoc(inventory, python_without_tiktoken, "python_env_info", {"modules": ["tiktoken", "jinja2"]})[
        "python_env"
    ]
    assert env["missing"] == ["tiktoken"] and "jinja2" in env["imported"]
    assert env["python"]["prefix"] == venv


def test_library_mode_fails_with_the_remedy(
    tmp_path: Path, demo_model_dir: Path, python_without_tiktoken: Path
) -> None:
    result = _adhoc(
        _inventory(tmp_path),
        python_without_tiktoken,
        "tokenizer_info",
        {"path": str(demo_model_dir), "mode": "library", "remedy_variable": "my_packages"},
    )
    assert result["failed"] is True
    assert "tiktoken is not installed in" in result["msg"] and "add it to my_packages" in result["msg"]
    assert "Traceback" not in result["msg"]


def test_gpu_info_without_gpu_is_count_zero(tmp_path: Path, project_python: Path) -> None:
    result = _adhoc(
        _inventory(tmp_path), project_python, "gpu_info", {"nvidia_smi": "regen-no-such-nvidia-smi"}
    )
    assert result.get("failed") is not True and result["gpu"]["count"] == 0
    assert "not found" in result["gpu"]["reason"]


def test_model_config_info_bad_directory(tmp_path: Path, project_python: Path) -> None:
    result = _adhoc(
        _inventory(tmp_path), project_python, "model_config_info", {"path": str(tmp_path / "none")}
    )
    assert result["failed"] is True and "does not exist" in result["msg"]
