"""regen.serving.supervisor and regen.serving.diagnose against real processes and real log text.

The "server" here is Python's own http.server serving a directory that holds a `v1/models` file, so the
readiness probe gets a real HTTP 200 from a real listening process. Processes that die on purpose are
fault-injection stubs and are named so.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from regen import procs
from regen.serving import supervisor
from regen.serving.diagnose import diagnose, stage_of, tail

PY = sys.executable


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def site(tmp_path: Path) -> Path:
    root = tmp_path / "site"
    (root / "v1").mkdir(parents=True)
    (root / "v1" / "models").write_text('{"object": "list", "data": [{"id": "demo"}]}')
    return root


@pytest.fixture
def state_dir(tmp_path: Path):
    path = tmp_path / "state"
    yield path
    # Never leave a server behind, whatever the test did.
    for pid_file in path.glob("*.pid"):
        supervisor.stop(str(path), pid_file.stem, remove=True, timeout=5)


def _spec(state_dir: Path, site: Path, port: int, **extra) -> dict:
    return {
        "name": "t",
        "argv": [PY, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(site)],
        "env": {"REGEN_TEST": "1"},
        "state_dir": str(state_dir),
        "host": "127.0.0.1",
        "port": port,
        "stop_timeout": 10,
        **extra,
    }


def _wait(state_dir: Path, port: int, slice_s: float = 20.0, budget: float = 60.0) -> dict:
    args = supervisor._parser().parse_args(
        ["wait", "--state-dir", str(state_dir), "--name", "t", "--url", f"http://127.0.0.1:{port}/v1/models",
         "--slice", str(slice_s), "--budget", str(budget), "--interval", "0.2", "--probe-timeout", "2"]
    )
    return supervisor.wait(args)


def test_start_is_idempotent_restarts_on_change_and_stops(state_dir, site):
    port = _free_port()
    spec = _spec(state_dir, site, port)
    first = supervisor.start(spec)
    assert (first["changed"], first["action"]) == (True, "started")
    ready = _wait(state_dir, port)
    assert ready["ready"] and ready["alive"] and ready["stage"] == "ready"

    again = supervisor.start(spec)
    assert (again["changed"], again["action"], again["pid"]) == (False, "unchanged", first["pid"])
    assert supervisor.start(spec, check=True)["changed"] is False

    changed = dict(spec, env={"REGEN_TEST": "2"})
    check = supervisor.start(changed, check=True)
    assert (check["changed"], check["action"], check["pid"]) == (True, "restarted", first["pid"])
    assert procs.alive(first["pid"])  # check mode touched nothing
    restarted = supervisor.start(changed)
    assert restarted["action"] == "restarted" and restarted["pid"] != first["pid"]
    assert not procs.alive(first["pid"])
    assert _wait(state_dir, port)["ready"]

    status = supervisor.status(str(state_dir), "t")
    assert status["running"] and status["pid"] == restarted["pid"]
    stopped = supervisor.stop(str(state_dir), "t")
    assert stopped["changed"] and not procs.alive(restarted["pid"])
    assert supervisor.stop(str(state_dir), "t")["changed"] is False
    assert (state_dir / "t.log").exists()
    removed = supervisor.stop(str(state_dir), "t", remove=True)
    assert removed["changed"] and not list(state_dir.glob("t.*"))


def test_a_taken_port_fails_before_launching(state_dir, site):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(supervisor.SupervisorError, match=f"port {port} on 127.0.0.1 is already in use"):
            supervisor.start(_spec(state_dir, site, port))
    assert not (state_dir / "t.pid").exists()


def test_the_port_probe_answers_for_the_role(capsys):
    # `port` is what a role (or serving_launch_info's caller) asks instead of a bind of its own.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        assert supervisor.main(["port", "--host", "127.0.0.1", "--port", str(taken)]) == 0
        assert json.loads(capsys.readouterr().out) == {
            "changed": False,
            "free": False,
            "host": "127.0.0.1",
            "port": taken,
        }
    assert procs.port_free("127.0.0.1", taken), "released once its holder closes"


def test_a_server_that_dies_during_load_is_reported_with_its_cause(state_dir, site):
    # Fault-injection stub: a "server" whose import fails, as a serving venv without a module would.
    stub = "print('Load weight begin. avail mem=10.00 GB')\nimport regen_no_such_module"
    spec = _spec(state_dir, site, _free_port(), argv=[PY, "-c", stub])
    supervisor.start(spec)
    result = _wait(state_dir, spec["port"], slice_s=15)
    assert not result["ready"] and not result["alive"]
    assert result["cause"] == "missing_module"
    assert "regen_no_such_module" in result["cause_summary"]
    assert result["stage"] == "loading weights"
    assert any("ModuleNotFoundError" in line for line in result["log_tail"])


def test_wait_reports_progress_and_times_out_on_a_silent_server(state_dir, site):
    # Fault-injection stub: alive, printing SGLang's real loading lines, never answering HTTP.
    script = (
        "import sys, time\n"
        "print('Load weight begin. avail mem=93.10 GB', flush=True)\n"
        "sys.stderr.write('Loading safetensors checkpoint shards:  45% Completed | 29/64 [00:10<00:12]\\r')\n"
        "sys.stderr.flush()\n"
        "time.sleep(60)\n"
    )
    spec = _spec(state_dir, site, _free_port(), argv=[PY, "-c", script])
    supervisor.start(spec)
    time.sleep(1.0)
    result = _wait(state_dir, spec["port"], slice_s=1.5, budget=0.5)
    assert result["alive"] and not result["ready"] and result["timed_out"]
    assert (result["stage"], result["detail"]) == ("loading shards", "29/64")
    assert "loading shards 29/64" in result["progress"]
    assert result["cause"] == "unknown" and result["log_tail"]


def test_secret_env_file_is_expanded_into_argv_and_fingerprinted(state_dir, site, tmp_path):
    env_file = tmp_path / "secret.env"
    env_file.write_text("REGEN_SERVING_API_KEY=k1\n")
    out = tmp_path / "seen"
    spec = _spec(state_dir, site, _free_port(), argv=[
        PY, "-c", "import sys, time; open(sys.argv[1], 'w').write(sys.argv[2]); time.sleep(60)",
        str(out), "${REGEN_SERVING_API_KEY}"])
    first = supervisor.start(spec, str(env_file))
    for _ in range(50):
        if out.exists() and out.read_text():
            break
        time.sleep(0.1)
    assert out.read_text() == "k1"
    state = json.loads((state_dir / "t.state.json").read_text())
    assert "k1" not in json.dumps(state)  # the key is not copied into the state file
    assert oct(os.stat(state_dir / "t.state.json").st_mode & 0o777) == "0o600"
    assert supervisor.start(spec, str(env_file))["action"] == "unchanged"
    env_file.write_text("REGEN_SERVING_API_KEY=k2\n")
    second = supervisor.start(spec, str(env_file))
    assert second["action"] == "restarted" and second["pid"] != first["pid"]


def test_cli_prints_json_and_exit_codes(state_dir, site, capsys):
    assert supervisor.main(["status", "--state-dir", str(state_dir), "--name", "t"]) == 0
    assert json.loads(capsys.readouterr().out)["running"] is False
    assert supervisor.main(["start", "--spec-json", "[1]"]) == 2
    assert "JSON object" in json.loads(capsys.readouterr().out)["msg"]
    assert supervisor.main(["status", "--state-dir", str(state_dir), "--name", "bad/name"]) == 2


def test_redact_removes_secrets_and_live_counters():
    info = {"api_key": "sekrit", "admin_api_key": None, "tp_size": 8,
            "launch_command": "sglang serve --model-path /m --api-key sekrit --admin-api-key=x",
            "internal_states": [{"last_gen_throughput": 12.5}], "data": [{"id": "m", "created": 17}]}
    out = supervisor.redact(info)
    assert "sekrit" not in json.dumps(out) and "=x" not in out["launch_command"]
    assert out["api_key"] == "<redacted>" and out["admin_api_key"] is None and out["tp_size"] == 8
    assert "internal_states" not in out and out["data"] == [{"id": "m"}]


# --------------------------------------------------------------------------------------------------
# diagnose: lines as the servers print them (SGLang 0.5.23's messages, transformers 5.24's, CPython's)
# --------------------------------------------------------------------------------------------------

SGLANG_LOAD = """\
[2026-12-01 10:00:01] server_args=ServerArgs(model_path='/root/models/Kimi-K2.6', tp_size=8)
[2026-12-01 10:00:09 TP0] Init torch distributed begin.
[2026-12-01 10:00:12 TP0] Load weight begin. avail mem=93.10 GB
Loading safetensors checkpoint shards:   3% Completed | 2/64 [00:10<05:10, 5.01s/it]\r\
Loading safetensors checkpoint shards:  45% Completed | 29/64 [02:30<03:01, 5.20s/it]
"""


@pytest.mark.parametrize(
    ("text", "stage", "detail"),
    [
        (SGLANG_LOAD, "loading shards", "29/64"),
        (SGLANG_LOAD + "[TP0] Load weight end. type=DeepseekV3ForCausalLM, avail mem=18.2 GB\n",
         "weights loaded", ""),
        (SGLANG_LOAD + "[TP0] KV Cache is allocated. #tokens: 412345\n", "allocating KV cache", ""),
        (SGLANG_LOAD + "[TP0] Capture decode CUDA graph begin. This can take up to several minutes.\n",
         "capturing CUDA graphs", ""),
        (SGLANG_LOAD + "INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)\n",
         "HTTP server up", ""),
        (SGLANG_LOAD + "[2026-12-01 10:20:00] The server is fired up and ready to roll!\n", "ready", ""),
        ("[transformers] Loading /m\nLoading weights:   0%|   | 0/63 [00:00<?, ?it/s]\rLoading weights: "
         "100%|####| 63/63 [00:00<00:00, 6667.71it/s]\n", "loading shards", "63/63"),
        ("", None, ""),
    ],
)
def test_stage_of(text, stage, detail):
    assert stage_of(text) == (stage, detail)


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "gpu_oom"),
        ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.", "gpu_oom"),
        ("OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): "
         "address already in use", "port_in_use"),
        ("ModuleNotFoundError: No module named 'sgl_kernel'", "missing_module"),
        ("OSError: /root/models/Kimi-K2.6 does not appear to have a file named config.json.", "model_path"),
        ("ValueError: The repository /m contains custom code which must be executed to correctly load the "
         "model. Please pass the argument `trust_remote_code=True` to allow custom code to be run.",
         "trust_remote_code"),
        ("sglang serve: error: unrecognized arguments: --bogus", "bad_argument"),
        ("Error: No such option '--bogus-flag'.", "bad_argument"),
        ("RuntimeError: Found no NVIDIA driver on your system.", "no_gpu"),
        ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system "
         "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3", "nccl"),
        ("AssertionError: ep_size * moe_dp_size must be equal to tp_size", "config_rejected"),
        ("KeyError: 'model.layers.0.mlp.experts.0.w1'", "exception"),
    ],
)
def test_diagnose(line, kind):
    trace = 'Traceback (most recent call last):\n  File "x.py", line 1\n'
    cause = diagnose(SGLANG_LOAD + trace + line + "\n")
    assert cause is not None and cause.kind == kind
    assert cause.hint


def test_diagnose_prefers_the_specific_cause_and_says_nothing_for_a_clean_log():
    assert diagnose(SGLANG_LOAD) is None
    oom_then_generic = SGLANG_LOAD + "torch.OutOfMemoryError: CUDA out of memory.\nRuntimeError: died\n"
    assert diagnose(oom_then_generic).kind == "gpu_oom"


def test_tail_collapses_progress_redraws():
    lines = tail(SGLANG_LOAD, 3)
    assert lines[-1].startswith("Loading safetensors checkpoint shards:  45%")
    assert len(lines) == 3


def test_the_api_key_is_scrubbed_from_log_tails(state_dir, site, tmp_path):
    # Fault-injection stub: SGLang logs its server_args (API key included) at start, then dies.
    env_file = tmp_path / "secret.env"
    env_file.write_text("REGEN_SERVING_API_KEY=sekrit-123\n")
    stub = "print(\"server_args={'api_key': 'sekrit-123', 'tp_size': 8}\")\nraise SystemExit(3)"
    spec = _spec(state_dir, site, _free_port(), argv=[PY, "-c", stub])
    supervisor.start(spec, str(env_file))
    args = supervisor._parser().parse_args(
        ["wait", "--state-dir", str(state_dir), "--name", "t", "--slice", "10", "--interval", "0.2",
         "--api-key-env-file", str(env_file)]
    )
    result = supervisor.wait(args)
    assert not result["alive"]
    assert "sekrit-123" not in json.dumps(result)
    assert any("'api_key': '<redacted>'" in line for line in result["log_tail"])


# Real failure lines quoted in the public threads the known-failures table cites
# (tests/fixtures/quality/server_logs.json, with each line's source).
KNOWN_LOGS = json.loads(
    (Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "quality" / "server_logs.json").read_text()
)


@pytest.mark.parametrize("entry", KNOWN_LOGS, ids=[e["id"] for e in KNOWN_LOGS])
def test_diagnose_names_the_known_failure_and_its_fix(entry):
    trace = 'Traceback (most recent call last):\n  File "x.py", line 1\n'
    cause = diagnose(SGLANG_LOAD + trace + entry["line"] + "\n")
    # Before known_failures was wired in, these surfaced as a plain "exception" (or nothing).
    assert cause is not None and cause.kind == entry["kind"]
    assert "source: https://" in cause.hint
    assert cause.line == entry["line"].strip()[:300]


def test_a_known_failure_wins_over_the_generic_causes():
    # The TRT-LLM MLA kernels refusing sm_120 is a RuntimeError; the table's fix must be what is shown.
    line = KNOWN_LOGS[0]["line"]
    cause = diagnose(SGLANG_LOAD + line + "\nRuntimeError: worker died\n")
    assert cause.kind == "trtllm_mla_unsupported_arch"
    assert "--attention-backend flashinfer" in cause.hint


def test_wait_reports_the_known_failure_of_a_server_that_died(state_dir, site):
    # Fault-injection stub: a "server" that prints the real flashinfer#3263 line and exits, as SGLang's
    # prefill does on sm_120 with trtllm_mla.
    line = KNOWN_LOGS[0]["line"]
    stub = f"import sys\nprint({line!r}, file=sys.stderr)\nraise SystemExit(1)"
    spec = _spec(state_dir, site, _free_port(), argv=[PY, "-c", stub])
    supervisor.start(spec)
    args = supervisor._parser().parse_args(
        ["wait", "--state-dir", str(state_dir), "--name", "t", "--slice", "10", "--interval", "0.2"]
    )
    result = supervisor.wait(args)
    assert not result["alive"] and not result["ready"]
    assert result["cause"] == "trtllm_mla_unsupported_arch"
    assert "TllmGenFmhaRunner" in result["cause_summary"] and "sm_120" in result["cause_summary"]
    assert "sglang_server_attention_backend" in result["hint"] and "source: https://" in result["hint"]
    assert result["cause_line"] == line


# Fault-injection stub: a process outside the server's group that keeps a copy of its listening socket
# for a while after the server stopped (what a worker in a session of its own, or a kernel under load
# that has not yet closed the socket, looks like to the next start on the same port).
_LINGERING_SERVER = """
import os, socket, subprocess, sys, time, http.server, functools
port, linger = int(sys.argv[1]), float(sys.argv[2])
sock = socket.socket(); sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", port)); sock.listen()
os.set_inheritable(sock.fileno(), True)
subprocess.Popen([sys.executable, "-c", "import time,sys; time.sleep(float(sys.argv[1]))", str(linger)],
                 pass_fds=[sock.fileno()], start_new_session=True)
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[3])
server = http.server.HTTPServer(("127.0.0.1", port), handler, bind_and_activate=False)
server.socket.close(); server.socket = sock
server.serve_forever()
"""


def test_a_restart_waits_for_the_port_the_old_server_releases(state_dir, site):
    # Under load the old server's socket outlives its process for a moment; a restart on the same port
    # waits for it (bounded by stop_timeout) instead of failing with "already in use".
    port = _free_port()
    lingering = _spec(state_dir, site, port, argv=[PY, "-c", _LINGERING_SERVER, str(port), "2", str(site)])
    first = supervisor.start(lingering)
    assert _wait(state_dir, port)["ready"]
    restarted = supervisor.start(_spec(state_dir, site, port))
    assert restarted["action"] == "restarted" and not procs.alive(first["pid"])
    assert _wait(state_dir, port)["ready"]


def test_a_port_held_past_the_bound_fails_with_the_fix(state_dir, site):
    port = _free_port()
    lingering = _spec(
        state_dir, site, port, stop_timeout=1, argv=[PY, "-c", _LINGERING_SERVER, str(port), "6", str(site)]
    )
    supervisor.start(lingering)
    assert _wait(state_dir, port)["ready"]
    t0 = time.monotonic()
    with pytest.raises(supervisor.SupervisorError, match=f"port {port} on 127.0.0.1 is still in use"):
        supervisor.start(_spec(state_dir, site, port, stop_timeout=1))
    assert time.monotonic() - t0 < 20, "the wait for the port is bounded"


def test_a_change_that_cannot_be_applied_never_stops_the_working_server(state_dir, site):
    port = _free_port()
    first = supervisor.start(_spec(state_dir, site, port))
    assert _wait(state_dir, port)["ready"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        moved = _spec(state_dir, site, busy)
        with pytest.raises(supervisor.SupervisorError, match=f"port {busy} on 127.0.0.1 is already in use"):
            supervisor.start(moved)
        assert procs.alive(first["pid"]), "the old server still serves"
        assert supervisor.start(moved, check=True)["action"] == "restarted"  # check mode only reports
    missing = _spec(state_dir, site, port, argv=["/nonexistent/python", "-m", "http.server"])
    with pytest.raises(supervisor.SupervisorError, match="cannot run /nonexistent/python"):
        supervisor.start(missing)
    absent_cwd = _spec(state_dir, site, port, cwd=str(state_dir / "no-such-dir"))
    with pytest.raises(supervisor.SupervisorError, match="working directory"):
        supervisor.start(absent_cwd)
    assert procs.alive(first["pid"]) and supervisor.status(str(state_dir), "t")["pid"] == first["pid"]
    assert _wait(state_dir, port)["ready"]


def test_the_port_probe_tells_the_servers_own_port_from_a_strangers(state_dir, site, capsys):
    # The serve role accepts a busy port only when the server it converges is what listens there.
    port = _free_port()
    first = supervisor.start(_spec(state_dir, site, port))
    assert _wait(state_dir, port)["ready"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        stranger = holder.getsockname()[1]
        answers = {}
        for probe_port in (port, stranger):
            assert supervisor.main(
                ["port", "--host", "127.0.0.1", "--port", str(probe_port), "--owner-pid", str(first["pid"])]
            ) == 0
            answers[probe_port] = json.loads(capsys.readouterr().out)
    assert answers[port]["free"] is False and answers[port]["held_by_owner"] is True
    assert answers[stranger]["free"] is False and answers[stranger]["held_by_owner"] is False
