"""Session fixtures shared by all test areas. Keep this file small: put helpers in tests/helpers/."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# pytest puts tests/ (not the repo root) on sys.path; the root makes `tests.helpers` importable everywhere.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import ansible.module_utils

# The repo's module_utils/ joins Ansible's own package search path, so tests import the shared logic exactly
# as modules do (`from ansible.module_utils.regen_config import ...`): one module object per file, no
# file-path loader, no hand-made sys.modules entry. library/ is on sys.path (pytest `pythonpath`), so a test
# imports a module by its name and calls its main().
_MODULE_UTILS = str(ROOT / "module_utils")
if _MODULE_UTILS not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(_MODULE_UTILS)

from tests.helpers.ansible import run_playbook
from tests.helpers.venvs import make_venv_without


def pytest_configure(config: pytest.Config) -> None:
    """Import torch's dynamo before any test imports Ansible's module code in this process.

    ansible-core 2.19 replaces `sys.intern` with a patch object (so str subclasses are accepted) when its
    module_utils load; torch._dynamo, imported later by transformers' generation code, registers a polyfill
    for `sys.intern` and refuses anything but the builtin function. On hosts the two never share a process
    (modules run in their own interpreter), but one pytest session runs both, and then the order of test
    files decides whether model loading fails. Importing dynamo first makes the order irrelevant.
    """
    with contextlib.suppress(ImportError):  # torch is optional for parts of the suite
        import torch._dynamo  # noqa: F401


@pytest.fixture(scope="session")
def python_without_tiktoken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Interpreter of a real venv that has the project's packages except tiktoken."""
    return make_venv_without(tmp_path_factory.mktemp("venv-no-tiktoken") / "venv", ["tiktoken"])


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The demo model, built once per builder input hash under .cache/ (read-only: copy it to modify it).

    It is the builder's own cache entry (.cache/demo-models/<hash>/regen-demo-kimi), the one the demo_model
    role copies from, so the pre-training runs once per input hash for the tests and the pipeline runs
    together; sessions testing different builder versions never replace each other's model, and the
    builder itself locks and skips the work when the directory is already up to date.
    """
    from regen.demo.build import build, cache_entry
    from regen.demo.spec import DemoSpec

    spec = DemoSpec()
    output = cache_entry(ROOT / ".cache" / "demo-models", spec)
    build(output, spec)
    return output


@pytest.fixture
def stop_local_server_afterwards():
    """Runs the teardown playbook on the embedded default after a test that ran the serve stage.

    The pipeline leaves the model server running on purpose (a second run finds it healthy); a test must
    not, or the next test that serves on the same port meets a stranger holding it.
    """
    yield
    run = run_playbook("playbooks/teardown.yml")
    assert run.returncode == 0, run.stdout[-3000:]
