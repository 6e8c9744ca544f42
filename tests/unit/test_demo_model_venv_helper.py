"""tests/helpers/venvs.py: which site-packages entries belong to a distribution, and the venv it makes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers.venvs import distribution_entries, project_site_packages


def test_entries_of_a_distribution_include_its_packages_and_metadata() -> None:
    entries = distribution_entries(["tiktoken"], project_site_packages())
    assert "tiktoken" in entries and "tiktoken_ext" in entries
    assert any(entry.endswith(".dist-info") for entry in entries)
    assert "transformers" not in entries


def test_an_unknown_distribution_is_an_error_not_a_silent_no_op() -> None:
    with pytest.raises(LookupError, match="no-such-dist"):
        distribution_entries(["no-such-dist"], project_site_packages())


def test_the_venv_lacks_only_the_excluded_distribution(python_without_tiktoken: Path) -> None:
    probe = (
        "import importlib.util as u; print(u.find_spec('tiktoken') is None, u.find_spec('regen') is not None)"
    )
    result = subprocess.run(
        [str(python_without_tiktoken), "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["True", "True"]
