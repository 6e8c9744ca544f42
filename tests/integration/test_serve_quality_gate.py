"""The serving role's output-quality gate on the real demo server (`transformers serve`, the demo model).

The demo model (tiny, pre-trained on a 12 KB corpus) cannot answer the probes, which makes it a real
wrong-answer server: with the gate
enforced (sglang_server_quality_not_applicable_reason: '') the serve stage must fail naming the failed
probes, the suggestion and the log tail; with the local inventory's reason for the demo model the probes
are marked not applicable (they still run), and a second run stays changed=0.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.test_serve_role import _free_port, _inventory, _play, teardown_after  # noqa: F401


def test_gate_fails_on_the_demo_model_when_enforced_and_not_applicable_as_the_local_inventory_says(
    tmp_path: Path, demo_model_dir: Path, teardown_after  # noqa: F811
) -> None:
    port = _free_port()
    enforced = _inventory(
        tmp_path, demo_model_dir, port,
        sglang_server_quality_not_applicable_reason="", sglang_server_quality_max_tokens=16,
    )
    output, (_, _, _, failed) = _play(enforced, "serve.yml")
    assert failed == 1, output[-5000:]
    assert "its output failed the quality gate (fail, exit 1)" in output, output[-5000:]
    assert "capital-france: expected 'Paris' in the answer" in output
    assert "--- last log lines ---" in output

    # Same server (it stays up), the local inventory's settings: the demo model's probes are not applicable.
    default = _inventory(tmp_path, demo_model_dir, port)
    output, (_, _, _, failed) = _play(default, "serve.yml")
    assert failed == 0, output[-5000:]
    assert "quality gate: not_applicable" in output
    assert "the demo model is a tiny model pre-trained on a 12 KB corpus" in " ".join(output.split())
    output, (_, changed, _, failed) = _play(default, "serve.yml")
    assert (changed, failed) == (0, 0), output[-5000:]
    records = tmp_path / "artifacts" / "serving" / "localhost-main"
    models = json.loads((records / "v1_models.json").read_text())
    assert models["data"][0]["id"] == str(demo_model_dir)
