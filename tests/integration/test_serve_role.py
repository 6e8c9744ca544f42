"""playbooks/serve.yml and playbooks/teardown.yml on localhost: the sglang_server role serves the demo model.

Real parts end to end: ansible-playbook runs the role against a temporary inventory (localhost, connection
local, CPU profile), the role starts `transformers serve` on the demo model on a free loopback port (this
machine has no systemd, so under the process supervisor), waits on /v1/models, records the server's
answers, and the test asks the server for a chat completion. A second run must report changed=0 and
keep the same process; check mode changes nothing; teardown frees the port. The failure tests inject one
fault each (a flag the server rejects, a port another process holds). The full lifecycle (seven playbook
runs, about 1.5 min on two busy cores) is marked e2e. sglang-router in front of servers runs in the
molecule scenario `serve` (two servers on containers of their own, one stopped mid-run).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.ansible import (
    DEMO_MODEL_SERVING_VARS,
    ansible_env,
    local_inventory_vars,
    localhost_inventory,
    run_playbook,
)

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _inventory(tmp_path: Path, model: Path, port: int, **extra: object) -> Path:
    variables = {
        "regen_root": str(ROOT),
        "regen_work_dir": str(tmp_path / "work"),
        "regen_artifacts_dir": str(tmp_path / "artifacts"),
        "regen_profile": "cpu",
        "regen_model_path": str(model),
        "regen_serving_python": sys.executable,
        "regen_job_python": sys.executable,
        "sglang_server_port": port,
        # the demo model is served as the local inventory serves it
        **local_inventory_vars(*DEMO_MODEL_SERVING_VARS),
        **extra,
    }
    return localhost_inventory(tmp_path / "inventory.yml", groups=("regen_serve",), variables=variables)


def _play(inventory: Path, playbook: str, *args: str) -> tuple[str, tuple[int, int, int, int]]:
    # Each test its own fact cache: the service-manager fact must come from this run.
    env = ansible_env(ANSIBLE_CACHE_PLUGIN_CONNECTION=str(inventory.parent / "facts"))
    run = run_playbook(f"playbooks/{playbook}", *args, inventory=inventory, env=env, timeout=600)
    counts = run.counts("localhost")
    return run.output, (counts["ok"], counts["changed"], counts["unreachable"], counts["failed"])


def _pid(state: Path) -> int:
    return int((state / "main.pid").read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[-1].split()[0] != "Z"


def _nobody_listens(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def teardown_after(tmp_path: Path):
    """Whatever a test leaves running under tmp_path/work is stopped afterwards."""
    yield
    state = tmp_path / "work" / "serving"
    for pid_file in state.glob("*.pid") if state.exists() else []:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "regen.serving.supervisor",
                "stop",
                "--state-dir",
                str(state),
                "--name",
                pid_file.stem,
                "--timeout",
                "10",
            ],
            check=False,
            capture_output=True,
        )


@pytest.mark.e2e
def test_serve_answers_then_idempotent_then_teardown(
    tmp_path: Path, demo_model_dir: Path, teardown_after
) -> None:
    port = _free_port()
    inventory = _inventory(tmp_path, demo_model_dir, port)
    state = tmp_path / "work" / "serving"

    output, (_, changed, _, failed) = _play(inventory, "serve.yml")
    assert failed == 0, output[-5000:]
    assert changed >= 1
    assert "background process supervised by regen.serving.supervisor" in output  # the mode is said
    assert re.search(r"main: ready after \d+s \(HTTP 200\)", output), output[-3000:]
    pid = _pid(state)
    assert _alive(pid)

    records = tmp_path / "artifacts" / "serving" / "localhost-main"
    launch = json.loads((records / "launch.json").read_text())
    assert launch["mode"] == "process" and launch["backend"] == "transformers"
    assert launch["argv"][-6:] == ["--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    models = json.loads((records / "v1_models.json").read_text())
    model_id = models["data"][0]["id"]
    assert model_id == str(demo_model_dir)

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(
            {"model": model_id, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] >= 1

    output, (_, changed, _, failed) = _play(inventory, "serve.yml")
    assert (changed, failed) == (0, 0), output[-5000:]
    assert "regen-serve-main: unchanged" in output
    assert _pid(state) == pid and _alive(pid)  # the healthy server was not restarted

    # A change that cannot be applied (a port a stranger holds) fails before the working server stops.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        moved = _inventory(tmp_path, demo_model_dir, busy)
        output, (_, _, _, failed) = _play(moved, "serve.yml")
    assert failed == 1 and f"port {busy} on 127.0.0.1 is already in use by another process" in output
    assert _pid(state) == pid and _alive(pid), "the running server was left as it was"
    inventory = _inventory(tmp_path, demo_model_dir, port)

    output, (_, changed, _, failed) = _play(inventory, "serve.yml", "--check")
    assert (changed, failed) == (0, 0), output[-5000:]
    assert _pid(state) == pid

    # the record a stage run alone reads to reach this server (serving_endpoints_info), on its own port
    assert json.loads((records / "state.json").read_text()) == {
        "state": "running", "kind": "server", "endpoint": f"http://127.0.0.1:{port}",
        "api_base": f"http://127.0.0.1:{port}/v1", "served_model_name": str(demo_model_dir),
    }
    output, (_, changed, _, failed) = _play(inventory, "teardown.yml")
    # Two changes: the process stopped, and its recorded state (what the run summary shows).
    assert failed == 0 and changed == 2, output[-5000:]
    assert not _alive(pid) and _nobody_listens(port)
    assert json.loads((records / "state.json").read_text()) == {"state": "stopped"}
    output, (_, changed, _, failed) = _play(inventory, "teardown.yml")
    assert (changed, failed) == (0, 0), output[-5000:]

    output, (_, changed, _, failed) = _play(inventory, "teardown.yml", "-e", "sglang_server_state=absent")
    assert failed == 0 and changed >= 1, output[-5000:]
    assert not list(state.glob("main.*"))


def test_a_server_that_exits_during_load_fails_fast_with_the_cause(
    tmp_path: Path, demo_model_dir: Path, teardown_after
) -> None:
    # Fault injection: a flag `transformers serve` does not know makes it exit at once.
    port = _free_port()
    inventory = _inventory(
        tmp_path,
        demo_model_dir,
        port,
        sglang_server_extra_args=["--no-such-flag"],
        sglang_server_ready_budget_s=300,
    )
    output, (_, _, _, failed) = _play(inventory, "serve.yml")
    assert failed == 1, output[-4000:]
    assert "regen-serve-main is not ready: it exited during load" in output
    assert "likely cause: the server rejected a command-line flag" in output
    assert "No such option '--no-such-flag'" in output
    # Fast: it stopped at the first poll that saw the process gone, not after the 300 s budget.
    assert output.count("(item=main:") <= 2


def test_a_port_held_by_another_process_is_refused(
    tmp_path: Path, demo_model_dir: Path, teardown_after
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        inventory = _inventory(tmp_path, demo_model_dir, port)
        output, (_, _, _, failed) = _play(inventory, "serve.yml")
    assert failed == 1
    assert f"port {port} on 127.0.0.1 is already in use by another process" in output
    assert not (tmp_path / "work" / "serving" / "main.pid").exists()


def test_plan_errors_stop_before_anything_starts(tmp_path: Path, demo_model_dir: Path) -> None:
    inventory = _inventory(
        tmp_path,
        demo_model_dir,
        _free_port(),
        sglang_server_backend="sglang",
        sglang_server_gpu_count=4,
        sglang_server_tp_size=8,
    )
    output, (_, _, _, failed) = _play(inventory, "serve.yml")
    assert failed == 1
    assert "the plan needs 8 GPUs per node" in output and "this host has 4 visible" in output
    inventory = _inventory(tmp_path, tmp_path / "no-model", _free_port())
    output, (_, _, _, failed) = _play(inventory, "serve.yml")
    assert failed == 1
    assert "does not exist on this host" in output
    inventory = _inventory(tmp_path, demo_model_dir, _free_port(), sglang_server_host="0.0.0.0")
    output, (_, _, _, failed) = _play(inventory, "serve.yml")
    assert failed == 1
    assert "no API key is set" in output
    assert not (tmp_path / "work" / "serving" / "main.pid").exists()


def test_systemd_unit_rendered_in_check_mode(tmp_path: Path, demo_model_dir: Path) -> None:
    """This machine has no systemd, so the unit is shown (check mode + diff), not installed: the real
    template through real Ansible templating, with an API key that must not appear in it."""
    facts = ROOT / "tests" / "fixtures" / "serving" / "facts-kimi-k2.6.json"
    inventory = _inventory(
        tmp_path,
        demo_model_dir,
        _free_port(),
        sglang_server_supervisor="systemd",
        sglang_server_backend="sglang",
        sglang_server_gpu_count=8,
        sglang_server_api_key="s3cr3t-key",
        sglang_server_host="0.0.0.0",
        regen_facts_file=str(facts),
        sglang_server_unit_dir=str(tmp_path / "units"),
        sglang_server_environment={"TORCH_CUDA_ARCH_LIST": "12.0", "NCCL_P2P_LEVEL": "SYS"},
    )
    output, (_, _, _, failed) = _play(inventory, "serve.yml", "--check", "--diff")
    assert failed == 0, output[-5000:]
    unit = [line[1:] for line in output.splitlines() if line.startswith("+") and not line.startswith("+++")]
    text = "\n".join(unit)
    assert "s3cr3t-key" not in output
    exec_start = next(line for line in unit if line.startswith("ExecStart="))
    assert " -m sglang.launch_server --model-path " in exec_start
    assert " --tp-size 8 --ep-size 8 " in exec_start and " --reasoning-parser kimi_k2 " in exec_start
    assert exec_start.endswith(f"--config {tmp_path}/work/serving/main.secret.yaml")
    assert f"EnvironmentFile={tmp_path}/work/serving/main.env" in unit
    assert 'Environment="TORCH_CUDA_ARCH_LIST=12.0"' in unit
    for line in (
        "Restart=on-failure",
        "TimeoutStartSec=3600",
        "LimitMEMLOCK=infinity",
        "LimitNOFILE=1048576",
        "StandardOutput=journal",
        "KillMode=control-group",
    ):
        assert line in unit, text
    assert not (tmp_path / "units").exists() and not (tmp_path / "work" / "serving" / "main.env").exists()


def test_a_known_failure_in_the_server_log_is_named_with_its_fix(
    tmp_path: Path, demo_model_dir: Path, teardown_after
) -> None:
    """Fault injection: the serving "python" is a stub that prints the real line of flashinfer issue 3263
    (TRT-LLM MLA prefill on sm_120) and exits, as SGLang does there; the role's failure message must carry
    the known-failures table's cause, its fix and the source."""
    logs = json.loads((ROOT / "tests" / "fixtures" / "quality" / "server_logs.json").read_text())
    line = next(e["line"] for e in logs if e["kind"] == "trtllm_mla_unsupported_arch")
    stub = tmp_path / "fault-injection-server"
    stub.write_text(f"#!/bin/sh\necho {json.dumps(line)} >&2\nexit 1\n")
    stub.chmod(0o755)
    inventory = _inventory(
        tmp_path, demo_model_dir, _free_port(), regen_serving_python=str(stub),
        sglang_server_ready_budget_s=120,
    )
    output, (_, _, _, failed) = _play(inventory, "serve.yml")
    assert failed == 1, output[-4000:]
    assert "regen-serve-main is not ready: it exited during load" in output
    assert "likely cause: the TRT-LLM MLA/FMHA kernels (attention backend trtllm_mla) do not run" in output
    assert "what to do: serve with --attention-backend flashinfer" in output
    assert "sglang_server_attention_backend" in output
    assert "source: https://github.com/sgl-project/sglang/issues/24633" in output
    assert "Unsupported architecture" in output


def test_typed_serving_settings_refuse_a_typo(tmp_path: Path, demo_model_dir: Path) -> None:
    # meta/argument_specs.yml types the new settings: a typo fails at once, naming the variable.
    inventory = _inventory(
        tmp_path, demo_model_dir, _free_port(), sglang_server_attention_backend="flashinfer_mla"
    )
    output, (_, _, _, failed) = _play(inventory, "serve.yml")
    assert failed == 1
    assert "sglang_server_attention_backend" in output and "flashinfer_mla" in output
    inventory = _inventory(tmp_path, demo_model_dir, _free_port(), sglang_server_router_metrics_port="many")
    output, (_, _, _, failed) = _play(inventory, "serve.yml")
    assert failed == 1 and "sglang_server_router_metrics_port" in output
    assert not (tmp_path / "work" / "serving" / "main.pid").exists()
