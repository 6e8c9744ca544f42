"""Run a custom module's main() in this process, the way community.general's unit tests do.

library/ is on sys.path (pytest `pythonpath`) and the repo's module_utils/ on `ansible.module_utils.__path__`
(tests/conftest.py), so a module is imported by its name and imports its logic as it does on a host.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
from ansible.module_utils.testing import patch_module_args


def run_module(name: str, args: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> dict:
    """The JSON result of module `name` called with `args` (exit_json and fail_json alike)."""
    module = importlib.import_module(name)
    capsys.readouterr()  # drop what earlier code printed: the result must be the only output
    with patch_module_args(args), pytest.raises(SystemExit):
        module.main()
    return json.loads(capsys.readouterr().out)
