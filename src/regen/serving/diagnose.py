"""Read a model server's log: where loading has got to, and why it died when it did.

Pure functions over log text (standard library only), shared by the process supervisor and the
systemd path, so both report the same stage names and the same likely causes. The patterns are the
log lines SGLang 0.5.23 and `transformers serve` really print (see the comments); a line nobody
foresaw falls back to the last exception line of the log.
"""

from __future__ import annotations

import re

from regen.serving.cause import Cause
from regen.serving.known_failures import match_log

# (stage, regex): the last match in the log wins, so order only matters within one line.
_STAGES: list[tuple[str, re.Pattern[str]]] = [
    ("starting", re.compile(r"server_args=|Starting (?:the )?server|sglang\.launch_server")),
    (
        "initializing distributed",
        re.compile(r"Init torch distributed begin|init_distributed|NCCL INFO Bootstrap"),
    ),
    ("loading weights", re.compile(r"Load weight begin")),
    # tqdm bars: SGLang's model_loader/weight_utils.py "Loading safetensors checkpoint shards:  45%
    # Completed | 29/64 [...]", transformers' "Loading weights: 100%|...| 63/63 [...]".
    ("loading shards", re.compile(r"Loading (?:safetensors )?checkpoint shards:.*?(\d+)/(\d+)")),
    ("loading shards", re.compile(r"Loading weights:.*?(\d+)/(\d+)")),
    ("weights loaded", re.compile(r"Load weight end")),
    ("allocating KV cache", re.compile(r"KV Cache is allocated|Memory pool end")),
    ("capturing CUDA graphs", re.compile(r"Capture \w+ (?:CUDA|cuda) graph begin|Capturing batches")),
    ("CUDA graphs captured", re.compile(r"Capture \w+ (?:CUDA|cuda) graph end")),
    ("HTTP server up", re.compile(r"Uvicorn running on|Application startup complete")),
    ("warming up", re.compile(r"Start of (?:co-locate )?warmup|warmup request")),
    ("ready", re.compile(r"The server is fired up and ready to roll")),
]


# (kind, regex, summary, hint). The first pattern that matches anywhere in the tail wins, so specific
# causes come before generic ones (an OOM traceback also contains "Traceback").
_CAUSES: list[tuple[str, re.Pattern[str], str, str]] = [
    (
        "gpu_oom",
        re.compile(
            r"CUDA out of memory|torch\.OutOfMemoryError|OutOfMemoryError: CUDA|"
            r"Not enough memory\. Please try to increase --mem-fraction-static|"
            r"out of memory.*(?:cuda|GPU)",
            re.I,
        ),
        "the GPUs ran out of memory",
        "lower sglang_server_mem_fraction_static or sglang_server_context_length, or spread the model "
        "over more GPUs (tp_size/ep_size, nnodes)",
    ),
    (
        "host_oom",
        re.compile(
            r"Cannot allocate memory|MemoryError|oom-kill|Out of memory: Killed process|"
            r"A process in the process pool was terminated abruptly",
            re.I,
        ),
        "the host ran out of RAM",
        "free host memory (other jobs, page cache pinned by tmpfs) or load with fewer loader workers",
    ),
    (
        "port_in_use",
        re.compile(r"Address already in use|Errno 98|address is already in use|bind\(\) failed", re.I),
        "the port is already in use",
        "stop whatever listens there (`ss -ltnp`) or set sglang_server_port to a free port",
    ),
    (
        "missing_module",
        re.compile(r"(?:ModuleNotFoundError|ImportError): (?:No module named '?([\w.]+)'?|.*)"),
        "a Python module is missing from the serving venv",
        "install it into the serving venv (regen_serving_python), e.g. re-run the provision stage",
    ),
    (
        "model_path",
        re.compile(
            r"(?:No such file or directory|does not appear to have a file named|"
            r"is not a local folder and is not a valid model identifier|HFValidationError|"
            r"Repository Not Found|Can't load the configuration of|Incorrect path_or_model_id)"
        ),
        "the model path is missing or incomplete",
        "check sglang_server_model_path (regen_model_path): it must hold config.json, the tokenizer "
        "and the weights",
    ),
    (
        "trust_remote_code",
        re.compile(
            r"requires you to execute the (?:configuration|modeling|tokenizer) file|"
            r"trust_remote_code=True",
            re.I,
        ),
        "the model ships its own code but remote code is not trusted",
        "set sglang_server_trust_remote_code: true",
    ),
    (
        "bad_argument",
        re.compile(
            r"error: (?:unrecognized arguments|argument [-\w/]+: invalid choice|"
            r"argument [-\w/]+: expected|the following arguments are required)|No such option"
        ),
        "the server rejected a command-line flag",
        "the flag is not in this server version; fix sglang_server_extra_args or pin the version the "
        "role was tested with",
    ),
    (
        "no_gpu",
        re.compile(
            r"no CUDA GPUs are available|Found no NVIDIA driver|CUDA driver version is insufficient|"
            r"NVIDIA-SMI has failed|cudaErrorNoDevice|CUDA_ERROR_NO_DEVICE",
            re.I,
        ),
        "no usable GPU (driver missing, too old, or the GPUs are hidden)",
        "check nvidia-smi on the host, the driver/CUDA versions and CUDA_VISIBLE_DEVICES",
    ),
    (
        "nccl",
        re.compile(r"NCCL error|ncclSystemError|ncclUnhandledCudaError|ncclInternalError|NCCL WARN", re.I),
        "NCCL (GPU-to-GPU communication) failed",
        "on PCIe-only cards try NCCL_P2P_DISABLE=1 or NCCL_P2P_LEVEL=SYS in sglang_server_environment; "
        "across nodes check NCCL_SOCKET_IFNAME and the dist-init address",
    ),
    (
        "config_rejected",
        re.compile(
            r"AssertionError: .*(?:tp_size|ep_size|dp_size|attn_dp|divisible)|"
            r"ValueError: .*(?:--[a-z-]+|not supported)"
        ),
        "the server rejected the parallelism or model settings",
        "read the assertion above and adjust the plan (sglang_server_tp_size/ep_size/attn_dp_size)",
    ),
    (
        "killed",
        re.compile(r"\bKilled\b|signal 9|SIGKILL"),
        "the server was killed (often the kernel's OOM killer)",
        "check `dmesg` for the OOM killer and free host memory",
    ),
]

_EXCEPTION_LINE = re.compile(r"^\s*(?:[\w.]+(?:Error|Exception|Exit)|AssertionError|KeyboardInterrupt)\b.*")


def stage_of(text: str) -> tuple[str | None, str]:
    """The furthest loading stage the log shows, with a detail (e.g. the shard count)."""
    stage, detail = None, ""
    for line in _lines(text):
        for name, pattern in _STAGES:
            match = pattern.search(line)
            if match:
                stage = name
                detail = f"{match.group(1)}/{match.group(2)}" if name == "loading shards" else ""
    return stage, detail


def diagnose(text: str) -> Cause | None:
    """The likely cause of a failure from the last part of a log; None when nothing looks wrong.

    Failures public reports have already explained (regen.serving.known_failures: the TRT-LLM MLA
    kernels refusing sm_120, a ptxas too old for the GPU, ...) come first: they name the fix and its
    source, where the generic causes below would only say "the server raised an exception".
    """
    known = match_log("\n".join(_lines(text)))
    if known is not None:
        return known
    lines = _lines(text)
    for kind, pattern, summary, hint in _CAUSES:
        for line in reversed(lines):
            if pattern.search(line):
                if kind == "missing_module":
                    match = re.search(r"No module named '?([\w.]+)'?", line)
                    if match:
                        summary = f"Python module {match.group(1)!r} is missing from the serving venv"
                return Cause(kind, summary, hint, line.strip()[:300])
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return Cause(
                "exception", "the server raised an exception", "read the log lines above", line.strip()[:300]
            )
    return None


def tail(text: str, lines: int = 40) -> list[str]:
    """The last `lines` non-empty lines, with tqdm's carriage-return redraws collapsed."""
    return [line for line in _lines(text) if line.strip()][-lines:]


def _lines(text: str) -> list[str]:
    """Log lines, where a tqdm bar redrawn with carriage returns counts as its last redraw only."""
    out = []
    for raw in text.split("\n"):
        parts = [p for p in raw.split("\r") if p.strip()]
        out.append(parts[-1].rstrip() if parts else "")
    return out
