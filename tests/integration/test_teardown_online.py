"""playbooks/teardown.yml (`make stop`) stops the online training stack (issue 25), the trainings the
launcher supervises and the capture servers on hosts of their own (`regen_capture`; issue 28, item 6) too.

Before, teardown stopped only the router and the model servers, and the capture server and the Mooncake
master (both without authentication) kept running. Real parts: ansible-playbook runs the teardown play on
localhost (no systemd here, so the roles' process supervisor); the running "capture server" and "Mooncake
master" are fault-injection stand-ins, named so: Python's http.server processes started through
regen.serving.supervisor under the names and state directories the capture_server and mooncake_master
roles use, so teardown finds them exactly as it finds the real ones. The "trainer" is another stand-in (a
sleeping Python process) started by the real launcher (regen.training.launcher start, process mode) with its
status where the train stage keeps a run's (drafter/runs/<run id>/status.json). A second inventory host,
`capture-host` (group `regen_capture`, its own work directory; local connection, as another machine's would
be SSH), runs a capture server stand-in where role capture_server keeps it there.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from regen import procs
from regen.serving import supervisor
from tests.helpers.ansible import ansible_env, localhost_inventory, run_playbook

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stand_in(state_dir: Path, name: str) -> int:
    port = _free_port()
    spec = {
        "name": name,
        "argv": [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        "state_dir": str(state_dir),
        "host": "127.0.0.1",
        "port": port,
        "stop_timeout": 10,
    }
    return supervisor.start(spec)["pid"]


def _trainer_stand_in(run_dir: Path) -> int:
    run_dir.mkdir(parents=True)
    status = run_dir / "status.json"
    subprocess.run(
        [sys.executable, "-m", "regen.training.launcher", "start", "--name", "regen-train-stand-in",
         "--mode", "process", "--status", str(status), "--log", str(run_dir / "train.log"),
         "--", sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return int(json.loads(status.read_text())["pid"])


def test_teardown_stops_the_trainings_the_capture_server_and_the_mooncake_master(tmp_path: Path) -> None:
    work = tmp_path / "work"
    variables = {
        "regen_root": str(ROOT),
        "regen_work_dir": str(work),
        "regen_artifacts_dir": str(tmp_path / "artifacts"),
        "regen_profile": "cpu",
        "regen_model_path": str(tmp_path / "models" / "none"),
        "regen_job_python": sys.executable,
    }
    inventory = localhost_inventory(tmp_path / "inventory.yml", groups=("regen_train",), variables=variables)
    document = yaml.safe_load(inventory.read_text())
    capture_work = tmp_path / "work-capture"
    document["all"]["hosts"]["capture-host"] = {
        **document["all"]["hosts"]["localhost"], "regen_work_dir": str(capture_work)}
    document["all"]["children"]["regen_capture"] = {"hosts": {"capture-host": None}}
    inventory.write_text(yaml.safe_dump(document))
    running = {
        "capture on capture-host": _stand_in(capture_work / "capture", "capture"),
        "capture": _stand_in(work / "drafter" / "capture", "capture"),
        "mooncake-master": _stand_in(work / "mooncake", "mooncake-master"),
        "mooncake-metadata": _stand_in(work / "mooncake", "mooncake-metadata"),
        "trainer": _trainer_stand_in(work / "drafter" / "runs" / "regen-train-0123456789ab"),
    }
    try:
        env = ansible_env(ANSIBLE_CACHE_PLUGIN_CONNECTION=str(tmp_path / "facts"))
        run = run_playbook("playbooks/teardown.yml", inventory=inventory, env=env, timeout=600)
        counts = run.counts("localhost")
        assert counts["failed"] == 0, run.output[-4000:]
        # The trainer, the capture server and the two Mooncake services (one task each; the first teardown
        # on this fresh host also ships the regen wheel the launcher runs from, which a trained host has).
        assert "changed: [localhost] => (item=regen-train-0123456789ab)" in run.output, run.output[-4000:]
        assert "TASK [capture_server : Stop the supervised process]" in run.output
        assert counts["changed"] >= 3, run.output[-4000:]
        assert run.counts("capture-host")["changed"] == 1 and run.counts("capture-host")["failed"] == 0
        assert not [name for name, pid in running.items() if procs.alive(pid)], run.output[-4000:]
        trainer = work / "drafter" / "runs" / "regen-train-0123456789ab" / "status.json"
        assert json.loads(trainer.read_text())["state"] == "stopped"
        again = run_playbook("playbooks/teardown.yml", inventory=inventory, env=env, timeout=600)
        assert again.counts("localhost")["changed"] == 0, again.output[-4000:]
        assert again.counts("capture-host")["changed"] == 0, again.output[-4000:]
    finally:
        for pid in running.values():
            if procs.alive(pid):
                procs.stop_group(pid, 5)
