"""SpecForge's spec-capture patch applied to a venv's sglang through the real role, from a git checkout.

The tests cannot reach SpecForge's repository, so they build the pieces the mechanism works on: a venv
whose site-packages holds a small `sglang` package (a version string and one source file), and a git
repository laid out as SpecForge's (patches/sglang/<target>/spec-capture.patch, paths a/python/sglang/...)
with a patch the test writes itself. The role clones it at a pinned commit, verifies the commit, and the
module applies the patch with `patch -p2`; the refusals run for real.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.ansible import localhost_inventory, run_playbook

ORIGINAL = "def capture():\n    return None\n"
PATCHED = "def capture():\n    return 'hidden states'\n"
PATCH = textwrap.dedent(
    """\
    diff --git a/python/sglang/srt/capture.py b/python/sglang/srt/capture.py
    --- a/python/sglang/srt/capture.py
    +++ b/python/sglang/srt/capture.py
    @@ -1,2 +1,2 @@
     def capture():
    -    return None
    +    return 'hidden states'
    """
)


def _venv(tmp_path: Path, version: str) -> Path:
    venv = tmp_path / "capture-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    package = site / "sglang"
    (package / "srt").mkdir(parents=True)
    (package / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (package / "srt" / "capture.py").write_text(ORIGINAL)
    return venv / "bin" / "python"


def _specforge_repo(tmp_path: Path, patches: dict[str, str]) -> tuple[Path, str]:
    repo = tmp_path / "SpecForge"
    for target, text in patches.items():
        (repo / "patches" / "sglang" / target).mkdir(parents=True)
        (repo / "patches" / "sglang" / target / "spec-capture.patch").write_text(text)
    (repo / "README.md").write_text("a SpecForge-shaped repository for the test\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "patches"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True)
    return repo, commit.stdout.strip()


def _play(tmp_path: Path, **variables) -> object:
    playbook = tmp_path / "capture.yml"
    playbook.write_text(
        "- hosts: localhost\n  gather_facts: false\n  roles:\n    - role: capture_patch\n"
    )
    inventory = localhost_inventory(tmp_path / "hosts.yml", variables={"regen_work_dir": str(tmp_path / "w")})
    return run_playbook(str(playbook), inventory=inventory, extra_vars=variables, timeout=300)


def test_the_pinned_checkout_is_cloned_and_the_patch_applied_exactly_once(tmp_path: Path) -> None:
    python = _venv(tmp_path, "0.5.23")
    repo, commit = _specforge_repo(tmp_path, {"v0.5.23": PATCH, "v0.5.14": PATCH})
    settings = {
        "capture_patch_python": str(python),
        "capture_patch_specforge_repo": f"file://{repo}",
        "capture_patch_specforge_commit": commit,
    }
    first = _play(tmp_path, **settings)
    assert first.returncode == 0, first.output[-4000:]
    target = next(python.parent.parent.glob("lib/python3*/site-packages/sglang/srt/capture.py"))
    assert target.read_text() == PATCHED
    assert "v0.5.23 patch" in first.output and "applies cleanly" in first.output
    again = _play(tmp_path, **settings)
    assert again.returncode == 0 and again.counts()["changed"] == 0, again.output[-4000:]
    assert target.read_text() == PATCHED and "its record matches" in again.output


def test_no_patch_for_the_installed_sglang_is_refused_with_the_targets(tmp_path: Path) -> None:
    python = _venv(tmp_path, "0.5.23")
    repo, commit = _specforge_repo(tmp_path, {"v0.5.14": PATCH})
    run = _play(
        tmp_path,
        capture_patch_python=str(python),
        capture_patch_specforge_source=str(repo),
        capture_patch_specforge_commit=commit,
    )
    assert run.returncode != 0
    assert "no spec-capture patch for sglang 0.5.23" in run.output and "v0.5.14" in run.output
    assert "sglang==0.5.14" in run.output


@pytest.mark.parametrize("problem", ["unreachable", "not-specforge", "other-release"])
def test_sources_that_cannot_work_are_refused_naming_the_fix(tmp_path: Path, problem: str) -> None:
    python = _venv(tmp_path, "0.5.23")
    repo, commit = _specforge_repo(tmp_path, {"v0.5.23": PATCH.replace("return None", "return 0")})
    settings = {"capture_patch_python": str(python), "capture_patch_specforge_commit": commit}
    if problem == "unreachable":
        settings["capture_patch_specforge_repo"] = f"file://{tmp_path}/no-such-repo"
        expected = "copy a checkout of that commit to the host and set capture_patch_specforge_source"
    elif problem == "not-specforge":
        settings["capture_patch_specforge_source"] = str(tmp_path)
        expected = "has no patches/sglang/"
    else:
        # The patch was written for other file contents: neither applies nor is applied.
        settings["capture_patch_specforge_source"] = str(repo)
        expected = "reinstall that sglang release in the capture venv"
    run = _play(tmp_path, **settings)
    assert run.returncode != 0 and expected in run.output, run.output[-4000:]
    target = next(python.parent.parent.glob("lib/python3*/site-packages/sglang/srt/capture.py"))
    assert target.read_text() == ORIGINAL, "a refused run changes nothing"
