"""playbooks/provision.yml for real on localhost: converge, idempotence, check mode, lock updates with an
atomic switch, every bad input of the issue (each leaving the working venv in place), and the production
example rendered in check mode without a GPU and without ever connecting to its address.

The demo venv is built in offline mode from a wheelhouse under .cache/wheelhouse (filled once per machine by
the role itself on first use), so the runs are quick and need no index after the first.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.ansible import ansible_env, run_playbook

ROOT = Path(__file__).resolve().parents[2]
PROD_ADDRESS = "10.1.2.200"


def _playbook(
    playbook: str, *args: str, inventory: str = "inventory/local", env: dict | None = None, check: bool = True
) -> tuple[str, dict]:
    run = run_playbook(
        playbook,
        *args,
        inventory=inventory,
        env=ansible_env(ANSIBLE_CALLBACK_RESULT_FORMAT="json", **(env or {})),
        timeout=900,
    )
    if check:
        assert run.returncode == 0, run.output[-5000:]
    return run.output, run.recap


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> dict:
    base = tmp_path_factory.mktemp("provision")
    locks = base / "envs"
    locks.mkdir()
    shutil.copy(ROOT / "envs" / "demo.lock", locks / "demo.lock")
    return {
        "base": base,
        "locks": locks,
        "work": base / "work",
        "artifacts": base / "artifacts",
        "model": demo_model_dir,
        "venv": base / "work" / "venvs" / "demo",
    }


def _local(site: dict, *extra: str, check: bool = True) -> tuple[str, dict]:
    return _playbook(
        "playbooks/provision.yml",
        "-e",
        f"regen_work_dir={site['work']}",
        "-e",
        f"regen_artifacts_dir={site['artifacts']}",
        "-e",
        f"regen_model_path={site['model']}",
        "-e",
        f"python_env_lock_dir={site['locks']}",
        "-e",
        "python_env_offline=true",
        *extra,
        check=check,
    )


def _lock_entry(name: str) -> re.Pattern[str]:
    """One pin of a hashed lock: its requirement line and the --hash continuation lines under it."""
    return re.compile(rf"(?m)^{re.escape(name)}==\S+(?: \\\n[ \t]+--hash=\S+)+\n")


def _lock_without(text: str, name: str) -> str:
    lock, removed = _lock_entry(name).subn("", text)
    assert removed == 1, name
    return lock


def _lock_repinned(text: str, name: str, version: str, uv: Path) -> str:
    """The lock with `name` moved to `version`, carrying that version's real hashes (uv resolves them from
    the index, as envs/resolve.sh does), so the hash-checked install accepts it."""
    entry = subprocess.run(
        [str(uv), "pip", "compile", "-", "--generate-hashes", "--no-deps", "--no-header", "--no-annotate"],
        input=f"{name}=={version}\n",
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert entry.startswith(f"{name}=={version} \\\n"), entry
    lock, replaced = _lock_entry(name).subn(lambda _: entry, text)
    assert replaced == 1, name
    return lock


def _lock_pins(text: str) -> dict[str, str]:
    return dict(re.findall(r"(?m)^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", text))


def _host_wheel(site: dict) -> Path:
    return site["work"] / "wheels" / "regen-0.1.0-py3-none-any.whl"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _regen_in(site: dict) -> str:
    """Where the venv's own interpreter imports regen from (the installed wheel, not the checkout)."""
    return subprocess.run(
        [str(site["venv"] / "bin" / "python"), "-c", "import regen; print(regen.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    ).stdout.strip()


def _failure_messages(output: str) -> list[str]:
    return [json.loads('"' + m + '"') for m in re.findall(r'"msg": "((?:[^"\\]|\\.)*)"', output)]


def _assert_venv_intact(site: dict, target: str) -> None:
    assert os.readlink(site["venv"]) == target
    python = site["venv"] / "bin" / "python"
    assert subprocess.run([str(python), "-c", "import tiktoken, transformers"], check=False).returncode == 0
    builds = sorted(p.name for p in site["venv"].parent.iterdir() if p.name.startswith("demo.regen-"))
    assert builds == [Path(target).name], builds


def test_local_converge_then_idempotent(site: dict) -> None:
    _, first = _local(site)
    assert first["localhost"]["failed"] == 0 and first["localhost"]["changed"] >= 1
    target = os.readlink(site["venv"])
    assert Path(target).name.startswith("demo.regen-")
    manifest = json.loads((site["artifacts"] / "provision" / "localhost" / "demo.json").read_text())
    assert manifest["packages"]["tiktoken"] == "0.14.0"
    assert (
        manifest["tokenizer"]["ok"] is True
        and manifest["tokenizer"]["tokenizer_class"] == "TikTokenTokenizer"
    )
    assert manifest["python"]["executable"].startswith(str(site["venv"]))
    _, second = _local(site)
    assert second["localhost"]["changed"] == 0, second
    _, checked = _local(site, "--check", "--diff")
    assert checked["localhost"]["changed"] == 0, checked
    site["target"] = target


def test_changed_lock_check_mode_reports_then_update_switches(
    site: dict, tmp_path: Path, uv_binary: Path
) -> None:
    lock = site["locks"] / "demo.lock"
    original = lock.read_text()
    lock.write_text(_lock_repinned(original, "tqdm", "4.67.1", uv_binary))
    # The update also installs the regen wheel into the venv (as the serving venv gets it), built from a
    # private copy of the project so that edits to the checkout during the test do not count as changes.
    project = tmp_path / "project"
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    envs = tmp_path / "envs.yml"
    envs.write_text(
        yaml.safe_dump(
            {
                "python_env_regen_project": str(project),
                "python_env_regen_wheel_cache": str(tmp_path / "wheel-cache"),
                "python_env_envs": [
                    {
                        "name": "demo",
                        "path": str(site["venv"]),
                        "lock": str(lock),
                        "with_regen": True,
                        "verify_imports": ["transformers", "tiktoken", "regen"],
                        "tokenizer_model_path": str(site["model"]),
                    }
                ],
            }
        )
    )
    try:
        output, checked = _local(site, "--check", "--diff", "-e", f"@{envs}")
        assert checked["localhost"]["changed"] >= 1
        assert "~ tqdm 4.70.1 -> 4.67.1" in output
        assert "-tqdm==4.70.1" in output and "+tqdm==4.67.1" in output  # the --diff of the pins
        _assert_venv_intact(site, site["target"])  # check mode touched nothing

        _, updated = _local(site, "-e", f"@{envs}")
        assert updated["localhost"]["failed"] == 0 and updated["localhost"]["changed"] >= 1
        new_target = os.readlink(site["venv"])
        assert new_target != site["target"] and not Path(site["target"]).exists()  # old build removed
        manifest = json.loads((site["artifacts"] / "provision" / "localhost" / "demo.json").read_text())
        assert manifest["packages"]["tqdm"] == "4.67.1"
        assert manifest["imports"]["regen"]["ok"] is True
        assert manifest["wheels"] == {"regen-0.1.0-py3-none-any.whl": _sha256(_host_wheel(site))}
        installed = Path(new_target) / "lib" / "python3.11" / "site-packages" / "regen" / "__init__.py"
        assert Path(_regen_in(site)).resolve() == installed.resolve()
        _, again = _local(site, "-e", f"@{envs}")
        assert again["localhost"]["changed"] == 0

        # A change to the regen sources: a new wheel, reinstalled into the same venv (no rebuild of the
        # pinned packages), then nothing to do again.
        (project / "src" / "regen" / "_provision_probe.py").write_text("MARK = 'rebuilt'\n")
        output, rebuilt = _local(site, "-e", f"@{envs}")
        assert rebuilt["localhost"]["changed"] >= 1 and "reinstall regen-0.1.0-py3-none-any.whl" in output
        assert os.readlink(site["venv"]) == new_target
        marker = subprocess.run(
            [str(site["venv"] / "bin" / "python"), "-c", "import regen._provision_probe as m; print(m.MARK)"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert marker.stdout.strip() == "rebuilt"
        assert len(list((tmp_path / "wheel-cache").iterdir())) == 1  # the older wheel was dropped
        _, settled = _local(site, "-e", f"@{envs}")
        assert settled["localhost"]["changed"] == 0
        # The updated venv is the working one the bad-input tests below must leave in place.
        site["target"] = new_target
        _assert_venv_intact(site, new_target)
    finally:
        lock.write_text(original)


def _broken_lock(site: dict, text: str) -> None:
    (site["locks"] / "demo.lock").write_text(text)


@pytest.fixture
def restore_lock(site: dict):
    original = (ROOT / "envs" / "demo.lock").read_text()
    yield
    (site["locks"] / "demo.lock").write_text(original)


def test_python_too_old(site: dict, restore_lock: None) -> None:
    lock = (
        (ROOT / "envs" / "demo.lock")
        .read_text()
        .replace("# requires-python: >=3.10", "# requires-python: >=3.99")
    )
    _broken_lock(site, lock)
    output, recap = _local(site, check=False)
    assert recap["localhost"]["failed"] == 1
    [msg] = [m for m in _failure_messages(output) if "needs Python" in m]
    assert re.search(r"python3 is Python 3\.\d+\.\d+, but environment 'demo' needs Python >=3\.99", msg), msg
    _assert_venv_intact(site, site["target"])


def test_lock_that_does_not_resolve(site: dict, restore_lock: None) -> None:
    # `regex` is what tiktoken and transformers need; a lock without it cannot be consistent. The pins are
    # all in the wheelhouse, so only the consistency check (pip check) can catch it.
    _broken_lock(site, _lock_without((ROOT / "envs" / "demo.lock").read_text(), "regex"))
    output, recap = _local(site, check=False)
    assert recap["localhost"]["failed"] == 1
    [msg] = [m for m in _failure_messages(output) if "does not resolve" in m]
    assert "the lock of environment 'demo' does not resolve" in msg and "regex" in msg, msg
    assert "previous venv left in place" in msg
    _assert_venv_intact(site, site["target"])


def test_a_file_the_lock_has_no_hash_for_is_refused(site: dict, restore_lock: None) -> None:
    # The wheelhouse holds tqdm 4.70.1 as published; a lock that lists other hashes for that pin must make
    # the hash-checked install refuse that file (and name it), and the working venv must stay.
    text = (ROOT / "envs" / "demo.lock").read_text()
    [tqdm] = _lock_entry("tqdm").findall(text)
    forged = re.sub(r"sha256:[0-9a-f]{64}", "sha256:" + "0" * 64, tqdm)
    _broken_lock(site, text.replace(tqdm, forged))
    output, recap = _local(site, check=False)
    assert recap["localhost"]["failed"] == 1
    [msg] = [m for m in _failure_messages(output) if "was resolved to" in m]
    assert re.search(
        r"the file for tqdm==4\.70\.1 from the wheelhouse \S+/demo .*is not one the lock of environment "
        r"'demo' was resolved to: its sha256 [0-9a-f]{64} is not among the lock's hashes",
        msg,
    ), msg
    assert "previous venv left in place" in msg
    _assert_venv_intact(site, site["target"])


def test_an_extra_package_that_is_not_pinned_names_its_variable(site: dict) -> None:
    output, recap = _local(site, "-e", '{"regen_demo_packages": ["sentencepiece"]}', check=False)
    assert recap["localhost"]["failed"] == 1
    [msg] = [m for m in _failure_messages(output) if "is not pinned" in m]
    assert "regen_demo_packages: 'sentencepiece' is not pinned" in msg, msg
    _assert_venv_intact(site, site["target"])


def test_wheelhouse_missing_a_wheel(site: dict, restore_lock: None, tmp_path: Path) -> None:
    lock = (ROOT / "envs" / "demo.lock").read_text().replace("tqdm==4.70.1", "tqdm==4.66.0")
    _broken_lock(site, lock)
    partial = tmp_path / "wheelhouse"
    shutil.copytree(ROOT / ".cache" / "wheelhouse" / "demo", partial / "demo")
    output, recap = _local(
        site,
        "-e",
        f"python_env_wheelhouse_dir={partial}",
        "-e",
        "python_env_wheelhouse_build=false",
        check=False,
    )
    assert recap["localhost"]["failed"] == 1
    [msg] = [m for m in _failure_messages(output) if "lacks" in m]
    assert (
        f"the wheelhouse {partial}/demo lacks 1 pinned package(s) of environment 'demo': tqdm==4.66.0" in msg
    )
    _assert_venv_intact(site, site["target"])


def test_too_little_disk(site: dict, restore_lock: None, tmp_path: Path) -> None:
    envs = {
        "python_env_envs": [
            {
                "name": "demo",
                "path": str(site["venv"]),
                "lock": str(site["locks"] / "demo.lock"),
                "verify_imports": ["tiktoken"],
                "min_free_mb": 1024 * 1024 * 1024,
            }
        ]
    }
    extra = tmp_path / "envs.yml"
    extra.write_text(yaml.safe_dump(envs))
    # The original lock differs from the working venv's (updated above), so a build is due.
    _broken_lock(site, (ROOT / "envs" / "demo.lock").read_text())
    output, recap = _local(site, "-e", f"@{extra}", check=False)
    assert recap["localhost"]["failed"] == 1
    [msg] = [m for m in _failure_messages(output) if "not enough disk" in m]
    assert re.search(
        r"not enough disk for environment 'demo' on \S+: \d+ MiB free, 1073741824 MiB needed", msg
    )
    _assert_venv_intact(site, site["target"])


def test_unreachable_index(site: dict, restore_lock: None) -> None:
    _broken_lock(site, (ROOT / "envs" / "demo.lock").read_text())
    # Only the index under test: no pip configuration file and no find-links of this machine.
    installer_env = json.dumps(
        {"python_env_installer_environment": {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": ""}}
    )
    output, recap = _local(
        site,
        "-e",
        "python_env_offline=false",
        "-e",
        "python_env_index_url=http://127.0.0.1:9/simple",
        "-e",
        installer_env,
        check=False,
    )
    assert recap["localhost"]["failed"] == 1
    [msg] = [m for m in _failure_messages(output) if "cannot be reached" in m]
    assert "the package index http://127.0.0.1:9/simple cannot be reached" in msg, msg
    _assert_venv_intact(site, site["target"])


def test_pinned_extra_packages_go_on_top_of_the_hashed_lock(site: dict, restore_lock: None) -> None:
    # iniconfig has no dependencies and is not in the demo lock: installed after the hash-checked lock,
    # without dependencies, from the wheelhouse the role fills with it. One that repins the lock is refused.
    _broken_lock(site, (ROOT / "envs" / "demo.lock").read_text())
    extras = '{"regen_demo_packages": ["iniconfig==2.3.1", "tiktoken==0.14.0"]}'
    _, built = _local(site, "-e", extras)
    assert built["localhost"]["failed"] == 0 and built["localhost"]["changed"] >= 1
    manifest = json.loads((site["artifacts"] / "provision" / "localhost" / "demo.json").read_text())
    assert manifest["packages"]["iniconfig"] == "2.3.1" and manifest["packages"]["tiktoken"] == "0.14.0"
    site["target"] = os.readlink(site["venv"])
    _, again = _local(site, "-e", extras)
    assert again["localhost"]["changed"] == 0

    output, recap = _local(site, "-e", '{"regen_demo_packages": ["tqdm==4.67.1"]}', check=False)
    assert recap["localhost"]["failed"] == 1
    [msg] = [m for m in _failure_messages(output) if "conflicts with the lock" in m]
    assert "regen_demo_packages: 'tqdm==4.67.1' conflicts with the lock, which pins tqdm==4.70.1" in msg
    _assert_venv_intact(site, site["target"])


# -- the production example --------------------------------------------------------------------------


def test_production_example_renders_serving_and_training_sets_in_check_mode(tmp_path: Path) -> None:
    # A test copy of the example inventory: same group_vars, but the host is reached with the local
    # connection on loopback. The copy must not even mention the example's address.
    inventory = tmp_path / "inventory" / "production.example"
    shutil.copytree(ROOT / "inventory" / "production.example", inventory)
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    ct200 = hosts["all"]["children"]["regen_serve"]["hosts"]["ct200"]
    assert ct200["ansible_host"] == PROD_ADDRESS
    ct200.update(
        ansible_host="127.0.0.1", ansible_connection="local", ansible_python_interpreter=sys.executable
    )
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts))
    assert PROD_ADDRESS not in (inventory / "hosts.yml").read_text()

    output, recap = _playbook(
        "playbooks/provision.yml",
        "--check",
        "--diff",
        "-e",
        f"regen_root={ROOT}",
        "-e",
        f"regen_artifacts_dir={tmp_path / 'artifacts'}",
        "-e",
        "ansible_connection=local",
        inventory=str(inventory),
    )
    assert PROD_ADDRESS not in output
    assert set(recap) == {"ct200"} and recap["ct200"]["failed"] == 0 and recap["ct200"]["unreachable"] == 0
    serving = sum(1 for line in (ROOT / "envs" / "serving.lock").read_text().splitlines() if "==" in line)
    training = sum(1 for line in (ROOT / "envs" / "training.lock").read_text().splitlines() if "==" in line)
    assert f"create /root/venv_sglang with {serving} packages" in output
    assert f"create /root/venv_specforge with {training} packages" in output
    # The capture venv of its own (online training's patched SGLang), from the training lock.
    assert f"create /root/venv_capture with {training} packages" in output
    for pin in (
        "+sglang==0.5.23",
        "+torch==2.14.1",
        "+tiktoken==0.14.0",
        "+specforge==0.2.0",
        "+torch==2.11.0",
    ):
        assert pin in output, pin
    # No GPU here: in check mode the GPU gate is reported, not enforced, so the package sets still render.
    assert "check mode: provisioning would stop here: no GPU is visible" in output
    assert not Path("/root/venv_sglang").exists() and not Path("/root/venv_specforge").exists()
    # Nothing but the controller's record of this run (the run history, marked check: true).
    written = [p for p in (tmp_path / "artifacts").rglob("*") if p.is_file()]
    assert [p.relative_to(tmp_path / "artifacts").parts[:2] for p in written] == [("runs", "history")]
    assert json.loads(written[0].read_text())["check"] is True


def test_production_example_without_check_mode_stops_at_the_gpu_gate(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory"
    inventory.mkdir()
    (inventory / "hosts.yml").write_text(
        yaml.safe_dump(
            {
                "all": {
                    "children": {
                        "regen_serve": {
                            "hosts": {
                                "ct200": {
                                    "ansible_host": "127.0.0.1",
                                    "ansible_connection": "local",
                                    "ansible_python_interpreter": sys.executable,
                                }
                            }
                        }
                    }
                }
            }
        )
    )
    shutil.copytree(ROOT / "inventory" / "production.example" / "group_vars", inventory / "group_vars")
    output, recap = _playbook(
        "playbooks/provision.yml",
        "-e",
        f"regen_root={ROOT}",
        "-e",
        f"regen_artifacts_dir={tmp_path / 'artifacts'}",
        inventory=str(inventory),
        check=False,
    )
    assert recap["ct200"]["failed"] == 1
    [msg] = [m for m in _failure_messages(output) if "no GPU is visible" in m]
    assert "regen_profile is 'gpu'" in msg
    assert "Build or verify environment" not in output  # nothing installed on a host that failed the gate


# -- uv ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uv_binary() -> Path:
    """uv 0.13.8 in .cache/tools (where envs/resolve.sh keeps it), installed from PyPI when absent."""
    tools = ROOT / ".cache" / "tools"
    uv = tools / "bin" / "uv"
    if not uv.exists():
        subprocess.run([sys.executable, "-m", "venv", str(tools)], check=True)
        subprocess.run(
            [str(tools / "bin" / "pip"), "install", "--quiet", "uv==0.13.8"], check=True, timeout=600
        )
    return uv


def test_uv_installer_builds_the_same_set(tmp_path: Path, demo_model_dir: Path, uv_binary: Path) -> None:
    site = {
        "work": tmp_path / "work",
        "artifacts": tmp_path / "artifacts",
        "model": demo_model_dir,
        "locks": ROOT / "envs",
    }
    extra = ("-e", "python_env_installer=uv", "-e", f"python_env_uv={uv_binary}")
    _, first = _local(site, *extra)
    assert first["localhost"]["failed"] == 0 and first["localhost"]["changed"] >= 1
    manifest = json.loads((site["artifacts"] / "provision" / "localhost" / "demo.json").read_text())
    assert manifest["installer"] == "uv"
    assert manifest["tokenizer"]["ok"] is True
    lock = _lock_pins((ROOT / "envs" / "demo.lock").read_text())
    assert {k: manifest["packages"][k] for k in lock} == lock  # exactly the pins, nothing else resolved
    _, second = _local(site, *extra)
    assert second["localhost"]["changed"] == 0
