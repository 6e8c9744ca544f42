"""module_utils/ is one set of files loaded two ways (module_utils/__init__.py, docs/module-utils-sharing.md):
by Ansible as `ansible.module_utils.<name>` and by the regen package as `regen.module_utils.<name>`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tests.helpers.modules import run_module

ROOT = Path(__file__).resolve().parents[2]
NAMES = sorted(p.stem for p in (ROOT / "module_utils").glob("regen_*.py"))


def test_the_package_imports_every_module_utils_file_without_ansible():
    # Hosts that run jobs have no ansible-core: with `ansible` made unimportable, every file still loads
    # through the package (its imports of other module_utils files are relative).
    code = "import importlib, sys\nsys.modules['ansible'] = None\n" + "".join(
        f"importlib.import_module('regen.module_utils.{name}')\n" for name in NAMES
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert len(NAMES) > 10


def test_both_names_load_the_same_file():
    import importlib

    for name in ("regen_files", "regen_plan"):
        via_ansible = importlib.import_module(f"ansible.module_utils.{name}")
        via_package = importlib.import_module(f"regen.module_utils.{name}")
        assert Path(via_ansible.__file__).resolve() == Path(via_package.__file__).resolve()


def test_the_wheel_holds_module_utils_as_real_files(tmp_path, capsys):
    # project_wheel (the wheel every host installs) builds from src/, where module_utils is a link.
    result = run_module(
        "project_wheel", {"project": str(ROOT), "dest": str(tmp_path), "python": sys.executable}, capsys
    )
    assert not result.get("failed"), result.get("msg")
    with zipfile.ZipFile(result["wheel"]) as wheel:
        for name in ("__init__", "regen_files", "regen_plan"):
            packaged = wheel.read(f"regen/module_utils/{name}.py")
            assert packaged == (ROOT / "module_utils" / f"{name}.py").read_bytes()
