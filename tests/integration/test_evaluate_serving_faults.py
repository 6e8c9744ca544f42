"""`python -m regen.jobs.evaluate_serving run` with a credentialed endpoint that does not answer (issue 25).

A URL with a password in it (`http://user:secret@host:port`) is what a user behind an authenticating proxy
passes; the job must keep that password out of what it writes and prints: the 0644 status.json, its error
line and the log. Real parts: the demo model's tokenizer renders the prompts, the port is a real closed
loopback port.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "src" / "regen" / "data" / "demo_prompts.jsonl"
SECRET = "s3cret-pa55"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_credentialed_endpoint_never_reaches_the_status_file_or_the_error(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    drafter = tmp_path / "export"
    drafter.mkdir()
    config = {"architectures": ["DFlashDraftModel"], "block_size": 8, "num_hidden_layers": 1}
    config["dflash_config"] = {"target_layer_ids": [2], "mask_token_id": 3845}
    (drafter / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    endpoint = f"http://evaluator:{SECRET}@127.0.0.1:{_closed_port()}"
    argv = [sys.executable, "-m", "regen.jobs.evaluate_serving", "run", "--target-model", str(demo_model_dir)]
    argv += ["--checkpoint", str(drafter), "--prompts", str(PROMPTS), "--output-dir", str(out)]
    argv += ["--max-prompts", "2", "--max-new-tokens", "4", "--prompt-max-tokens", "64", "--concurrency", "1"]
    argv += ["--server", "plain", "--endpoint", endpoint, "--no-tie-probe", "--no-progress", "--warmup", "1"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 3, run.stderr[-3000:]  # the endpoint did not answer
    assert "Traceback" not in run.stderr
    status = (out / "status.json").read_text()
    assert json.loads(status)["state"] == "failed"
    for text in (run.stdout, run.stderr, status, *(p.read_text() for p in out.glob("*.jsonl"))):
        assert SECRET not in text
    assert "evaluator:***@127.0.0.1" in status and "evaluator:***@127.0.0.1" in run.stderr
