"""Session fixtures shared by all test areas. Keep this file small: put helpers in tests/helpers/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# pytest puts tests/ (not the repo root) on sys.path; the root makes `tests.helpers` importable everywhere.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers.venvs import make_venv_without


@pytest.fixture(scope="session")
def python_without_tiktoken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Interpreter of a real venv that has the project's packages except tiktoken."""
    return make_venv_without(tmp_path_factory.mktemp("venv-no-tiktoken") / "venv", ["tiktoken"])


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The demo model, built once per builder input hash under .cache/ (read-only: copy it to modify it).

    Keyed by the hash, so sessions testing different builder versions never replace each other's model;
    the builder itself locks and skips the work when the directory is already up to date.
    """
    from regen.demo.build import build, inputs_digest
    from regen.demo.spec import DemoSpec

    spec = DemoSpec()
    output = ROOT / ".cache" / "demo-models" / inputs_digest(spec)[:16] / "regen-demo-kimi"
    build(output, spec)
    return output


@pytest.fixture
def stop_local_server_afterwards():
    """Runs the teardown playbook on the embedded default after a test that ran the serve stage.

    The pipeline leaves the model server running on purpose (a second run finds it healthy); a test must
    not, or the next test that serves on the same port meets a stranger holding it.
    """
    yield
    bin_dir = Path(sys.executable).parent
    result = subprocess.run(
        [str(bin_dir / "ansible-playbook"), "-i", "inventory/local", "playbooks/teardown.yml"],
        cwd=ROOT,
        env={
            **os.environ,
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
        },
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:]
