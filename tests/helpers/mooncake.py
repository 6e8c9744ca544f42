"""The real Mooncake master for tests: its venv (built once by the mooncake_master role), a master + HTTP
metadata server on free loopback ports, and a directory that puts only its `mooncake` client package on
another interpreter's import path.

``mooncake_venv()`` returns ``.cache/test-mooncake/venvs/mooncake`` (the venv tests/integration/
test_mooncake_master.py builds through the role; built here the same way, through ``playbooks/mooncake.yml``,
when it is missing). ``MooncakeMaster(state_dir)`` runs ``mooncake_master`` and
``python -m mooncake.http_metadata_server`` from that venv as child processes of the test and stops them
(by pid) when the ``with`` block ends.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.helpers.ansible import ansible_env, localhost_inventory, run_playbook

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".cache" / "test-mooncake" / "venvs" / "mooncake"


def free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def mooncake_venv(tmp: Path) -> Path:
    """The Mooncake venv, built (once) by the mooncake_master role from envs/mooncake.lock."""
    if (VENV / "bin" / "mooncake_master").exists():
        return VENV
    rpc, http, metrics = free_ports(3)
    variables = {
        "regen_root": str(ROOT),
        "regen_work_dir": str(tmp / "work"),
        "regen_artifacts_dir": str(tmp / "artifacts"),
        "regen_profile": "cpu",
        "regen_model_path": str(tmp / "models" / "none"),
        "regen_job_python": sys.executable,
        "mooncake_master_venv": str(VENV),
        "mooncake_master_rpc_port": rpc,
        "mooncake_master_http_metadata_port": http,
        "mooncake_master_metrics_port": metrics,
    }
    inventory = localhost_inventory(
        tmp / "mooncake-inventory.yml", groups=("regen_train",), variables=variables
    )
    env = ansible_env(ANSIBLE_CACHE_PLUGIN_CONNECTION=str(tmp / "facts"))
    for state in ("started", "stopped"):
        run = run_playbook(
            "playbooks/mooncake.yml",
            "-e",
            f"mooncake_master_state={state}",
            inventory=inventory,
            env=env,
            timeout=900,
        )
        assert run.returncode == 0, run.output[-4000:]
    return VENV


def client_dir(venv: Path, dest: Path) -> Path:
    """A directory holding only a link to the venv's `mooncake` package (what the train stage does)."""
    found = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import os, mooncake; print(os.path.dirname(mooncake.__file__))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dest.mkdir(parents=True, exist_ok=True)
    link = dest / "mooncake"
    if not link.exists():
        link.symlink_to(found)
    return dest


class MooncakeMaster:
    """`mooncake_master` + Mooncake's HTTP metadata server on free loopback ports, for one test."""

    def __init__(self, venv: Path, state_dir: Path) -> None:
        self.venv, self.state_dir = venv, state_dir
        self.rpc, self.http, self.metrics = free_ports(3)
        self.master_addr = f"127.0.0.1:{self.rpc}"
        self.metadata_url = f"http://127.0.0.1:{self.http}/metadata"
        self.procs: list[subprocess.Popen] = []

    def env(self) -> dict[str, str]:
        return {
            "MOONCAKE_MASTER_SERVER_ADDR": self.master_addr,
            "MOONCAKE_METADATA_SERVER": self.metadata_url,
            "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
            "MOONCAKE_PROTOCOL": "tcp",
        }

    def __enter__(self) -> MooncakeMaster:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        python = str(self.venv / "bin" / "python")
        commands = {
            "metadata": [
                python,
                "-m",
                "mooncake.http_metadata_server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.http),
            ],
            "master": [
                str(self.venv / "bin" / "mooncake_master"),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics}",
                "--logtostderr=true",
            ],
        }
        for name, argv in commands.items():
            with open(self.state_dir / f"{name}.log", "w") as log:
                self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._ready():
                return self
            assert all(p.poll() is None for p in self.procs), self.logs()
            time.sleep(0.2)
        raise AssertionError(f"the Mooncake master did not start:\n{self.logs()}")

    def _ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.rpc), timeout=1):
                pass
            urllib.request.urlopen(self.metadata_url + "?key=probe", timeout=1)
        except urllib.error.HTTPError as exc:
            return exc.code == 404
        except OSError:
            return False
        return True

    def logs(self) -> str:
        return "\n".join(p.read_text()[-2000:] for p in sorted(self.state_dir.glob("*.log")))

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
