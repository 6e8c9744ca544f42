"""A spec-capture server on transformers: the `hf` capture backend of SpecForge's online training.

    python -m regen.training.capture_server --model DIR --layers 1,12,24 [--host 127.0.0.1] [--port 30100]
        [--dtype bfloat16] [--device auto] [--max-length N] [--no-trust-remote-code]

SpecForge 0.2.0's online (disaggregated) producer sends its prompts to capture servers and receives only
references: the server runs the target's prefill, writes the hidden states straight into Mooncake and
answers with keys, shapes and dtypes. SpecForge's own capture server is SGLang 0.5.14 with the
spec-capture patch of SpecForge's repository (`patches/sglang/v0.5.14/spec-capture.patch`), which needs
a GPU. This server speaks the same protocol, the one that patch defines and
`specforge.inference.adapters.server_capture.SGLangServerCaptureAdapter` reads:

* `POST /generate` with `input_ids` (a list of token lists, or one list), `sampling_params`
  (`max_new_tokens` 0: capture only, nothing is generated) and `spec_capture` (one dict per prompt:
  `store_id`, `sample_id`, `gen`, `replace`, `features` = {"aux": name, "last_hidden": name},
  `passthrough` = [{name, data, shape, dtype}]). For each prompt it runs the target once, puts the
  outputs of the `--layers` target layers concatenated (`[1, len, len(layers) * hidden]`, the feature
  SpecForge's DFlash reader calls `hidden_states`: layer `l`'s output is transformers'
  `hidden_states[l + 1]`) and every passthrough tensor into Mooncake, one hard-pinned object per tensor
  at `{store_id}/{sample_id}/g{gen}/{name}` (the patch's `SpecCaptureSink` layout, which SpecForge's
  `MooncakeFeatureStore` reads with `get_into`), and answers one row per prompt whose
  `meta_info.spec_capture` is `{sample_id, store_id, gen, aux_layer_ids, features: {name: {shape,
  dtype}}}`, or `{sample_id, error}` for a prompt whose write failed (SpecForge retries it).
* `GET /health`: 200 once the model is loaded and the Mooncake client is connected, and while the
  master and its metadata server answer (probed at most every 2 s); 503 with the reason otherwise.

Mooncake is reached through the variables the patched SGLang reads (`MOONCAKE_MASTER_SERVER_ADDR`,
`MOONCAKE_METADATA_SERVER`, `MOONCAKE_LOCAL_HOSTNAME`, `MOONCAKE_PROTOCOL`, `MOONCAKE_RDMA_DEVICES`,
`MOONCAKE_GLOBAL_SEGMENT_SIZE`, `MOONCAKE_LOCAL_BUFFER_SIZE`). The objects live in this process's
Mooncake segment (`MOONCAKE_GLOBAL_SEGMENT_SIZE` bytes): the server must keep running until the trainer
has consumed them, which is why the train stage stops it only after the run ends. Unlike the patched
SGLang, which connects on its first capture, this server connects at start, so an unreachable master is
an error at once (exit 3) instead of a failed prompt later.

Where it is the right backend: on CPU (SGLang's CPU backend needs Intel AMX and a source build of
sgl-kernel), and for a target that fits one GPU and that SGLang or the patch does not cover; it runs one
forward at a time, so a large target belongs on SGLang. It has no authentication: `--host` is loopback
or one address of this host (a wildcard, in any spelling, only with `--allow-any-address`;
regen.bind_address). Exit codes: 0 stopped by SIGTERM/SIGINT, 2 bad arguments (a refused address
included), 3 Mooncake unreachable, 4 the model does not load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

EXIT_BAD_ARGS = 2
EXIT_MOONCAKE = 3
EXIT_MODEL = 4

# FeatureSpec dtype names (SpecForge's MooncakeFeatureStore._TORCH_DTYPES, the patch's _DTYPE_STR).
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


class CaptureRequestError(ValueError):
    """A request the server refuses as a whole (HTTP 400), with what is wrong."""


# --------------------------------------------------------------------------------------------------
# The protocol, without torch or Mooncake (unit-tested directly)
# --------------------------------------------------------------------------------------------------


def object_key(store_id: str, sample_id: str, gen: int, name: str) -> str:
    """Where one tensor of one sample lives in Mooncake (the patch's `SpecCaptureSink._tkey`)."""
    return f"{store_id}/{sample_id}/g{gen}/{name}"


def parse_request(body: Any, max_length: int | None) -> list[dict[str, Any]]:
    """The prompts of one `/generate` body: [{input_ids, spec}], checked as the patched SGLang checks them.

    Raises CaptureRequestError for what SGLang would refuse as a whole request (no capture payload, a
    prompt longer than the context, a payload whose lengths do not match its prompt).
    """
    if not isinstance(body, dict):
        raise CaptureRequestError("the body must be a JSON object")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise CaptureRequestError("input_ids must be a non-empty list of token ids (or of such lists)")
    batch = ids if isinstance(ids[0], list) else [ids]
    specs = body.get("spec_capture")
    if isinstance(specs, dict):
        specs = [specs]
    if not isinstance(specs, list) or len(specs) != len(batch):
        raise CaptureRequestError(
            "spec_capture must hold one capture payload per prompt "
            f"({len(batch)} prompts, got {len(specs) if isinstance(specs, list) else type(specs).__name__}): "
            "this server only captures hidden states for SpecForge's online training"
        )
    sampling = body.get("sampling_params") or {}
    if int(sampling.get("max_new_tokens", 0) or 0) != 0:
        raise CaptureRequestError(
            "sampling_params.max_new_tokens must be 0: this server captures prefill hidden states and "
            "generates nothing"
        )
    prompts = []
    for number, (tokens, spec) in enumerate(zip(batch, specs, strict=True)):
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
            raise CaptureRequestError(f"prompt {number}: input_ids must be a non-empty list of integers")
        if max_length is not None and len(tokens) > max_length:
            raise CaptureRequestError(
                f"prompt {number} has {len(tokens)} tokens, more than this server's --max-length {max_length}"
            )
        if not isinstance(spec, dict) or not spec.get("store_id") or not spec.get("sample_id"):
            raise CaptureRequestError(f"prompt {number}: spec_capture needs store_id and sample_id")
        features = spec.get("features") or {}
        unknown = sorted(set(features) - {"aux", "last_hidden"})
        if unknown:
            raise CaptureRequestError(
                f"prompt {number}: unknown capture artifacts {unknown} (aux, last_hidden)"
            )
        for item in spec.get("passthrough") or []:
            shape = [int(d) for d in item.get("shape") or []]
            count = 1
            for dim in shape:
                count *= dim
            if str(item.get("dtype", "int64")) not in DTYPES:
                raise CaptureRequestError(
                    f"prompt {number}: passthrough {item.get('name')!r} has unsupported dtype "
                    f"{item.get('dtype')!r}"
                )
            if len(item.get("data") or []) != count:
                raise CaptureRequestError(
                    f"prompt {number}: passthrough {item.get('name')!r} has {len(item.get('data') or [])} "
                    f"values for shape {shape}"
                )
        prompts.append({"input_ids": tokens, "spec": spec})
    return prompts


def response_row(spec: dict[str, Any], prompt_tokens: int, result: dict[str, Any]) -> dict[str, Any]:
    """One `/generate` row as the patched SGLang answers a capture request (nothing generated)."""
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": str(spec.get("sample_id")),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 0},
            "spec_capture": result,
        },
    }


# --------------------------------------------------------------------------------------------------
# Mooncake
# --------------------------------------------------------------------------------------------------


def mooncake_settings(env: dict[str, str]) -> dict[str, Any]:
    """MooncakeDistributedStore.setup() arguments from the MOONCAKE_* variables the patched SGLang reads."""
    missing = [
        name for name in ("MOONCAKE_MASTER_SERVER_ADDR", "MOONCAKE_METADATA_SERVER") if not env.get(name)
    ]
    if missing:
        raise CaptureRequestError(
            f"{' and '.join(missing)} not set: start the Mooncake master first (role mooncake_master) and "
            "pass its endpoints in the environment"
        )
    return {
        "local_hostname": env.get("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"),
        "metadata_server": env["MOONCAKE_METADATA_SERVER"],
        "global_segment_size": int(env.get("MOONCAKE_GLOBAL_SEGMENT_SIZE", 1 << 30)),
        "local_buffer_size": int(env.get("MOONCAKE_LOCAL_BUFFER_SIZE", 64 << 20)),
        "protocol": env.get("MOONCAKE_PROTOCOL", "tcp"),
        "rdma_devices": env.get("MOONCAKE_RDMA_DEVICES", ""),
        "master_server_addr": env["MOONCAKE_MASTER_SERVER_ADDR"],
    }


def probe_mooncake(settings: dict[str, Any], wait_s: float) -> str | None:
    """None when the master's RPC port accepts and its metadata server answers HTTP within `wait_s` seconds,
    else what does not answer. Mooncake's own setup() retries an unreachable master for about 90 s before
    it gives up; this says so in a second."""
    import socket
    import urllib.error
    import urllib.request

    host, _, port = settings["master_server_addr"].rpartition(":")
    deadline = time.monotonic() + wait_s
    while True:
        problem = None
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                pass
        except (OSError, ValueError) as exc:
            problem = (
                f"the Mooncake master at {settings['master_server_addr']} does not accept connections ({exc})"
            )
        if problem is None:
            try:
                urllib.request.urlopen(settings["metadata_server"] + "?key=regen-capture-probe", timeout=2)
            except urllib.error.HTTPError:
                pass  # any HTTP answer (Mooncake's is 404 for an unknown key) means it is there
            except OSError as exc:
                problem = f"the metadata server at {settings['metadata_server']} does not answer ({exc})"
        if problem is None or time.monotonic() >= deadline:
            return problem
        time.sleep(0.5)


class MooncakeHealth:
    """`probe_mooncake` for /health: asked at most once per `interval` seconds (a poll loop must not turn
    into a probe storm on the master), answering the last result in between."""

    def __init__(self, settings: dict[str, Any], interval: float = 2.0) -> None:
        self.settings = settings
        self.interval = interval
        self.lock = threading.Lock()
        self.checked = float("-inf")
        self.problem: str | None = None

    def __call__(self) -> str | None:
        with self.lock:
            if time.monotonic() - self.checked >= self.interval:
                self.problem = probe_mooncake(self.settings, 0)
                self.checked = time.monotonic()
            return self.problem


class MooncakeSink:
    """Puts tensors into Mooncake as hard-pinned raw buffers (the patch's SpecCaptureSink contract)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.settings = settings
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(**settings)
        if rc is not None and int(rc) != 0:
            raise ConnectionError(
                f"Mooncake setup failed with status {rc} (master {settings['master_server_addr']}, metadata "
                f"{settings['metadata_server']}): is the master running and are both endpoints right?"
            )
        config = ReplicateConfig()
        config.replica_num = 1
        if hasattr(config, "with_hard_pin"):
            # SpecForge, not Mooncake's LRU, decides when a feature goes: a committed sample must survive
            # until the trainer acknowledges it.
            config.with_hard_pin = True
        self.config = config
        self.lock = threading.Lock()

    def remove(self, keys: list[str]) -> None:
        for key in keys:
            with contextlib.suppress(Exception):
                self.store.remove(key)

    def put(self, items: list[tuple[str, Any]]) -> None:
        """Write (key, contiguous CPU tensor) pairs; all of them or none (the written ones are removed)."""
        written: list[str] = []
        with self.lock:
            try:
                for key, tensor in items:
                    size = tensor.numel() * tensor.element_size()
                    registered = False
                    try:
                        self.store.register_buffer(tensor.data_ptr(), size)
                        registered = True
                    except Exception:
                        pass
                    try:
                        rc = self.store.put_from(key, tensor.data_ptr(), size, self.config)
                    finally:
                        if registered:
                            self.store.unregister_buffer(tensor.data_ptr())
                    if rc is not None and int(rc) < 0:
                        raise RuntimeError(f"Mooncake put_from({key}) failed with status {rc}")
                    written.append(key)
            except Exception:
                self.remove(written)
                raise


# --------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------


class CaptureService:
    """The model and the sink behind the HTTP handler; one forward at a time."""

    def __init__(self, backend: Any, sink: Any, layers: list[int], max_length: int | None) -> None:
        import torch

        self.torch = torch
        self.backend = backend
        self.sink = sink
        self.layers = list(layers)
        self.max_length = max_length
        self.forward_lock = threading.Lock()
        self.captured = 0

    def tensor(self, data: list[Any], shape: list[int], dtype: str):
        torch = self.torch
        return torch.tensor(data, dtype=getattr(torch, dtype)).reshape([int(d) for d in shape]).contiguous()

    def generate(self, body: Any) -> list[dict[str, Any]]:
        prompts = parse_request(body, self.max_length)
        if any((p["spec"].get("features") or {}).get("last_hidden") for p in prompts):
            raise CaptureRequestError(
                "the last_hidden artifact (post-norm final hidden state, EAGLE3's target) is not captured by "
                "this server: it serves the DFlash family (aux hidden states only)"
            )
        with self.forward_lock:
            features = self.backend.capture([p["input_ids"] for p in prompts])
        rows = []
        for prompt, aux in zip(prompts, features, strict=True):
            spec = prompt["spec"]
            store_id, sample_id = str(spec["store_id"]), str(spec["sample_id"])
            gen = int(spec.get("gen", 1))
            tensors: dict[str, Any] = {}
            aux_name = (spec.get("features") or {}).get("aux")
            if aux_name:
                tensors[aux_name] = aux.unsqueeze(0).contiguous()
            for item in spec.get("passthrough") or []:
                tensors[str(item["name"])] = self.tensor(
                    item["data"], item["shape"], str(item.get("dtype", "int64"))
                )
            keys = {name: object_key(store_id, sample_id, gen, name) for name in tensors}
            try:
                if spec.get("replace"):
                    self.sink.remove(list(keys.values()))
                self.sink.put([(keys[name], tensor) for name, tensor in tensors.items()])
            except Exception as exc:
                result = {"sample_id": sample_id, "error": f"{type(exc).__name__}: {exc}"}
            else:
                result = {
                    "sample_id": sample_id,
                    "store_id": store_id,
                    "gen": gen,
                    "aux_layer_ids": self.layers,
                    "features": {
                        name: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                        for name, t in tensors.items()
                    },
                }
                self.captured += 1
            rows.append(response_row(spec, len(prompt["input_ids"]), result))
        return rows


def make_handler(holder: dict[str, Any], log):
    """The HTTP handler; `holder["service"]` is None while the model loads (/health answers 503)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "regen-capture-server"

        def log_message(self, fmt: str, *args: Any) -> None:  # the access log stays quiet
            return

        def _send(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            service = holder.get("service")
            if self.path.split("?")[0] in ("/health", "/health_generate"):
                if service is None:
                    self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"status": "loading"})
                    return
                # Healthy means able to capture: the features go into Mooncake, so a master that died
                # after the start makes this server unhealthy, and preflight sees it.
                problem = holder["mooncake_health"]() if holder.get("mooncake_health") else None
                if problem:
                    self._send(
                        HTTPStatus.SERVICE_UNAVAILABLE,
                        {"status": "mooncake unreachable", "error": problem, "captured": service.captured},
                    )
                    return
                self._send(HTTPStatus.OK, {"status": "ok", "captured": service.captured})
                return
            if self.path.split("?")[0] == "/get_model_info" and service is not None:
                self._send(HTTPStatus.OK, {"backend": "regen-hf-capture", "aux_layer_ids": service.layers})
                return
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})

        def do_POST(self) -> None:
            if self.path.split("?")[0] != "/generate":
                self._send(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path}"})
                return
            service = holder.get("service")
            if service is None:
                self._send(
                    HTTPStatus.SERVICE_UNAVAILABLE, {"error": {"message": "the model is still loading"}}
                )
                return
            started = time.monotonic()
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                rows = service.generate(body)
            except (CaptureRequestError, json.JSONDecodeError) as exc:
                self._send(HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc)}})
                return
            except Exception as exc:
                log(f"capture failed: {type(exc).__name__}: {exc}")
                self._send(
                    HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
                )
                return
            tokens = sum(row["meta_info"]["prompt_tokens"] for row in rows)
            failed = sum(1 for row in rows if "error" in row["meta_info"]["spec_capture"])
            log(
                f"captured {len(rows) - failed}/{len(rows)} prompts ({tokens} tokens) in "
                f"{(time.monotonic() - started) * 1000:.0f} ms; {service.captured} in all"
            )
            # A batch (a list of token lists) gets a list of rows, one prompt a single row, as SGLang does.
            self._send(HTTPStatus.OK, rows if isinstance(body["input_ids"][0], list) else rows[0])

    return Handler


def _log(message: str) -> None:
    print(f"[capture-server] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m regen.training.capture_server", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", required=True, help="target model directory")
    parser.add_argument(
        "--layers", required=True, help="comma-separated target layer ids (the draft's target_layer_ids)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30100)
    parser.add_argument(
        "--allow-any-address",
        action="store_true",
        help="allow --host to be a wildcard (every interface); the server has no authentication",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--max-length", type=int, default=None, help="longest prompt accepted, in tokens")
    parser.add_argument("--no-trust-remote-code", action="store_true")
    parser.add_argument(
        "--mooncake-wait", type=float, default=30.0, help="seconds to wait for the Mooncake master to answer"
    )
    args = parser.parse_args(argv)
    try:
        layers = [int(x) for x in args.layers.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--layers must be comma-separated integers, got {args.layers!r}")
    if not layers:
        parser.error("--layers needs at least one target layer id")

    # The server has no authentication: loopback, or one address of this host the trainers reach it on
    # (behind a firewall rule), never every interface unless asked for (regen.bind_address).
    from regen.bind_address import BindAddressError, check

    try:
        check(
            args.host,
            service="the capture server",
            variable="--host (capture_server_host)",
            allow_variable="--allow-any-address (capture_server_allow_any_address)",
            allowed=args.allow_any_address,
        )
    except BindAddressError as exc:
        _log(str(exc))
        return EXIT_BAD_ARGS
    # Bind and serve first: a port in use is an error before minutes of model loading, and /health
    # answers "loading" (503) meanwhile.
    holder: dict[str, Any] = {"service": None}
    try:
        server = ThreadingHTTPServer((args.host, args.port), make_handler(holder, _log))
    except OSError as exc:
        _log(f"cannot listen on {args.host}:{args.port}: {exc}; stop what holds the port or choose another")
        return EXIT_BAD_ARGS
    server.daemon_threads = True
    stop = threading.Event()

    def on_signal(signum, _frame):
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    serving.start()
    try:
        return _run(args, layers, holder, stop)
    finally:
        server.shutdown()
        server.server_close()


def _run(args: argparse.Namespace, layers: list[int], holder: dict[str, Any], stop: threading.Event) -> int:
    try:
        settings = mooncake_settings(dict(os.environ))
    except CaptureRequestError as exc:
        _log(str(exc))
        return EXIT_BAD_ARGS
    problem = probe_mooncake(settings, args.mooncake_wait)
    if problem:
        _log(f"cannot connect to Mooncake: {problem}; start the master first (role mooncake_master)")
        return EXIT_MOONCAKE
    try:
        sink = MooncakeSink(settings)
    except ImportError as exc:
        _log(f"the Mooncake client does not import ({exc}): this python needs mooncake-transfer-engine")
        return EXIT_MOONCAKE
    except Exception as exc:
        _log(f"cannot connect to Mooncake: {exc}")
        return EXIT_MOONCAKE
    _log(
        f"Mooncake client connected (master {settings['master_server_addr']}, segment "
        f"{settings['global_segment_size']} B over {settings['protocol']})"
    )
    try:
        from regen.training.capture import HFBackend

        backend = HFBackend(args.model, layers, args.dtype, args.device, not args.no_trust_remote_code)
    except Exception as exc:
        _log(f"the model at {args.model} does not load: {type(exc).__name__}: {exc}")
        return EXIT_MODEL
    service = CaptureService(backend, sink, layers, args.max_length)
    holder["mooncake_health"] = MooncakeHealth(settings)
    holder["service"] = service
    _log(
        f"ready on http://{args.host}:{args.port}: {args.model} on {backend.device}, layers {layers}, "
        f"{args.dtype}"
    )
    while not stop.wait(0.5):
        pass
    _log(f"stopping after {service.captured} captures")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
