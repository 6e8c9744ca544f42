"""Verify the three containers after `converge` of the serve scenario (testinfra over SSH).

Converge ran provision, prompts, introspect, serve and generate: a server on ct200-serve (host A, the
`host` fixture) and one on ct200-serve2 (host A2), each listening on its bridge address with the pipeline's
API key, and sglang-router on A in front of both, on A's bridge address with the same key; the prompts and
the generation job on ct200-gen (host B) through the router. Idempotence ran it again and saw changed=0 on
all three. These tests look at the systemd units and the servers, at the completions on B, at what a client
outside the pipeline gets, at what the run recorded on the controller, and then drive the teardown and the
"left stopped" path of the serve stage with real ansible-playbook runs, a hard restart of A mid-run, and
A2 stopped mid-run behind the router (issue 28, item 3). They run in file order: the last ones stop and
restart the servers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import testinfra

VENV = "/root/regen/venvs/demo-serving"
JOBS_VENV = "/root/regen/venvs/jobs"
MODEL = "/root/models/regen-demo-kimi"
HOST = "ct200-serve"
HOST2 = "ct200-serve2"
GENERATOR = "ct200-gen"
UNIT = "regen-serve-main"
ROUTER_UNIT = "regen-serve-router"
PORT = 30000
ROUTER_PORT = 30100  # sglang_server_router_port's default
KEY = "molecule-serve-key-7d41e0"  # regen_api_key in molecule.yml
PROJECT = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", Path(__file__).resolve().parents[3]))
EPHEMERAL = Path(os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "/nonexistent"))
INVENTORY = Path(os.environ.get("MOLECULE_INVENTORY_FILE", "/nonexistent"))
# The stages a generation run on B is made of (the last tests run them again, mid-fault).
STAGES = [str(PROJECT / "playbooks" / name) for name in ("prompts.yml", "generate.yml")]


@pytest.fixture(scope="module")
def address(host) -> str:
    """Host A's address on the containers' bridge: where its server listens."""
    return host.ansible.get_variables()["ansible_host"]


@pytest.fixture(scope="module")
def url(address) -> str:
    return f"http://{address}:{PORT}"


@pytest.fixture(scope="module")
def router_url(address) -> str:
    return f"http://{address}:{ROUTER_PORT}"


@pytest.fixture(scope="module")
def generator():
    """Host B, reached the way testinfra reaches A (molecule's inventory)."""
    return testinfra.get_host(f"ansible://{GENERATOR}?ansible_inventory={INVENTORY.parent}")


@pytest.fixture(scope="module")
def server2():
    """Host A2, the second serving container."""
    return testinfra.get_host(f"ansible://{HOST2}?ansible_inventory={INVENTORY.parent}")


@pytest.fixture(scope="module")
def url2(server2) -> str:
    return f"http://{server2.ansible.get_variables()['ansible_host']}:{PORT}"


def served_requests(host) -> int:
    """Chat completions the server on `host` answered (uvicorn's access lines in the unit's journal)."""
    journal = host.run(f"journalctl --no-pager -o cat -u {UNIT}").stdout
    return len(re.findall(r'"POST /v1/chat/completions HTTP/1\.1" 200', journal))


def running_record(url: str) -> dict:
    return {"state": "running", "kind": "server", "endpoint": url, "api_base": f"{url}/v1",
            "served_model_name": MODEL}


def unit_property(host, name: str, unit: str = UNIT) -> str:
    return host.check_output(f"systemctl show {unit} -p {name} --value").strip()


def http(host, python: str, url: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
    """A request from inside a container: (status, JSON answer)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    script = (
        "import json, sys, urllib.error, urllib.request; "
        f"body = {json.dumps(json.dumps(body)) if body is not None else 'None'}; "
        f"req = urllib.request.Request({url!r}, data=body.encode() if body else None, headers={headers!r})\n"
        "try:\n    r = urllib.request.urlopen(req, timeout=120); print(r.status, r.read().decode())\n"
        "except urllib.error.HTTPError as e:\n    print(e.code, e.read().decode())"
    )
    result = host.run(f"{python}/bin/python -c {shlex.quote(script)}")
    assert result.rc == 0, result.stderr
    status, _, answer = result.stdout.partition(" ")
    return int(status), json.loads(answer or "{}")


def playbook(*args: str) -> subprocess.CompletedProcess:
    """ansible-playbook against molecule's inventory of the containers (its group and host vars included)."""
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0"}
    return subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(INVENTORY.parent), *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )


def recap(output: str, name: str = HOST) -> dict[str, int]:
    match = re.search(rf"^{re.escape(name)}\s*:\s*(.*)$", output, re.MULTILINE)
    assert match, output[-3000:]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", match.group(1))}


def test_the_server_is_a_systemd_unit_with_the_documented_settings(host, address) -> None:
    assert host.run("readlink /proc/1/exe").stdout.strip().endswith("systemd")
    assert host.service(UNIT).is_running and host.service(UNIT).is_enabled
    unit = host.file(f"/etc/systemd/system/{UNIT}.service").content_string
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.startswith(f"ExecStart={VENV}/bin/")
    assert " serve " in exec_start and "--trust-remote-code" in exec_start
    assert f"--host {address} " in exec_start
    # The key reaches the server from the 0600 environment file, never from the unit or its command line.
    assert KEY not in unit and "EnvironmentFile=/root/regen/serving/main.env" in unit.splitlines()
    settings = ("Restart=on-failure", "TimeoutStartSec=3600", "LimitNOFILE=1048576", "LimitMEMLOCK=infinity")
    for line in settings:
        assert line in unit.splitlines(), line
    # The process systemd runs is the serving venv's, and it is the one listening on the port.
    pid = unit_property(host, "MainPID")
    assert pid != "0"
    assert host.check_output(f"tr '\\0' ' ' < /proc/{pid}/cmdline").startswith(f"{VENV}/bin/")
    assert KEY not in host.check_output(f"tr '\\0' ' ' < /proc/{pid}/cmdline")
    assert host.socket(f"tcp://{address}:{PORT}").is_listening


def test_the_router_is_a_unit_on_a_in_front_of_both_servers(host, address, url, url2) -> None:
    assert host.service(ROUTER_UNIT).is_running and host.service(ROUTER_UNIT).is_enabled
    unit = host.file(f"/etc/systemd/system/{ROUTER_UNIT}.service").content_string
    assert KEY not in unit and "EnvironmentFile=/root/regen/serving/router.env" in unit.splitlines()
    pid = unit_property(host, "MainPID", ROUTER_UNIT)
    cmdline = host.check_output(f"tr '\\0' ' ' < /proc/{pid}/cmdline")
    assert KEY not in cmdline
    launch = json.loads((EPHEMERAL / "artifacts" / "serving" / f"{HOST}-router" / "launch.json").read_text())
    workers = launch["argv"][launch["argv"].index("--worker-urls") + 1 : launch["argv"].index("--policy")]
    assert workers == [url, url2], launch["argv"]
    assert host.socket(f"tcp://{address}:{ROUTER_PORT}").is_listening
    # Its Prometheus metrics (no authentication) on loopback only.
    assert host.socket("tcp://127.0.0.1:29000").is_listening
    assert not host.socket(f"tcp://{address}:29000").is_listening


def test_idempotence_did_not_restart_the_servers(host, server2) -> None:
    # converge started each unit once; the idempotence run (changed=0) must not have started it again.
    for machine, unit in ((host, UNIT), (server2, UNIT), (host, ROUTER_UNIT)):
        assert unit_property(machine, "NRestarts", unit) == "0"
        journal = machine.check_output(f"journalctl --no-pager -o cat -u {unit}")
        starts = [line for line in journal.splitlines() if line.startswith(f"Started {unit}.service")]
        assert len(starts) == 1, journal


@pytest.mark.parametrize("through", ["server", "router"])
def test_the_server_answers_host_b_with_the_key(generator, url, router_url, through) -> None:
    base = url if through == "server" else router_url
    if through == "server":
        status, models = http(generator, JOBS_VENV, f"{base}/v1/models")
        assert status == 200 and MODEL in [m["id"] for m in models["data"]]
    status, answer = http(
        generator,
        JOBS_VENV,
        f"{base}/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
    )
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    assert answer["usage"]["completion_tokens"] >= 1


def test_a_client_without_the_key_is_refused(generator, url, router_url) -> None:
    """From B without the key, and from the controller (on the bridge, in no group of the pipeline) without
    it or with another: 401 on the API of the server and of the router, while the health probe answers."""
    assert http(generator, JOBS_VENV, f"{url}/v1/models", key=None)[0] == 401
    for base in (url, router_url):
        for key in (None, "not-the-key"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            request = urllib.request.Request(f"{base}/v1/chat/completions", headers=headers, data=json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode())
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 401, base
    with urllib.request.urlopen(f"{url}/health", timeout=30) as health:
        assert health.status == 200


def test_generation_ran_on_host_b_through_the_router(host, server2, generator, router_url) -> None:
    status = json.loads(generator.file("/root/regen/completions/status.json").content_string)
    records = generator.check_output("cat /root/regen/completions/completions-*.jsonl").splitlines()
    assert len(records) == 8  # prompt_data_sample in molecule.yml
    assert len({json.loads(r)["id"] for r in records}) == 8
    assert status["state"] == "done" and status["done"] == 8 and status["failed"] == 0, status
    # The job's only endpoint was the router on A, and it answered every request; both servers answered
    # some (round robin); the key is in no record.
    assert [endpoint["url"] for endpoint in status["endpoints"]] == [router_url], status["endpoints"]
    assert served_requests(host) >= 1 and served_requests(server2) >= 1
    assert status["endpoints"][0]["ok"] >= 8 and status["endpoints"][0]["errors"] == 0, status["endpoints"]
    assert KEY not in generator.check_output("cat /root/regen/completions/*.json*")
    # B runs its jobs in the jobs venv (no torch), and A holds no completions.
    assert generator.run(f"{JOBS_VENV}/bin/python -c 'import torch'").rc != 0
    assert not host.file("/root/regen/completions").exists
    assert not server2.file("/root/regen/completions").exists


def test_the_run_is_recorded_on_the_controller(url, url2, router_url) -> None:
    record = EPHEMERAL / "artifacts" / "serving" / f"{HOST}-main"
    launch = json.loads((record / "launch.json").read_text())
    assert launch["mode"] == "systemd" and launch["unit"] == UNIT
    assert launch["backend"] == "transformers"
    assert launch["endpoint"] == url
    # What a stage run alone reads to reach this server (issue 23): where it listens and what it serves.
    assert json.loads((record / "state.json").read_text()) == running_record(url)
    models = json.loads((record / "v1_models.json").read_text())
    assert MODEL in [m["id"] for m in models["data"]]
    assert json.loads((EPHEMERAL / "artifacts" / "serving" / f"{HOST2}-main" / "state.json").read_text()) == (
        running_record(url2))
    router = json.loads((EPHEMERAL / "artifacts" / "serving" / f"{HOST}-router" / "state.json").read_text())
    assert router["state"] == "running" and router["kind"] == "router" and router["endpoint"] == router_url
    facts = json.loads((EPHEMERAL / "artifacts" / "model_facts.json").read_text())
    assert facts["tokenizer"]["loaded_with"] == "library"  # tiktoken is in the serving venv


def test_teardown_stops_the_units_and_a_second_teardown_changes_nothing(host, server2, address) -> None:
    first = playbook(str(PROJECT / "playbooks" / "teardown.yml"))
    assert first.returncode == 0, first.stdout[-3000:]
    assert recap(first.stdout)["changed"] >= 1 and recap(first.stdout, HOST2)["changed"] >= 1
    for machine, unit, name in ((host, UNIT, f"{HOST}-main"), (server2, UNIT, f"{HOST2}-main"),
                                (host, ROUTER_UNIT, f"{HOST}-router")):
        assert not machine.service(unit).is_running, name
        assert not machine.service(unit).is_enabled, name
        assert machine.file(f"/etc/systemd/system/{unit}.service").exists  # state stopped keeps the unit
        state = EPHEMERAL / "artifacts" / "serving" / name / "state.json"
        assert json.loads(state.read_text()) == {"state": "stopped"}  # what the run summary shows
    assert not host.socket(f"tcp://{address}:{PORT}").is_listening
    assert not host.socket(f"tcp://{address}:{ROUTER_PORT}").is_listening
    second = playbook(str(PROJECT / "playbooks" / "teardown.yml"))
    assert second.returncode == 0, second.stdout[-3000:]
    for name in (HOST, HOST2):
        assert recap(second.stdout, name)["changed"] == 0, second.stdout[-3000:]


def test_serve_leaves_a_stopped_server_stopped_once_generation_is_complete(host, server2) -> None:
    # The re-run after training freed the GPUs: B's job says every prompt is generated, so loading the
    # model again on A would be wasted time. Nothing changes on either host and the unit stays stopped.
    rerun = playbook(str(PROJECT / "playbooks" / "serve.yml"), str(PROJECT / "playbooks" / "generate.yml"))
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    for name in (HOST, HOST2, GENERATOR):
        assert recap(rerun.stdout, name)["changed"] == 0, rerun.stdout[-3000:]
    assert f"{UNIT} is not running and nothing downstream needs it" in rerun.stdout
    assert f"{ROUTER_UNIT} is not running and nothing downstream needs it" in rerun.stdout
    assert "completions up to date: 8 of 8" in rerun.stdout
    assert not host.service(UNIT).is_running and not server2.service(UNIT).is_running
    assert not host.service(ROUTER_UNIT).is_running


def test_serve_starts_it_again_when_asked(host, server2, generator, url) -> None:
    forced = playbook(str(PROJECT / "playbooks" / "serve.yml"), "-e", "sglang_server_needed=true")
    assert forced.returncode == 0, forced.stdout[-3000:]
    assert recap(forced.stdout)["changed"] >= 1 and recap(forced.stdout, HOST2)["changed"] >= 1
    assert host.service(UNIT).is_running and server2.service(UNIT).is_running
    assert host.service(ROUTER_UNIT).is_running
    status, models = http(generator, JOBS_VENV, f"{url}/v1/models")
    assert status == 200 and MODEL in [m["id"] for m in models["data"]]
    state = EPHEMERAL / "artifacts" / "serving" / f"{HOST}-main" / "state.json"
    assert json.loads(state.read_text()) == running_record(url)


def _boot_of(host) -> str | None:
    """When the container's PID 1 started (a container shares the host's kernel, and so its boot id), or
    None while it cannot be reached."""
    try:
        result = host.run("cut -d' ' -f22 /proc/1/stat")
    except Exception:  # testinfra's ansible backend raises while the host is unreachable
        return None
    return result.stdout.strip() if result.rc == 0 else None


# Prompts of the generation runs the last tests fault mid-run: enough that the job runs on for several
# requests after the fault, few enough to keep the scenario short.
FAULT_RUN_PROMPTS = 24


def _start_generation(generator, work: str, concurrency: int) -> tuple[subprocess.Popen, dict]:
    """The prompts and generate stages run again on B, FAULT_RUN_PROMPTS prompts into `work` (from nothing),
    in the background: (the ansible-playbook process, the extra variables it was given)."""
    extra = {
        "prompt_data_output_dir": f"{work}/prompts",
        "prompt_data_sample": FAULT_RUN_PROMPTS,
        "completions_output_dir": f"{work}/completions",
        "completions_concurrency": concurrency,
        "completions_max_tokens": 32,
        "completions_poll_interval_s": 1,
    }
    generator.run(f"rm -rf {work}")
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0"}
    command = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(INVENTORY.parent), *STAGES,
               "-e", json.dumps(extra)]
    run = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return run, extra


def test_a_reboot_of_the_serving_container_mid_run_costs_only_the_requests_in_flight(host, generator) -> None:
    """Issue 28, item 5: host A, the whole container, restarts hard (`systemctl reboot --force`: no orderly
    stop) while host B's job is generating through the router on A. A's server is frozen first, so the demo
    model's speed cannot let the job finish before the restart, and killed mid-request. systemd starts the
    enabled units (server and router) again at boot; B's job meets the outage, holds its records, and goes
    on when the router is back.
    Nothing is doubled, and what is lost is at most what was in flight (records that spent their retries
    during the outage, which the next run generates)."""
    concurrency = 1
    work = "/root/regen/reboot"
    assert host.service(UNIT).is_enabled
    booted = _boot_of(host)
    assert booted
    first, extra = _start_generation(generator, work, concurrency)
    try:
        # Once B's job is generating, freeze the server (SIGSTOP): the job cannot finish before the restart,
        # however fast the demo model answers, and its request to A is in flight when A goes down.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and first.poll() is None:
            status = generator.run(f"cat {work}/completions/status.json")
            if status.rc == 0 and json.loads(status.stdout).get("done", 0) >= 1:
                break
            time.sleep(0.5)
        assert first.poll() is None, "the job ended before the restart"
        server = host.check_output(f"systemctl show -p MainPID --value {UNIT}")
        host.check_output(f"kill -STOP {server}")
        time.sleep(3)  # the job writes its status every 2 s
        frozen = json.loads(generator.check_output(f"cat {work}/completions/status.json"))
        assert 0 < frozen["done"] < frozen["total"], frozen
        # The server dies first, while the container's network is up, so B's request in flight is reset at
        # once (a forced reboot alone leaves B to find out from TCP retransmissions, some 30 s later).
        host.check_output(f"kill -KILL {server}")
        restart = host.run("systemd-run --on-active=1 systemctl reboot --force")
        assert restart.rc == 0, restart.stderr
        deadline = time.monotonic() + 180
        while _boot_of(host) in (booted, None):
            assert time.monotonic() < deadline, "the container did not come back within 180 s"
            time.sleep(1)
        output, _ = first.communicate(timeout=900)
    finally:
        if first.poll() is None:
            first.kill()
    status = json.loads(generator.check_output(f"cat {work}/completions/status.json"))
    assert host.service(UNIT).is_running  # started again by systemd at boot
    seen = {key: status[key] for key in ("done", "failed", "requests", "retries", "outage_s", "endpoints")}
    # The restart came mid-run (the job was running, with prompts left, when A's server was killed). How the
    # job meets it depends on where its request is: one the router had sent to A's server is sent again to
    # A2 when that server dies; one sent while A is down fails and is retried, or waits in connect() until A
    # (and its router) are back. Either way nothing is lost or doubled (below).
    # In flight: the job holds twice its concurrency of records (those waiting out a backoff hold no slot).
    assert status["failed"] <= 2 * concurrency, (seen, output[-3000:])
    if first.returncode != 0:
        assert status["failed"] > 0, output[-3000:]  # a failed run names its failed records
        second = playbook(*STAGES, "-e", json.dumps(extra))
        assert second.returncode == 0, second.stdout[-3000:]
        status = json.loads(generator.check_output(f"cat {work}/completions/status.json"))
    records = [json.loads(line) for line in
               generator.check_output(f"cat {work}/completions/completions-*.jsonl").splitlines()]
    ids = [record["id"] for record in records]
    assert len(ids) == len(set(ids)) == status["total"] == status["done"], status  # nothing lost or doubled
    assert status["state"] == "done" and status["failed"] == 0 and status["duplicates"] == 0, status


def _container_of(platform: str) -> str:
    """The LXC container molecule's create.yml made for `platform` (named per checkout)."""
    return f"{platform}-{hashlib.sha1(str(PROJECT).encode()).hexdigest()[:6]}"


def test_a_serving_container_stopped_mid_run_behind_the_router_loses_and_doubles_nothing(
    host, server2, generator
) -> None:
    """Issue 28, item 3: two serving containers behind sglang-router, and host A2, the whole container,
    stopped (`lxc-stop`: its systemd stops the server, then the container is gone) while host B's job
    generates through the router. The router sends what A2 had in flight and everything after to A; the job
    finishes in the same run, with every prompt answered once."""
    concurrency = 2
    work = "/root/regen/scale-out"
    # The previous test restarted A: its server and the router came back at boot.
    deadline = time.monotonic() + 180
    while not (host.service(UNIT).is_running and host.service(ROUTER_UNIT).is_running
               and server2.service(UNIT).is_running):
        assert time.monotonic() < deadline, "the servers and the router are not all running"
        time.sleep(2)
    served_by_a = served_requests(host)
    run, _ = _start_generation(generator, work, concurrency)
    try:
        deadline = time.monotonic() + 300
        done_before = 0
        while time.monotonic() < deadline and run.poll() is None:
            status = generator.run(f"cat {work}/completions/status.json")
            done_before = json.loads(status.stdout).get("done", 0) if status.rc == 0 else 0
            if done_before >= 4:
                break
            time.sleep(0.5)
        assert run.poll() is None and 4 <= done_before < FAULT_RUN_PROMPTS, ("ended first", done_before)
        served_by_a2 = served_requests(server2)
        assert served_by_a2 >= 1  # round robin: A2 had its share until now
        stop = subprocess.run(["lxc-stop", "-n", _container_of(HOST2), "-t", "60"], capture_output=True,
                              text=True, check=False, timeout=120)
        assert stop.returncode == 0, stop.stderr
        output, _ = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
    status = json.loads(generator.check_output(f"cat {work}/completions/status.json"))
    seen = {key: status[key] for key in ("done", "failed", "requests", "retries", "endpoints")}
    assert run.returncode == 0, (seen, output[-3000:])
    records = [json.loads(line) for line in
               generator.check_output(f"cat {work}/completions/completions-*.jsonl").splitlines()]
    ids = [record["id"] for record in records]
    # Nothing lost or doubled.
    assert len(ids) == len(set(ids)) == status["total"] == status["done"] == FAULT_RUN_PROMPTS, seen
    assert status["state"] == "done" and status["failed"] == 0 and status["duplicates"] == 0, seen
    # Everything the job still needed after the stop was answered by A.
    assert served_requests(host) - served_by_a >= FAULT_RUN_PROMPTS - done_before - concurrency, seen
