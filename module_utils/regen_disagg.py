"""The online (disaggregated) training stack around SpecForge 0.2.0: attempts, endpoints, capture servers.

Standard library only, pure functions (the drafter planning module calls them on the training host; the
unit tests call them directly). What follows SpecForge 0.2.0 exactly:

- **Attempts.** SpecForge's online producer claims its control path once (`refs.jsonl.producer_claim`,
  `training/disaggregated.py::_claim_fresh_control_path`) and refuses a path with artifacts of an earlier
  attempt; the consumer refuses a SQLite ledger that exists unless it resumes
  (`launch_plan._validate_consumer_database`). Resuming is consumer-only and needs the producer and its
  Mooncake objects still alive (`launch.build_disagg_online_consumer`: "this does not restart a
  producer"); SpecForge's own supervisor stops the producer when the consumer dies. So every launch after
  a run that ended without success is a new attempt, with its own control and consumer-state
  directories under `<run dir>/online/attempt-<n>/`.
- **Capture servers.** SGLang 0.5.14 with the spec-capture patch, launched with the flags SpecForge's
  managed-local stack uses (`launch_plan._managed_local_services`): `--skip-tokenizer-init
  --chunked-prefill-size -1 --enable-spec-capture --spec-capture-method dflash
  --spec-capture-aux-layer-ids <the draft's target layers>` and a context of `max_length + 7`
  (`SGLANG_CAPTURE_CONTEXT_HEADROOM`); or, without SGLang (the CPU demo), regen's transformers server
  speaking the same protocol (`regen.training.capture_server`). Either reaches Mooncake through the
  `MOONCAKE_*` variables and owns the features in its own segment (`MOONCAKE_GLOBAL_SEGMENT_SIZE`); the
  producer and the consumer run with zero-sized segments.
- **Flow control.** The producer stops leasing prompts while the features in flight reach
  `runtime.resident_high_watermark_bytes` and resumes under the low watermark; a lease can add
  `producer_lease` samples per capture server beyond it. The watermarks are set so that the capture
  servers' segments never overflow.
"""

from __future__ import annotations

import re

# SpecForge's SGLang capture request headroom (config/schema.py SGLANG_CAPTURE_CONTEXT_HEADROOM).
CAPTURE_CONTEXT_HEADROOM = 7
# input_ids and loss_mask travel with every sample as int64 passthrough tensors.
PASSTHROUGH_BYTES_PER_TOKEN = 16
# SpecForge's defaults (config/schema.py RuntimeConfig): prompts per lease and per-worker concurrency.
PRODUCER_LEASE = 8
# Share of the capture segments the features in flight may fill before the producer pauses.
SEGMENT_FILL = 0.9
ATTEMPT_DIR = re.compile(r"^attempt-(\d+)$")
# A launch in these states is still the current attempt's (a final state other than success is not).
LIVE_STATES = ("starting", "running")


class DisaggPlanError(ValueError):
    """Inputs that cannot be planned; the message says which and how to fix it."""


def attempt_numbers(names):
    """The attempt numbers among directory names (`attempt-<n>`), sorted."""
    found = []
    for name in names:
        match = ATTEMPT_DIR.match(name)
        if match:
            found.append(int(match.group(1)))
    return sorted(found)


def choose_attempt(existing, last_used, state, alive):
    """(attempt number, reason) for this launch.

    `existing`: attempt numbers on disk; `last_used`: whether the latest one was claimed by a producer;
    `state`: the run's status (None when it never launched); `alive`: whether its supervisor still runs.
    """
    if not existing:
        return 1, "first attempt"
    last = max(existing)
    if not last_used:
        return last, f"attempt {last} was prepared but never launched"
    if state == "succeeded":
        return last, f"attempt {last} succeeded"
    if state in LIVE_STATES and alive:
        return last, f"attempt {last} is still running"
    return last + 1, (
        f"attempt {last} ended {state or 'without a status'}: SpecForge 0.2.0 resumes an online consumer "
        "only while its producer and Mooncake objects live, so a new attempt starts with fresh control "
        "and consumer-state directories"
    )


def attempt_paths(run_dir, attempt):
    base = f"{run_dir}/online/attempt-{int(attempt)}"
    return {
        "attempt": int(attempt),
        "dir": base,
        "control_dir": base + "/control",
        "consumer_state_dir": base + "/consumer-state",
        "claim": base + "/control/refs.jsonl.producer_claim",
    }


def _url_host(address):
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def mooncake_endpoints(address, rpc_port, metadata_port, protocol="tcp", local_hostname=None):
    """What SpecForge's deployment.disaggregated.mooncake_* fields and the capture servers' MOONCAKE_*
    variables name: the master's RPC address and the HTTP metadata server (the mooncake_master role's)."""
    if not address:
        raise DisaggPlanError("the Mooncake master needs an address (drafter_training_online_bind_address)")
    return {
        "master_server_addr": f"{_url_host(address)}:{int(rpc_port)}",
        "metadata_server": f"http://{_url_host(address)}:{int(metadata_port)}/metadata",
        "local_hostname": local_hostname or address,
        "protocol": protocol,
    }


def capture_urls(capture_servers, addresses, port):
    """One URL per planned capture server: `http://<address of its host>:<port>`."""
    urls = []
    for server in capture_servers:
        host = server["host"]
        address = addresses.get(host)
        if not address:
            raise DisaggPlanError(
                f"no address for capture host {host}: set ansible_host for it (or "
                "drafter_training_online_server_urls)"
            )
        urls.append(f"http://{_url_host(address)}:{int(port)}")
    return urls


def check_reachable(train_hosts, capture_hosts, bind_address):
    """A loopback bind address serves only one host: refuse it when the stack spans several."""
    hosts = sorted(set(train_hosts) | set(capture_hosts))
    loopback = bind_address.startswith("127.") or bind_address in ("::1", "localhost")
    if loopback and len(hosts) > 1:
        raise DisaggPlanError(
            f"the online stack spans {hosts} but drafter_training_online_bind_address is {bind_address}, "
            "which no other host reaches: set it to an address of the training host's private network"
        )


def capture_environment(endpoints, segment_bytes, local_buffer_bytes, local_hostname):
    """The MOONCAKE_* variables a capture server reads (the patch's SpecCaptureSink and regen's server).

    `local_hostname` is the capture host's own address: its segment holds the features, and the trainer's
    transfer engine connects there to read them (the master's address is the training host's)."""
    return {
        "MOONCAKE_MASTER_SERVER_ADDR": endpoints["master_server_addr"],
        "MOONCAKE_METADATA_SERVER": endpoints["metadata_server"],
        "MOONCAKE_LOCAL_HOSTNAME": local_hostname,
        "MOONCAKE_PROTOCOL": endpoints["protocol"],
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(int(segment_bytes)),
        "MOONCAKE_LOCAL_BUFFER_SIZE": str(int(local_buffer_bytes)),
    }


def transfer_environment(ports):
    """MC_MIN_RPC_PORT / MC_MAX_RPC_PORT for every Mooncake client of the run, from [first, last].

    Mooncake's transfer engine picks its handshake RPC and TCP data ports from that range and (0.3.13)
    listens on every interface, without authentication, whatever MOONCAKE_LOCAL_HOSTNAME says. Naming the
    range is what lets a firewall rule cover those listeners."""
    try:
        first, last = (int(port) for port in ports)
    except (TypeError, ValueError):
        raise DisaggPlanError(
            f"drafter_training_online_mooncake_transfer_ports is {ports!r}: give [first, last], two ports"
        ) from None
    if not 1024 <= first <= last <= 65535:
        raise DisaggPlanError(
            f"drafter_training_online_mooncake_transfer_ports is {ports!r}: the range must lie within "
            "1024-65535, first <= last"
        )
    return {"MC_MIN_RPC_PORT": str(first), "MC_MAX_RPC_PORT": str(last)}


def sglang_capture_args(layers, max_length, method="dflash"):
    """The flags that make the patched SGLang 0.5.14 a capture server (SpecForge's managed-local line)."""
    if not layers:
        raise DisaggPlanError("the capture server needs the draft's target layer ids")
    return [
        "--skip-tokenizer-init",
        "--chunked-prefill-size",
        "-1",
        "--disable-radix-cache",
        "--enable-spec-capture",
        "--spec-capture-method",
        method,
        "--spec-capture-aux-layer-ids",
        *[str(int(layer)) for layer in layers],
    ]


def capture_context_length(max_length):
    """SGLang rejects input_len >= context_len - 6: a prompt of max_length tokens needs max_length + 7."""
    return int(max_length) + CAPTURE_CONTEXT_HEADROOM


def sample_bytes(max_length, hidden_bytes_per_token):
    """The largest sample's features in Mooncake: hidden states plus the int64 ids and loss mask."""
    return int(max_length) * (int(hidden_bytes_per_token) + PASSTHROUGH_BYTES_PER_TOKEN)


def runtime_watermarks(segment_bytes, servers, max_length, hidden_bytes_per_token, quantum):
    """SpecForge's `runtime` section: byte watermarks that keep the capture segments from overflowing.

    Returns (runtime dict, arithmetic line). Raises DisaggPlanError when the segments cannot hold one
    optimizer step's samples plus the leases in flight.
    """
    servers = max(1, int(servers))
    per_sample = sample_bytes(max_length, hidden_bytes_per_token)
    total = int(segment_bytes) * servers
    lease = PRODUCER_LEASE * servers * per_sample
    high = int(total * SEGMENT_FILL) - lease
    step = int(quantum) * per_sample
    arithmetic = (
        f"capture segments {servers} x {int(segment_bytes)} B; a sample is at most {int(max_length)} "
        f"tokens x ({int(hidden_bytes_per_token)} + {PASSTHROUGH_BYTES_PER_TOKEN}) B = {per_sample} B; "
        f"pause at {SEGMENT_FILL:.0%} of the segments less a lease of {PRODUCER_LEASE} samples per server "
        f"= {high} B"
    )
    if high < max(step, per_sample):
        raise DisaggPlanError(
            f"the capture servers' Mooncake segments cannot hold one optimizer step: {arithmetic}, but one "
            f"step needs {quantum} samples ({step} B); raise drafter_training_online_segment_bytes or "
            "shorten the length budget"
        )
    return {
        "producer_lease": PRODUCER_LEASE,
        "resident_high_watermark_bytes": high,
        "resident_low_watermark_bytes": high * 3 // 4,
    }, arithmetic


def online_total_steps(samples, epochs, dp_size, batch_size, accumulation_steps, max_steps=None):
    """Optimizer steps of an online run (SpecForge's schedule.resolve_online_total_steps): only complete
    global optimizer windows are dispatched."""
    if max_steps:
        return int(max_steps)
    quantum = max(1, int(dp_size)) * max(1, int(batch_size)) * max(1, int(accumulation_steps))
    steps = int(samples) * max(1, int(epochs)) // quantum
    if steps < 1:
        raise DisaggPlanError(
            f"the data makes no online optimizer step: {samples} prompts x {epochs} epochs over a window of "
            f"{quantum} ({dp_size} trainer ranks x batch {batch_size} x accumulation {accumulation_steps})"
        )
    return steps
