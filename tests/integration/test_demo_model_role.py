"""The demo_model role through the real playbook and inventory: check mode, first run, second run.

The model path is redirected into a temporary directory with -e, so the checkout's .work stays untouched.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.ansible import run_playbook


def _play(model: Path, *extra: str) -> tuple[int, int, str]:
    run = run_playbook("playbooks/demo_model.yml", "-e", f"demo_model_path={model}", *extra)
    return run.returncode, run.counts("localhost")["changed"], run.output


def test_role_is_check_mode_safe_and_idempotent(tmp_path: Path) -> None:
    model = tmp_path / "models" / "regen-demo-kimi"

    rc, changed, output = _play(model, "--check")
    assert (rc, changed) == (0, 1), output[-4000:]
    assert not model.exists()

    rc, changed, output = _play(model)
    assert (rc, changed) == (0, 1), output[-4000:]
    assert (model / "config.json").is_file() and (model / "regen_demo_manifest.json").is_file()

    rc, changed, output = _play(model)
    assert (rc, changed) == (0, 0), output[-4000:]

    rc, changed, output = _play(model, "--check")
    assert (rc, changed) == (0, 0), output[-4000:]


def test_role_rejects_a_bad_seed_before_running_anything(tmp_path: Path) -> None:
    rc, _, output = _play(tmp_path / "m", "-e", "demo_model_seed=not-a-number")
    assert rc != 0
    assert "demo_model_seed" in output
    assert not (tmp_path / "m").exists()
