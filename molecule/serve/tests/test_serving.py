"""Verify the CT200 stand-in after `converge` of the serve scenario (testinfra over SSH).

Converge ran provision, introspect, prompts, serve and generate against the container; idempotence ran it
again and saw changed=0. These tests look at the systemd unit and the server inside the container, at what
the run recorded on the controller, and then drive the teardown and the "left stopped" path of the serve
stage with real ansible-playbook runs. They run in file order: the last ones stop and restart the server.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

VENV = "/root/regen/venvs/demo-serving"
MODEL = "/root/models/regen-demo-kimi"
HOST = "ct200-serve"
UNIT = "regen-serve-main"
URL = "http://127.0.0.1:30000"
RUNNING_RECORD = {
    "state": "running",
    "kind": "server",
    "endpoint": URL,
    "api_base": f"{URL}/v1",
    "served_model_name": MODEL,
}
PROJECT = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", Path(__file__).resolve().parents[3]))
EPHEMERAL = Path(os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "/nonexistent"))


def unit_property(host, name: str) -> str:
    return host.check_output(f"systemctl show {UNIT} -p {name} --value").strip()


def http(host, path: str, body: dict | None = None) -> dict:
    """A request from inside the container (the server listens on the container's loopback only)."""
    script = (
        "import json, sys, urllib.request; "
        f"body = {json.dumps(json.dumps(body)) if body is not None else 'None'}; "
        f"req = urllib.request.Request('{URL}{path}', data=body.encode() if body else None, "
        "headers={'Content-Type': 'application/json'}); "
        "print(urllib.request.urlopen(req, timeout=120).read().decode())"
    )
    result = host.run(f"{VENV}/bin/python -c {json.dumps(script)}")
    assert result.rc == 0, result.stderr
    return json.loads(result.stdout)


def playbook(*args: str) -> subprocess.CompletedProcess:
    """ansible-playbook against molecule's inventory of the container (its host_vars included)."""
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0"}
    inventory = Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent
    return subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )


def recap(output: str) -> dict[str, int]:
    match = re.search(rf"^{re.escape(HOST)}\s*:\s*(.*)$", output, re.MULTILINE)
    assert match, output[-3000:]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", match.group(1))}


def test_the_server_is_a_systemd_unit_with_the_documented_settings(host) -> None:
    assert host.run("readlink /proc/1/exe").stdout.strip().endswith("systemd")
    assert host.service(UNIT).is_running and host.service(UNIT).is_enabled
    unit = host.file(f"/etc/systemd/system/{UNIT}.service").content_string
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.startswith(f"ExecStart={VENV}/bin/")
    assert " serve " in exec_start and "--trust-remote-code" in exec_start and "127.0.0.1" in exec_start
    settings = ("Restart=on-failure", "TimeoutStartSec=3600", "LimitNOFILE=1048576", "LimitMEMLOCK=infinity")
    for line in settings:
        assert line in unit.splitlines(), line
    # The process systemd runs is the serving venv's, and it is the one listening on the port.
    pid = unit_property(host, "MainPID")
    assert pid != "0"
    assert host.check_output(f"tr '\\0' ' ' < /proc/{pid}/cmdline").startswith(f"{VENV}/bin/")
    assert host.socket("tcp://127.0.0.1:30000").is_listening


def test_idempotence_did_not_restart_the_server(host) -> None:
    # converge started the unit once; the idempotence run (changed=0) must not have started it again.
    assert unit_property(host, "NRestarts") == "0"
    journal = host.check_output(f"journalctl --no-pager -o cat -u {UNIT}")
    starts = [line for line in journal.splitlines() if line.startswith(f"Started {UNIT}.service")]
    assert len(starts) == 1, journal


def test_the_server_answers_a_chat_completion(host) -> None:
    models = http(host, "/v1/models")
    assert MODEL in [m["id"] for m in models["data"]]
    answer = http(
        host,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
    )
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    assert answer["usage"]["completion_tokens"] >= 1


def test_generation_ran_through_the_unit(host) -> None:
    status = json.loads(host.file("/root/regen/completions/status.json").content_string)
    records = host.check_output("cat /root/regen/completions/completions-*.jsonl").splitlines()
    assert len(records) == 8  # prompt_data_sample in molecule.yml
    assert len({json.loads(r)["id"] for r in records}) == 8
    assert status["state"] == "done" and status["done"] == 8 and status["failed"] == 0, status


def test_the_run_is_recorded_on_the_controller(host) -> None:
    record = EPHEMERAL / "artifacts" / "serving" / f"{HOST}-main"
    launch = json.loads((record / "launch.json").read_text())
    assert launch["mode"] == "systemd" and launch["unit"] == UNIT
    assert launch["backend"] == "transformers"
    assert launch["endpoint"] == URL
    # What a stage run alone reads to reach this server (issue 23): where it listens and what it serves.
    assert json.loads((record / "state.json").read_text()) == RUNNING_RECORD
    models = json.loads((record / "v1_models.json").read_text())
    assert MODEL in [m["id"] for m in models["data"]]
    facts = json.loads((EPHEMERAL / "artifacts" / "model_facts.json").read_text())
    assert facts["tokenizer"]["loaded_with"] == "library"  # tiktoken is in the serving venv


def test_teardown_stops_the_unit_and_a_second_teardown_changes_nothing(host) -> None:
    first = playbook(str(PROJECT / "playbooks" / "teardown.yml"))
    assert first.returncode == 0, first.stdout[-3000:]
    assert recap(first.stdout)["changed"] >= 1
    assert not host.service(UNIT).is_running
    assert not host.service(UNIT).is_enabled
    assert not host.socket("tcp://127.0.0.1:30000").is_listening
    assert host.file(f"/etc/systemd/system/{UNIT}.service").exists  # state stopped keeps the unit
    state = EPHEMERAL / "artifacts" / "serving" / f"{HOST}-main" / "state.json"
    assert json.loads(state.read_text()) == {"state": "stopped"}  # what the run summary shows
    second = playbook(str(PROJECT / "playbooks" / "teardown.yml"))
    assert second.returncode == 0, second.stdout[-3000:]
    assert recap(second.stdout)["changed"] == 0, second.stdout[-3000:]


def test_serve_leaves_a_stopped_server_stopped_once_generation_is_complete(host) -> None:
    # The re-run after training freed the GPUs: every prompt is generated, so loading the model again
    # would be wasted time. Nothing changes and the unit stays stopped.
    rerun = playbook(str(PROJECT / "playbooks" / "serve.yml"), str(PROJECT / "playbooks" / "generate.yml"))
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert recap(rerun.stdout)["changed"] == 0, rerun.stdout[-3000:]
    assert f"{UNIT} is not running and nothing downstream needs it" in rerun.stdout
    assert "completions up to date: 8 of 8" in rerun.stdout
    assert not host.service(UNIT).is_running


def test_serve_starts_it_again_when_asked(host) -> None:
    forced = playbook(str(PROJECT / "playbooks" / "serve.yml"), "-e", "sglang_server_needed=true")
    assert forced.returncode == 0, forced.stdout[-3000:]
    assert recap(forced.stdout)["changed"] >= 1
    assert host.service(UNIT).is_running
    assert MODEL in [m["id"] for m in http(host, "/v1/models")["data"]]
    state = EPHEMERAL / "artifacts" / "serving" / f"{HOST}-main" / "state.json"
    assert json.loads(state.read_text()) == RUNNING_RECORD
