"""regen.training.rendezvous with a real torch.distributed (gloo) process group on this host.

The job below does what SpecForge's one-process trainer does (``init_process_group`` over ``env://``,
one collective) and reports the TCP sockets its process listens on, as the kernel lists them (psutil).
The control run starts it the way SpecForge 0.2.0 does on its own (MASTER_ADDR=127.0.0.1 and a port):
torch's store then listens on every interface, which is what the wrapper exists to prevent.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

JOB = """
import json, os, sys
from datetime import timedelta
import psutil, torch, torch.distributed as dist
if os.environ.get("JOB_FAIL_RANK") == os.environ["RANK"]:
    sys.exit(5)  # this rank fails before the rendezvous: the others would wait for it
dist.init_process_group("gloo", timeout=timedelta(minutes=1))
total = torch.ones(3)
dist.all_reduce(total)
listening = [[c.laddr.ip, c.laddr.port] for c in psutil.Process().net_connections("inet")
             if c.status == psutil.CONN_LISTEN]
names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")
report = json.dumps({"listening": listening, "argv": sys.argv[1:], "sum": total.tolist(),
                     "env": {k: os.environ.get(k) for k in names}})
# One write per line: the ranks share the pipe, and print() may write the text and its newline apart.
os.write(1, (report + "\\n").encode())
dist.destroy_process_group()
sys.exit(int(os.environ.get("JOB_EXIT", "0")))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def job_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "pg_job.py").write_text(JOB)
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT / "src")])
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)


def test_unwrapped_the_store_listens_on_every_interface(job_env: dict[str, str]) -> None:
    port = _free_port()
    env = {**job_env, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    done = _run(["-m", "pg_job"], {**env, "MASTER_PORT": str(port)})
    assert done.returncode == 0, done.stderr
    listening = {(ip, p) for ip, p in json.loads(done.stdout)["listening"]}
    # the control: what the wrapper must change (IPv6 or IPv4 wildcard, whichever torch could bind)
    assert {ip for ip, p in listening if p == port} & {"::", "0.0.0.0"}, listening


def test_every_listener_binds_the_given_address_and_port(job_env: dict[str, str]) -> None:
    port = _free_port()
    args = ["-m", "regen.training.rendezvous", "--host", "127.0.0.1", "--port", str(port), "--"]
    done = _run([*args, "pg_job", "train", "--config", "run.yaml"], {**job_env, "JOB_EXIT": "3"})
    assert done.returncode == 3, done.stderr  # the job's own exit code
    report = json.loads(done.stdout)
    assert report["argv"] == ["train", "--config", "run.yaml"] and report["sum"] == [1.0, 1.0, 1.0]
    listening = {(ip, p) for ip, p in report["listening"]}
    assert (("127.0.0.1", port)) in listening, listening
    assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening
    assert report["env"] == {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": job_env.get("OMP_NUM_THREADS"),
    }


def test_several_ranks_on_one_host_listen_on_loopback_only(job_env: dict[str, str]) -> None:
    port = _free_port()
    args = ["-m", "regen.training.rendezvous", "--port", str(port), "--nproc", "2", "--", "pg_job"]
    done = _run(args, {k: v for k, v in job_env.items() if k != "OMP_NUM_THREADS"})
    assert done.returncode == 0, done.stderr
    reports = sorted((json.loads(line) for line in done.stdout.splitlines()), key=lambda r: r["env"]["RANK"])
    assert [r["env"]["RANK"] for r in reports] == ["0", "1"]
    assert all(r["sum"] == [2.0, 2.0, 2.0] for r in reports)  # one all_reduce across both ranks
    assert all(r["env"]["WORLD_SIZE"] == "2" and r["env"]["OMP_NUM_THREADS"] == "1" for r in reports)
    listening = {(ip, p) for r in reports for ip, p in r["listening"]}
    assert listening and {ip for ip, _ in listening} == {"127.0.0.1"}, listening


def test_a_failed_rank_stops_the_others_and_gives_its_exit_code(job_env: dict[str, str]) -> None:
    args = ["-m", "regen.training.rendezvous", "--port", "0", "--nproc", "2", "--", "pg_job"]
    started = time.monotonic()
    done = _run(args, {**job_env, "JOB_FAIL_RANK": "1"})
    assert done.returncode == 5, done.stderr
    assert time.monotonic() - started < 30, "rank 0 was left waiting for the rank that failed"


def test_a_taken_port_is_refused_with_the_variable_to_change(job_env: dict[str, str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _run(["-m", "regen.training.rendezvous", "--port", str(port), "--", "pg_job"], job_env)
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use)" in done.stderr
    assert "drafter_training_master_port" in done.stderr
