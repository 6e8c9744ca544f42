"""The fault campaign: the local pipeline's jobs under one injected fault per round, checked after each.

    python bench/bench_fault_campaign.py [--rounds 60] [--seed 0] [--output DIR]

Each round adds a few prompts to the source set (so every stage has work), then runs the pipeline's jobs
as the roles run them (`python -m regen.jobs.prompts`, `... generate` against the real demo model served
by `transformers serve` on loopback, `... tokenize`) and injects one fault at a random point:

  sigkill, sigterm   the signal to the job of a random stage, after a random share of its usual run time
  server_killed      SIGKILL to the model server while generation runs; it is started again at once
  disk_full          the pipeline's disk (a small tmpfs of its own) filled to a few KiB while a stage runs
  endpoint_errors    HTTP 500/503/429/400 for a while, from the STUB fault proxy between job and server
                     (`tests.helpers.fault_proxy`)
  endpoint_hang      the proxy holds every request for a while (the job's request timeout is short)
  prompt_edited      prompts edited in the source between two runs (same ids, other text)
  prompt_removed     prompts removed from the source between two runs

The stage under fault must either finish (exit 0, status `done`, complete output) or fail with a message
that names the fault (the exit code, status.json's state and error, or errors.jsonl's reasons); a stage that
reports success in its exit code or its status file while its output is incomplete is a *silent pass*.
Then the pipeline resumes (every stage again, as a re-run of the playbook would: a stage whose dry run says
it is complete is skipped, as the roles do), and every round ends with the checks, against the source set
as it is now:

  lost        a prompt without its completion or sample; a record that left the completions without a line in
              superseded.jsonl
  duplicated  an id twice in the prompts, completions, samples or conversations; a record twice in
              superseded.jsonl
  stale       a completion of an edited or removed prompt, or made with other settings; a sample or a
              SpecForge conversation that does not match the current completion
  torn        a line that is not whole JSON in any JSONL file the pipeline keeps, or an unreadable shard
  leftovers   temporary files left after a successful resume

The report (`report.json`, `report.md`) has one row per round and a table of faults by kind and outcome.
Seeded: the schedule, the fault points and the prompt edits follow `seed` (what the jobs do at those points
depends on the machine's speed, so two runs can differ in outcome, never in what is checked).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from regen.jobs._common import DirectoryLock

FAULT_KINDS = (
    "sigkill",
    "sigterm",
    "server_killed",
    "disk_full",
    "endpoint_errors",
    "endpoint_hang",
    "prompt_edited",
    "prompt_removed",
)
STAGES = ("prompts", "generate", "tokenize")
# The stages a fault can hit: signals and a full disk any; the server and the endpoint only generation.
TARGETS = {
    "sigkill": STAGES,
    "sigterm": STAGES,
    "disk_full": STAGES,
    "server_killed": ("generate",),
    "endpoint_errors": ("generate",),
    "endpoint_hang": ("generate",),
    "prompt_edited": ("generate",),
    "prompt_removed": ("generate",),
}
OUTCOMES = ("finished", "failed_named", "failed_unnamed", "silent_pass", "skipped")
CHECKS = ("lost", "duplicated", "stale", "torn", "leftovers")
# Usual run times before any was measured (seconds); then the mean of this campaign's clean runs.
_FIRST_GUESS = {"prompts": 0.4, "generate": 2.5, "tokenize": 4.0}
_TOPICS = (
    "a lighthouse",
    "prime numbers",
    "sourdough bread",
    "the Rhine",
    "binary search",
    "a violin",
    "glaciers",
    "the number seven",
    "tea ceremonies",
    "a red fox",
    "compilers",
    "Saturn's rings",
)
_ASKS = ("Describe", "Explain", "Write two lines about", "Give one fact about", "Summarize")


@dataclasses.dataclass
class CampaignConfig:
    workdir: Path
    model_dir: Path
    rounds: int = 10
    seed: int = 0
    kinds: tuple[str, ...] = FAULT_KINDS
    initial_prompts: int = 6
    new_prompts_per_round: int = 2
    max_tokens: int = 3
    disk_bytes: int = 32 << 20
    python: str = sys.executable
    server_start_budget_s: float = 300.0
    stage_timeout_s: float = 300.0
    stop_on_problem: bool = False  # stop after the first round with a finding (its disk is kept)
    mount_disk: bool = True  # False: a plain directory (the disk_full rounds are skipped)
    log: Callable[[str], None] = print


@dataclasses.dataclass
class StageRun:
    stage: str
    rc: int | None
    seconds: float
    stderr: str
    stdout: str
    status: dict[str, Any] | None  # this run's status.json (None: none, or one an earlier run left)
    stale_status: bool = False  # status.json held an earlier run's document
    fault_at_s: float | None = None  # when the fault hit, from the job's start
    fault_hit: bool = False  # the job was still running when the fault hit
    trigger: str = ""  # what set the fault off: "time S" or "progress K"

    def brief(self) -> str:
        state = (self.status or {}).get("state")
        return f"{self.stage} rc={self.rc} state={state} {self.seconds:.1f}s"


@dataclasses.dataclass
class RoundResult:
    round: int
    kind: str
    stage: str
    outcome: str
    detail: str
    fault_at_s: float | None
    fault_hit: bool
    trigger: str
    rc: int | None
    state: str | None
    resumed: bool
    resume_detail: str
    checks: dict[str, int]
    problems: list[str]
    seconds: float
    prompts: int
    completions: int
    samples: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ==================================================================================================
# Pieces: the model server, the disk
# ==================================================================================================


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DemoServer:
    """`transformers serve` with the demo model on loopback (the serve role's CPU profile, by hand)."""

    def __init__(self, model_dir: Path, log_path: Path, python: str = sys.executable):
        self.model_dir = model_dir
        self.log_path = log_path
        self.port = free_port()
        self.binary = Path(python).parent / "transformers"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
        argv = [str(self.binary), "serve", str(self.model_dir), "--trust-remote-code", "--device", "cpu"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log_path, "a") as sink:
            self.proc = subprocess.Popen(
                argv, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.starts += 1

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self, budget: float) -> None:
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"transformers serve exited with {self.proc.returncode}: "
                    f"{self.log_path.read_text(errors='replace')[-3000:]}"
                )
            if self.healthy():
                return
            time.sleep(0.2)
        raise RuntimeError(f"transformers serve was not healthy after {budget:.0f}s (log: {self.log_path})")

    def warm_up(self, max_tokens: int) -> None:
        """One answer: the first request loads the model; measured runs should not pay for that."""
        body = {
            "model": str(self.model_dir),
            "messages": [{"role": "user", "content": "warm up"}],
            "max_tokens": max_tokens,
            "chat_template_kwargs": {"thinking": False},
        }
        request = urllib.request.Request(
            f"{self.url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()


class Disk:
    """The pipeline's disk: a tmpfs of its own (root only) that a round can fill; a plain directory when
    mounting is not permitted (then the disk_full rounds are skipped, with the reason)."""

    def __init__(self, point: Path, size: int, mount: bool = True):
        self.point = point
        self.size = size
        self.mounted = False
        self.reason = ""
        point.mkdir(parents=True, exist_ok=True)
        if os.path.ismount(point):
            # a second mount would hide the first campaign's disk from its own running jobs
            raise RuntimeError(f"{point} is already a mount point: another campaign uses this work directory")
        if not mount:
            self.reason = "the campaign was asked not to mount a tmpfs"
        elif os.geteuid() != 0:
            self.reason = f"mounting a tmpfs needs root (running as uid {os.geteuid()})"
        elif shutil.which("mount") is None:
            self.reason = "no mount command on this host to mount a tmpfs"
        else:
            r = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "regen-fault-campaign", str(point)],
                capture_output=True,
                text=True,
            )
            if r.returncode == 0:
                self.mounted = True
            else:
                self.reason = f"mounting a tmpfs is not permitted here: {(r.stderr or r.stdout).strip()}"
        self.filler = point / ".filler"

    def free_bytes(self) -> int:
        st = os.statvfs(self.point)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int) -> int:
        """Fill the disk until `leave` bytes are free (rounded to pages); returns the bytes left free."""
        want = max(0, self.free_bytes() - leave)
        block = b"\0" * (1 << 20)
        try:
            with open(self.filler, "ab") as fh:
                while want > 0:
                    fh.write(block[: min(len(block), want)])
                    fh.flush()
                    want -= min(len(block), want)
        except OSError:
            pass  # already full: that is the point
        return self.free_bytes()

    def empty(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.point)], check=False)
            self.mounted = False


# ==================================================================================================
# The source prompt set (what a user edits between runs)
# ==================================================================================================


class Source:
    def __init__(self, path: Path, rng: random.Random):
        self.path = path
        self.rng = rng
        self.rows: dict[str, dict[str, Any]] = {}
        self._next = 0

    def _new_row(self) -> dict[str, Any]:
        n = self._next
        self._next += 1
        topic = _TOPICS[n % len(_TOPICS)]
        ask = _ASKS[(n // len(_TOPICS)) % len(_ASKS)]
        conv = [{"role": "user", "content": f"{ask} {topic} (prompt {n})."}]
        if n % 4 == 3:
            conv.insert(0, {"role": "system", "content": "Answer briefly."})
        if n % 7 == 5:  # a second user turn: two answers to regenerate, the first one feeds the second
            conv += [
                {"role": "assistant", "content": "An old answer, regenerated."},
                {"role": "user", "content": f"And one more word on {topic}?"},
            ]
        return {"id": f"c{n:04d}", "conversations": conv}

    def add(self, count: int) -> list[str]:
        added = []
        for _ in range(count):
            row = self._new_row()
            self.rows[row["id"]] = row
            added.append(row["id"])
        return added

    def edit(self, count: int, tag: str, prefer: set[str]) -> list[str]:
        pool = sorted(prefer & set(self.rows)) or sorted(self.rows)
        chosen = self.rng.sample(pool, min(count, len(pool)))
        for rid in chosen:
            conv = self.rows[rid]["conversations"]
            last_user = max(i for i, t in enumerate(conv) if t["role"] == "user")
            conv[last_user] = {"role": "user", "content": f"{conv[last_user]['content']} (edited {tag})"}
        return chosen

    def remove(self, count: int, prefer: set[str]) -> list[str]:
        pool = sorted(prefer & set(self.rows)) or sorted(self.rows)
        chosen = self.rng.sample(pool, min(count, max(0, len(self.rows) - 2), len(pool)))
        for rid in chosen:
            del self.rows[rid]
        return chosen

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows.values()))
        os.replace(tmp, self.path)


# ==================================================================================================
# Reading what the pipeline wrote
# ==================================================================================================


def _jsonl_lines(path: Path) -> tuple[list[Any], int]:
    """The parsed lines of a JSONL file and how many lines are not whole JSON (a torn last line too)."""
    data = path.read_bytes()
    if not data:
        return [], 0
    lines = data.split(b"\n")
    torn = 0
    if lines[-1] != b"":
        torn += 1  # a last line without its newline
        lines = lines[:-1]
    else:
        lines = lines[:-1]
    parsed = []
    for raw in lines:
        if not raw.strip():
            continue
        try:
            parsed.append(json.loads(raw))
        except ValueError:
            torn += 1
    return parsed, torn


def _user_side(conv: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(t.get("role"), t.get("content")) for t in conv if t.get("role") in ("system", "user")]


def _assistant_side(conv: list[dict[str, Any]]) -> list[str]:
    return [t.get("content") for t in conv if t.get("role") == "assistant"]


def read_status(path: Path) -> tuple[dict[str, Any] | None, bool]:
    """(document, torn): a status file is replaced atomically, so a torn one is a finding."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, False
    try:
        doc = json.loads(text)
    except ValueError:
        return None, True
    return (doc if isinstance(doc, dict) else None), not isinstance(doc, dict)


# ==================================================================================================
# The campaign
# ==================================================================================================


class Campaign:
    def __init__(self, config: CampaignConfig):
        self.c = config
        self.rng = random.Random(config.seed)
        root = config.workdir
        root.mkdir(parents=True, exist_ok=True)
        # one campaign per work directory (the kernel drops the lock with the process)
        self._lock = DirectoryLock(root, "fault campaign", ".campaign.lock").acquire()
        self.logs = root / "logs"
        self.logs.mkdir(exist_ok=True)
        self.disk = Disk(root / "disk", config.disk_bytes, config.mount_disk)
        self.prompts_dir = self.disk.point / "prompts"
        self.completions_dir = self.disk.point / "completions"
        self.tokenized_dir = self.disk.point / "tokenized"
        self.source = Source(root / "source.jsonl", random.Random(config.seed + 1))
        self.server = DemoServer(config.model_dir, self.logs / "server.log", config.python)
        self.proxy = None
        self.durations: dict[str, list[float]] = {s: [] for s in STAGES}
        # every completion line the checks ever saw (by its bytes): each must stay or be moved aside
        self.seen_records: dict[bytes, str] = {}
        self.results: list[RoundResult] = []
        self.started = time.monotonic()
        self.setup_seconds = 0.0
        self._restart: threading.Thread | None = None
        self._progress_base = 0
        self._runs = 0
        self._job: subprocess.Popen | None = None

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Campaign:
        from tests.helpers.fault_proxy import FaultProxy

        t0 = time.monotonic()
        try:
            self.server.start()
            self.server.wait_ready(self.c.server_start_budget_s)
            self.server.warm_up(self.c.max_tokens)
            self.proxy = FaultProxy(self.server.url, seed=self.c.seed).start()
        except BaseException:
            self.close()
            raise
        self.source.add(self.c.initial_prompts)
        self.source.write()
        self.setup_seconds = time.monotonic() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._restart is not None:
            self._restart.join(self.c.server_start_budget_s)
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        self.server.stop()
        self.disk.unmount()
        self._lock.release()

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> list[tuple[str, str]]:
        """(kind, stage) for every round: each kind once in the first rounds (in a seeded order), then at
        random; the stage at random among those the kind can hit."""
        kinds = list(self.c.kinds)
        order: list[str] = []
        while len(order) < self.c.rounds:
            batch = kinds[:]
            self.rng.shuffle(batch)
            order += batch if not order else [self.rng.choice(kinds) for _ in kinds]
        order = order[: self.c.rounds]
        # an edit needs completions to supersede: the first round, on an empty disk, is another fault
        editing = ("prompt_edited", "prompt_removed")
        if order and order[0] in editing:
            swap = next((i for i, k in enumerate(order) if k not in editing), None)
            if swap is not None:
                order[0], order[swap] = order[swap], order[0]
        plan = []
        for kind in order:
            # generation is where most can go wrong: it is hit more often by signals and a full disk
            targets = TARGETS[kind]
            weights = [{"prompts": 1, "generate": 3, "tokenize": 2}[s] for s in targets]
            plan.append((kind, self.rng.choices(targets, weights)[0]))
        return plan

    # ------------------------------------------------------------------ the jobs, as the roles run them

    def argv(self, stage: str, **fault: Any) -> list[str]:
        py = self.c.python
        if stage == "prompts":
            argv = [py, "-m", "regen.jobs.prompts", "--output-dir", str(self.prompts_dir), "--seed", "0"]
            return [*argv, "--shard-rows", "16", f"--source={json.dumps({'path': str(self.source.path)})}"]
        if stage == "generate":
            kwargs = json.dumps({"thinking": False})
            argv = [py, "-m", "regen.jobs.generate", "--input", str(self.prompts_dir)]
            argv += ["--output-dir", str(self.completions_dir), "--model", str(self.c.model_dir)]
            argv += ["--concurrency", "4", "--max-tokens", str(self.c.max_tokens)]
            argv += ["--chat-template-kwargs", kwargs, "--extra-body", "{}"]
            argv += ["--reasoning", "field", "--truncated", "keep"]
            argv += ["--request-timeout", str(fault.get("request_timeout", 120))]
            argv += ["--max-retries", str(fault.get("max_retries", 8))]
            argv += ["--max-outage", str(fault.get("max_outage", 120))]
            argv += ["--no-progress", "--log-format", "json"]
            argv += [f"--endpoint={fault.get('endpoint', self.server.url)}"]
            # completions_extra_args: quick retries and a short stop grace keep a round short
            argv += ["--status-interval", "0.5", "--shard-records", "16", "--stop-grace", "3"]
            argv += ["--backoff-base", "0.05", "--backoff-max", "0.5", "--circuit-cooldown", "0.1"]
            argv += ["--circuit-cooldown-max", "0.5", "--seed", str(self.c.seed)]
            return argv
        kwargs = json.dumps({"thinking": False})
        argv = [py, "-m", "regen.jobs.tokenize", "--input", str(self.completions_dir)]
        argv += ["--output-dir", str(self.tokenized_dir), "--tokenizer", str(self.c.model_dir)]
        argv += ["--max-length", "512", "--truncation", "truncate", "--reasoning", "drop"]
        argv += ["--train-turns", "all", "--chat-template-kwargs", kwargs, "--special-in-content", "text"]
        argv += ["--unfinished", "keep", "--workers", "1", "--shard-size", "8"]
        argv += ["--no-progress", "--json", "--log-format", "json", "--status-interval", "0.5"]
        return argv

    def status_path(self, stage: str) -> Path | None:
        """Where a stage's job writes its status document (the prompts job writes none)."""
        directory = {"generate": self.completions_dir, "tokenize": self.tokenized_dir}.get(stage)
        return None if directory is None else directory / "status.json"

    def progress(self, stage: str, since_ns: int) -> int:
        """Units of work a stage's job has made durable since `since_ns`: completion lines (generate),
        shard markers (tokenize); the prompts job commits once, so it has none."""
        if stage == "generate":
            n = 0
            for path in self.completions_dir.glob("*.jsonl"):
                if path.name.startswith(("completions-", "dropped-")):
                    with contextlib.suppress(OSError):
                        n += path.read_bytes().count(b"\n")
            return n - self._progress_base
        if stage == "tokenize":
            state = self.tokenized_dir / "state"
            found = 0
            for path in state.glob("*.json") if state.is_dir() else []:
                with contextlib.suppress(OSError):
                    found += path.stat().st_mtime_ns >= since_ns
            return found
        return 0

    def trigger(self, stage: str) -> tuple[str, float]:
        """When a fault comes: ("time", seconds after the start, up to the stage's usual run time) or
        ("progress", k: after the k-th unit of this run's work, up to what the dry run says is left)."""
        if stage == "prompts" or self.rng.random() < 0.4:
            return "time", self.rng.uniform(0.0, 0.9 * self.usual_seconds(stage))
        left = self.pending(stage)
        # generate: before its last record; tokenize: up to after its last shard, where only the merge is
        # left (the time trigger covers the start, before any unit is written)
        top = max(1, left - 1) if stage == "generate" else max(1, left)
        return "progress", float(self.rng.randint(1, top))

    def pending(self, stage: str) -> int:
        argv = [*self.argv(stage)[3:], "--dry-run"]
        if stage == "generate":
            from regen.jobs.generate import build_parser, dry_run, settings_from_args

            doc = dry_run(settings_from_args(build_parser().parse_args(argv)))
            return int(doc["pending"] or 0)
        from regen.jobs import tokenize

        return int(tokenize.run(tokenize.build_parser().parse_args(argv))["pending"])

    def run_stage(
        self,
        stage: str,
        argv: list[str],
        inject: Callable[[], None] | None = None,
        when: tuple[str, float] = ("time", 0.0),
    ) -> StageRun:
        path = self.status_path(stage)
        mode, point = when
        started_ns = time.time_ns()
        if stage == "generate":
            self._progress_base = 0
            self._progress_base = self.progress(stage, 0)
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        hit = threading.Event()
        fired_at: list[float] = []

        def fire() -> None:
            if proc.poll() is None:
                hit.set()
            fired_at.append(time.monotonic() - t0)
            assert inject is not None
            inject()

        ended = threading.Event()

        def watch() -> None:
            while not ended.is_set():
                if mode == "time" and time.monotonic() - t0 >= point:
                    break
                if mode == "progress" and self.progress(stage, started_ns) >= point:
                    break
                ended.wait(0.005)
            if not ended.is_set():
                fire()

        timer = None
        if inject is not None:
            timer = threading.Thread(target=watch, name="fault-trigger", daemon=True)
            timer.start()
        # faults are signals to this job: they reach it by its pid (never by a name)
        self._job = proc
        try:
            out, err = proc.communicate(timeout=self.c.stage_timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err += f"\n[campaign] the job did not end within {self.c.stage_timeout_s:.0f}s and was killed"
        finally:
            ended.set()
            if timer is not None:
                timer.join()
            self._job = None
        seconds = time.monotonic() - t0
        self._runs += 1
        log = self.logs / f"{self._runs:04d}-round{len(self.results) + 1}-{stage}.log"
        log.write_text(
            f"$ {' '.join(argv)}\nexit {proc.returncode} after {seconds:.2f}s\n"
            f"--- stdout\n{out}\n--- stderr\n{err}"
        )
        status, stale = None, False
        if path is not None:
            doc, torn = read_status(path)
            if torn:
                err += "\n[campaign] status.json is torn"
            if doc is not None and doc.get("pid") != proc.pid:
                stale = True  # an earlier run's document: this one never wrote its own
            elif doc is not None:
                status = doc
        return StageRun(
            stage=stage,
            rc=proc.returncode,
            seconds=seconds,
            stderr=err,
            stdout=out,
            status=status,
            stale_status=stale,
            fault_at_s=fired_at[0] if fired_at else None,
            fault_hit=hit.is_set(),
        )

    def usual_seconds(self, stage: str) -> float:
        """How long the stage's job usually runs here (the median of its last runs that had work)."""
        seen = sorted(self.durations[stage][-5:])
        return seen[len(seen) // 2] if seen else _FIRST_GUESS[stage]

    # ------------------------------------------------------------------ a stage's verdict

    @staticmethod
    def reports_success(run: StageRun) -> bool:
        """What the roles pass a stage on: exit 0 and (where there is one) status.json `done`."""
        if run.rc != 0:
            return False
        return run.stage == "prompts" or (run.status or {}).get("state") == "done"

    def judge(self, kind: str, run: StageRun) -> tuple[str, str]:
        """(outcome, detail) of the stage the fault hit."""
        status = run.status or {}
        state = status.get("state")
        said = " ".join(str(x) for x in (status.get("error"), status.get("line"), run.stderr[-4000:]) if x)
        if run.rc == 0 or state in ("done", "succeeded"):
            complete, why = self.stage_complete(run.stage)
            if run.rc == -signal.SIGKILL and complete and (run.status or {}).get("exit_code") == 0:
                # SIGKILL cannot be ignored: it came after the job had finished and said so; the role fails
                # the stage on the signal, and the re-run finds nothing to do
                return "finished", "finished and said done, then SIGKILL came before the process was gone"
            if run.rc != 0:
                return "silent_pass", f"status.json says {state} but the job exited {run.rc}"
            if run.stage != "prompts" and state != "done":
                return "silent_pass", f"exit 0 but status.json says {state!r}"
            if not complete:
                return "silent_pass", f"reported success, but {why}"
            return "finished", "finished, output complete" + (
                " (fault after the end)" if not run.fault_hit else ""
            )
        if status.get("exit_code") not in (None, run.rc):
            return "failed_unnamed", f"exit {run.rc} but status.json says exit_code {status.get('exit_code')}"
        named = self._names_the_fault(kind, run, state, said)
        if named:
            return "failed_named", named
        tail = said.strip().splitlines()[-1:] if said.strip() else ["(no message)"]
        return "failed_unnamed", f"exit {run.rc}, state {state}: {tail[0][:300]}"

    def _errors_reasons(self) -> list[str]:
        path = self.completions_dir / "errors.jsonl"
        if not path.exists():
            return []
        rows, _ = _jsonl_lines(path)
        return [str(r.get("error")) for r in rows if isinstance(r, dict)]

    def _names_the_fault(self, kind: str, run: StageRun, state: str | None, said: str) -> str | None:
        from regen.status import liveness

        rc = run.rc
        if kind == "sigkill":
            if rc == -signal.SIGKILL:
                if run.status is not None and liveness(run.status) != "dead":
                    return None  # a reader of status.json would take the dead job for a live one
                return "killed by SIGKILL (exit -9); status.json: " + (
                    "a dead pid without a final state" if run.status else "not written by this run"
                )
            return None
        if kind == "sigterm":
            if rc == -signal.SIGTERM:
                # the signal came while Python started, before any job can set a handler
                return "killed by SIGTERM before the job set its handler (exit -15)"
            if rc == 143 and run.stage == "prompts":
                return "terminated by SIGTERM (exit 143; the prompts job commits nothing)"
            if rc == 143 and state == "interrupted" and (run.status or {}).get("exit_code") == 143:
                return "terminated by SIGTERM (exit 143, state interrupted)"
            return None
        if kind == "disk_full":
            if rc == 5 and re.search(r"disk is full|No space left on device", said):
                return "exit 5: the disk is full (" + _quote(said, r"disk is full|No space left") + ")"
            return None
        if run.stage != "generate":
            return None
        reasons = self._errors_reasons()
        if kind == "server_killed":
            if rc == 3 and state == "endpoints_down":
                return "exit 3, endpoints_down: " + _quote(said, r"every endpoint")
            down = re.compile(r"Connect|connection|Disconnected|refused|reset|timed out|Server", re.I)
            if rc == 1 and state == "failed" and reasons and all(down.search(r) for r in reasons):
                return f"exit 1: {len(reasons)} prompt(s) failed on the dead server ({reasons[0][:120]})"
            return None
        if kind == "endpoint_errors":
            if (
                rc == 1
                and state == "failed"
                and reasons
                and all(re.search(r"HTTP \d{3}", r) for r in reasons)
            ):
                return (
                    f"exit 1: {len(reasons)} prompt(s) failed with the injected errors ({reasons[0][:120]})"
                )
            if rc == 3 and state == "endpoints_down":
                return "exit 3, endpoints_down after the injected 5xx"
            return None
        if kind == "endpoint_hang":
            if rc == 1 and state == "failed" and reasons and all("timed out" in r for r in reasons):
                return f"exit 1: {len(reasons)} prompt(s) timed out on the hung endpoint"
            if rc == 3 and state == "endpoints_down":
                return "exit 3, endpoints_down while the endpoint hung"
            return None
        return None  # an edited or removed prompt is no fault to fail on

    def stage_complete(self, stage: str) -> tuple[bool, str]:
        """Whether a stage's output holds what it should right now (for a stage that reported success)."""
        view = self.view()
        want = set(self.source.rows)
        if stage == "prompts":
            got = set(view["prompt_ids"])
            if got != want or view["prompt_dups"]:
                return False, f"the prompt set has {len(got)} ids, the source {len(want)}"
            return True, ""
        if stage == "generate":
            got = set(view["completion_ids"])
            prompts = set(view["prompt_ids"])
            if got != prompts:
                return False, f"{len(prompts - got)} prompt(s) have no completion, {len(got - prompts)} extra"
            return True, ""
        got = set(view["sample_ids"])
        comp = set(view["completion_ids"])
        if got != comp:
            return False, f"{len(comp - got)} completion(s) have no sample, {len(got - comp)} extra"
        return True, ""

    # ------------------------------------------------------------------ the view and the checks

    def view(self) -> dict[str, Any]:
        """Ids and records of every stage's output, and the torn lines found on the way."""
        from regen.jobs.generate.rows import resolve_inputs

        torn: list[str] = []
        prompt_rows: list[dict] = []
        if (self.prompts_dir / "manifest.json").is_file():
            try:
                for path in resolve_inputs([str(self.prompts_dir)]):
                    rows, bad = _jsonl_lines(path)
                    prompt_rows += rows
                    if bad:
                        torn.append(f"{path.name}: {bad} torn line(s)")
            except Exception as exc:  # a manifest naming a missing shard is what the checks report
                torn.append(f"prompts: {exc}")
        completions: list[dict] = []
        completion_lines: list[bytes] = []
        for path in sorted(self.completions_dir.glob("completions-*.jsonl")) + sorted(
            self.completions_dir.glob("dropped-*.jsonl")
        ):
            rows, bad = _jsonl_lines(path)
            completions += rows
            for raw in path.read_bytes().split(b"\n"):
                with contextlib.suppress(ValueError):
                    if raw.strip() and isinstance(json.loads(raw), dict):
                        completion_lines.append(raw)
            if bad:
                torn.append(f"{path.name}: {bad} torn line(s)")
        aside: list[dict] = []
        aside_path = self.completions_dir / "superseded.jsonl"
        if aside_path.exists():
            aside, bad = _jsonl_lines(aside_path)
            if bad:
                torn.append(f"superseded.jsonl: {bad} torn line(s)")
        for name in ("errors.jsonl", "errors.previous.jsonl"):
            if (self.completions_dir / name).exists():
                _, bad = _jsonl_lines(self.completions_dir / name)
                if bad:
                    torn.append(f"{name}: {bad} torn line(s)")
        sample_ids: list[str] = []
        conversations: list[dict] = []
        if self.tokenized_dir.is_dir():
            import pyarrow.parquet as pq

            for path in sorted((self.tokenized_dir / "data").glob("*.parquet")):
                try:
                    sample_ids += [
                        str(x) for x in pq.read_table(path, columns=["id"]).column("id").to_pylist()
                    ]
                except Exception as exc:
                    torn.append(f"data/{path.name}: unreadable ({type(exc).__name__})")
            for rel in ("conversations.jsonl", "rejects.jsonl"):
                if (self.tokenized_dir / rel).exists():
                    rows, bad = _jsonl_lines(self.tokenized_dir / rel)
                    if rel == "conversations.jsonl":
                        conversations = rows
                    if bad:
                        torn.append(f"{rel}: {bad} torn line(s)")
        return {
            "prompt_rows": prompt_rows,
            "prompt_ids": [str(r.get("id")) for r in prompt_rows],
            "prompt_dups": len(prompt_rows) - len({str(r.get("id")) for r in prompt_rows}),
            "completions": completions,
            "completion_lines": completion_lines,
            "completion_ids": [str(r.get("id")) for r in completions],
            "aside": aside,
            "sample_ids": sample_ids,
            "conversations": conversations,
            "torn": torn,
        }

    def check(self) -> tuple[dict[str, int], list[str], dict[str, Any]]:
        """The round's checks against the source set as it is now: counts and what each one found."""
        from regen.jobs.generate.stale import prompt_key, settings_key

        v = self.view()
        counts = dict.fromkeys(CHECKS, 0)
        problems: list[str] = []

        def found(check: str, n: int, what: str) -> None:
            if n:
                counts[check] += n
                problems.append(f"{check}: {what}")

        source = self.source.rows
        prompts = {str(r["id"]): r for r in v["prompt_rows"]}
        found(
            "lost",
            len(set(source) - set(prompts)),
            f"source prompts missing from the prompt set: {sorted(set(source) - set(prompts))[:5]}",
        )
        found(
            "stale",
            len(set(prompts) - set(source)),
            f"prompts no longer in the source: {sorted(set(prompts) - set(source))[:5]}",
        )
        found("duplicated", v["prompt_dups"], "ids twice in the prompt set")
        edited = [
            i
            for i in prompts
            if i in source
            and _user_side(prompts[i]["conversations"]) != _user_side(source[i]["conversations"])
        ]
        found("stale", len(edited), f"prompts that do not match the source: {edited[:5]}")

        # completions: one per prompt, of the prompt as it is, made with this campaign's settings
        answer = {
            "model": str(self.c.model_dir),
            "max_tokens": self.c.max_tokens,
            "sampling": {},
            "chat_template_kwargs": {"thinking": False},
            "reasoning": "field",
        }
        want_settings = settings_key(answer)
        comps: dict[str, dict] = {}
        dup_comp = 0
        for r in v["completions"]:
            rid = str(r.get("id"))
            dup_comp += rid in comps
            comps[rid] = r
        found("duplicated", dup_comp, "ids twice in the completions")
        missing = sorted(set(source) - set(comps))
        found("lost", len(missing), f"prompts without a completion: {missing[:5]}")
        orphans = sorted(set(comps) - set(source))
        found("stale", len(orphans), f"completions of removed prompts: {orphans[:5]}")
        superseded = [
            i
            for i, r in comps.items()
            if i in source
            and (
                r.get("prompt_key") != prompt_key(source[i]["conversations"])
                or _user_side(r.get("conversations") or []) != _user_side(source[i]["conversations"])
            )
        ]
        found("stale", len(superseded), f"completions of edited prompts: {superseded[:5]}")
        resettled = [i for i, r in comps.items() if r.get("settings_key") != want_settings]
        found("stale", len(resettled), f"completions made with other settings: {resettled[:5]}")

        # moved aside, never deleted, each once
        aside_keys = Counter(
            json.dumps([a.get("shard"), a.get("record")], sort_keys=True)
            for a in v["aside"]
            if isinstance(a, dict)
        )
        found(
            "duplicated", sum(n - 1 for n in aside_keys.values()), "records listed twice in superseded.jsonl"
        )
        aside_records = {
            json.dumps(a.get("record"), sort_keys=True) for a in v["aside"] if isinstance(a, dict)
        }
        now = set(v["completion_lines"])
        vanished = []
        for line, rid in self.seen_records.items():
            if line in now:
                continue
            if json.dumps(json.loads(line), sort_keys=True) not in aside_records:
                vanished.append(rid)
        found("lost", len(vanished), f"completions gone without a line in superseded.jsonl: {vanished[:5]}")
        for line in now:
            self.seen_records.setdefault(line, str(json.loads(line).get("id")))

        # samples and SpecForge conversations: one per completion, of the completion as it is
        samples = Counter(v["sample_ids"])
        found("duplicated", sum(n - 1 for n in samples.values()), "ids twice in the tokenized samples")
        found(
            "lost",
            len(set(comps) - set(samples)),
            f"completions without a sample: {sorted(set(comps) - set(samples))[:5]}",
        )
        found(
            "stale",
            len(set(samples) - set(comps)),
            f"samples without a completion: {sorted(set(samples) - set(comps))[:5]}",
        )
        convs: dict[str, dict] = {}
        dup_conv = 0
        for doc in v["conversations"]:
            rid = str(doc.get("id"))
            dup_conv += rid in convs
            convs[rid] = doc
        found("duplicated", dup_conv, "ids twice in conversations.jsonl")
        found(
            "lost",
            len(set(samples) - set(convs)),
            f"samples missing from conversations.jsonl: {sorted(set(samples) - set(convs))[:5]}",
        )
        stale_conv = sorted(
            i
            for i, doc in convs.items()
            if i not in comps
            or _user_side(doc.get("conversations") or []) != _user_side(comps[i].get("conversations") or [])
            or _assistant_side(doc.get("conversations") or [])
            != _assistant_side(comps[i].get("conversations") or [])
        )
        found(
            "stale",
            len(stale_conv),
            f"conversations.jsonl entries that do not match the completions: {stale_conv[:5]}",
        )

        found("torn", len(v["torn"]), "; ".join(v["torn"]))
        leftovers = [
            str(p.relative_to(self.disk.point))
            for p in self.disk.point.rglob("*")
            if p.is_file() and (p.name.endswith(".tmp") or ".tmp." in p.name or p.name.endswith(".intent"))
        ]
        found("leftovers", len(leftovers), f"temporary files left: {leftovers[:5]}")
        sizes = {"prompts": len(prompts), "completions": len(comps), "samples": len(samples)}
        return counts, problems, sizes

    def check_after_fault(self) -> list[str]:
        """Right after the fault, before anything resumes: what a later stage run on its own would read
        must be whole (the tokenized shards the train stage reads, the committed prompt set)."""
        from regen.jobs._common import JobError
        from regen.jobs.generate.rows import verify_manifest

        found: list[str] = []
        if (self.prompts_dir / "manifest.json").is_file():
            try:
                verify_manifest([str(self.prompts_dir)])
            except JobError as exc:
                found.append(f"the committed prompt set is not whole: {exc}")
        out = self.tokenized_dir
        if out.is_dir():
            import pyarrow.parquet as pq

            for path in sorted(out.rglob("*.jsonl")):
                _, bad = _jsonl_lines(path)
                if bad:
                    found.append(f"{path.relative_to(out)}: {bad} torn line(s)")
            markers = {p.stem for p in (out / "state").glob("*.json")} if (out / "state").is_dir() else set()
            for path in sorted((out / "data").glob("*.parquet")) if (out / "data").is_dir() else []:
                try:
                    pq.read_metadata(path)
                except Exception as exc:
                    found.append(f"data/{path.name}: unreadable ({type(exc).__name__})")
                if path.stem not in markers:
                    found.append(f"data/{path.name}: written, not committed (no state marker), read by train")
        return found

    # ------------------------------------------------------------------ the faults

    def injector(
        self, kind: str, stage: str
    ) -> tuple[Callable[[], None] | None, dict[str, Any], Callable[[], None]]:
        """(inject, job settings for the faulted run, undo) for one fault."""
        rng = self.rng
        undo: list[Callable[[], None]] = []

        def signal_job(sig: int) -> Callable[[], None]:
            def send() -> None:
                job = getattr(self, "_job", None)
                if job is not None and job.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(job.pid, sig)

            return send

        if kind == "sigkill":
            return signal_job(signal.SIGKILL), {}, lambda: None
        if kind == "sigterm":
            return signal_job(signal.SIGTERM), {}, lambda: None
        if kind == "disk_full":
            leave = rng.choice((0, 4096, 8192, 32768))

            def fill() -> None:
                self.disk.fill(leave)

            return fill, {}, self.disk.empty
        if kind == "server_killed":
            outage = rng.choice((2.0, 90.0))  # give up soon (exit 3) or ride out the restart

            def kill_server() -> None:
                self.server.kill()
                # started again at once, as systemd's Restart= would; the job meets the outage meanwhile
                self._restart = threading.Thread(target=self._restart_server, daemon=True)
                self._restart.start()

            return kill_server, {"max_outage": outage}, self._await_server
        if kind == "endpoint_errors":
            rate = rng.choice((0.5, 1.0))
            statuses = rng.choice(((500,), (503,), (429,), (400,), (500, 503, 429)))
            window = rng.uniform(0.5, 3.0)
            proxy = self.proxy

            def errors() -> None:
                proxy.errors(rate, statuses)
                threading.Timer(window, proxy.clear).start()

            undo.append(proxy.clear)
            return errors, {"endpoint": proxy.url, "max_retries": 2, "max_outage": 30}, proxy.clear
        if kind == "endpoint_hang":
            # shorter than the job's retries last (it rides it out) or longer (it gives up and says why)
            window = rng.choice((rng.uniform(1.0, 4.0), rng.uniform(6.0, 10.0)))
            proxy = self.proxy

            def hang() -> None:
                proxy.hang()
                threading.Timer(window, proxy.clear).start()

            timeout = rng.choice((1.0, 2.5))
            return (
                hang,
                {
                    "endpoint": proxy.url,
                    "max_retries": 2,
                    "request_timeout": timeout,
                    "max_outage": rng.choice((3, 30)),
                },
                proxy.clear,
            )
        return None, {}, lambda: None

    def _restart_server(self) -> None:
        self.server.start()
        with contextlib.suppress(RuntimeError):
            self.server.wait_ready(self.c.server_start_budget_s)

    def _await_server(self) -> None:
        if self._restart is not None:
            self._restart.join(self.c.server_start_budget_s)
            self._restart = None
        if not self.server.healthy():
            self.server.kill()
            self.server.start()
            self.server.wait_ready(self.c.server_start_budget_s)

    # ------------------------------------------------------------------ one round

    def run_round(self, number: int, kind: str, stage: str) -> RoundResult:
        t0 = time.monotonic()
        self.source.add(self.c.new_prompts_per_round)
        changed: list[str] = []
        expect_moved = 0
        if kind in ("prompt_edited", "prompt_removed"):
            have = {str(r.get("id")) for r in self.view()["completions"]}
            count = self.rng.choice((1, 2, 3))
            if kind == "prompt_edited":
                changed = self.source.edit(count, f"in round {number}", have)
            else:
                changed = self.source.remove(count, have)
            expect_moved = len([i for i in changed if i in have])
        self.source.write()
        skipped_reason = ""
        if kind == "disk_full" and not self.disk.mounted:
            skipped_reason = self.disk.reason
        if kind in ("endpoint_errors", "endpoint_hang") and self.proxy is None:
            skipped_reason = "the fault proxy is not running"

        outcome, detail, fault_run = "skipped", skipped_reason, None
        before: list[str] = []
        after_fault: list[str] = []
        if not skipped_reason:
            inject, settings, undo = self.injector(kind, stage)
            try:
                for s in STAGES:
                    if s != stage:
                        run = self.run_stage(s, self.argv(s))
                        if not self.reports_success(run):
                            before.append(f"{run.brief()} before the fault: {_last_line(run.stderr)}")
                            break
                        self.durations[s].append(run.seconds)
                        continue
                    when = self.trigger(s) if inject is not None else ("time", 0.0)
                    fault_run = self.run_stage(s, self.argv(s, **settings), inject, when)
                    fault_run.trigger = f"{when[0]} {when[1]:.2f}" if inject is not None else ""
                    outcome, detail = self.judge(kind, fault_run)
                    if inject is None:
                        self.durations[s].append(fault_run.seconds)
                    break
            finally:
                undo()
            after_fault = self.check_after_fault()
            if before:
                outcome, detail = "failed_unnamed", "; ".join(before)
            elif kind in ("prompt_edited", "prompt_removed") and fault_run is not None:
                moved = (fault_run.status or {}).get(
                    "superseded" if kind == "prompt_edited" else "orphaned", 0
                )
                if outcome == "finished" and moved != expect_moved:
                    outcome = "failed_unnamed"
                    detail = f"status.json reports {moved} moved aside, {expect_moved} expected ({changed})"
                elif outcome == "finished":
                    detail = (
                        f"{kind.split('_')[1]} {changed}: {moved} completion(s) moved aside, run finished"
                    )

        resumed, resume_detail = self.resume()
        counts, problems, sizes = self.check()
        if after_fault:
            counts["torn"] += len(after_fault)
            problems += [f"torn: after the fault: {x}" for x in after_fault]
        if not resumed:
            problems.insert(0, f"resume: {resume_detail}")
        result = RoundResult(
            round=number,
            kind=kind,
            stage=stage,
            outcome=outcome,
            detail=detail,
            fault_at_s=None if fault_run is None else fault_run.fault_at_s,
            fault_hit=False if fault_run is None else fault_run.fault_hit,
            trigger="" if fault_run is None else fault_run.trigger,
            rc=None if fault_run is None else fault_run.rc,
            state=None if fault_run is None else (fault_run.status or {}).get("state"),
            resumed=resumed,
            resume_detail=resume_detail,
            checks=counts,
            problems=problems,
            seconds=round(time.monotonic() - t0, 2),
            **sizes,
        )
        self.results.append(result)
        return result

    def resume(self) -> tuple[bool, str]:
        """Every stage again, as a re-run of the playbook: skipped where its dry run says complete (the
        roles do the same); each one that runs must finish. Then every dry run must say complete."""
        ran = []
        for stage in STAGES:
            if stage != "prompts" and self.dry_run_complete(stage):
                continue
            run = self.run_stage(stage, self.argv(stage))
            ran.append(stage)
            if not self.reports_success(run):
                return False, f"{run.brief()}: {_last_line(run.stderr)}"
            self.durations[stage].append(run.seconds)
        for stage in ("generate", "tokenize"):
            if not self.dry_run_complete(stage):
                return False, f"{stage}: its dry run still says there is work after a successful run"
        return True, "ran " + (", ".join(ran) or "nothing")

    def dry_run_complete(self, stage: str) -> bool:
        """The stage's own dry run, in this process (the same code the job's --dry-run runs)."""
        argv = [*self.argv(stage)[3:], "--dry-run"]
        if stage == "generate":
            from regen.jobs.generate import build_parser, dry_run, settings_from_args

            return bool(dry_run(settings_from_args(build_parser().parse_args(argv)))["complete"])
        from regen.jobs import tokenize

        args = tokenize.build_parser().parse_args(argv)
        return bool(tokenize.run(args)["complete"])

    # ------------------------------------------------------------------ everything

    def keep_evidence(self, number: int) -> Path:
        """A copy of the pipeline's disk after a round with a finding (the tmpfs goes with the campaign)."""
        target = self.c.workdir / "evidence" / f"round-{number}"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(self.disk.point, target, ignore=shutil.ignore_patterns(".filler"))
        shutil.copy2(self.source.path, target / "source.jsonl")
        return target

    def run(self) -> dict[str, Any]:
        plan = self.schedule()
        for number, (kind, stage) in enumerate(plan, 1):
            r = self.run_round(number, kind, stage)
            if r.problems or r.outcome in ("silent_pass", "failed_unnamed"):
                r.problems.append(f"evidence: {self.keep_evidence(number)}")
            bad = {k: v for k, v in r.checks.items() if v}
            self.c.log(
                f"round {number:3d}/{len(plan)} {kind:15s} {r.stage:9s} {r.outcome:14s} "
                f"{r.seconds:5.1f}s {bad or ''} {r.detail[:100]}"
            )
            for p in r.problems:
                self.c.log(f"          {p[:300]}")
            if self.c.stop_on_problem and (r.problems or r.outcome in ("silent_pass", "failed_unnamed")):
                break
        return self.report()

    def report(self) -> dict[str, Any]:
        by_kind: dict[str, Counter[str]] = {k: Counter() for k in self.c.kinds}
        for r in self.results:
            by_kind[r.kind][r.outcome] += 1
        totals = dict.fromkeys(CHECKS, 0)
        for r in self.results:
            for k, v in r.checks.items():
                totals[k] += v
        silent = sum(1 for r in self.results if r.outcome == "silent_pass")
        unnamed = sum(1 for r in self.results if r.outcome == "failed_unnamed")
        not_resumed = sum(1 for r in self.results if not r.resumed)
        skipped = sorted({f"{r.kind}: {r.detail}" for r in self.results if r.outcome == "skipped"})
        return {
            "schema": "regen.fault_campaign/1",
            "seed": self.c.seed,
            "rounds": len(self.results),
            "seconds": round(time.monotonic() - self.started, 1),
            "setup_seconds": round(self.setup_seconds, 1),
            "server_starts": self.server.starts,
            "disk": "tmpfs" if self.disk.mounted else f"plain directory ({self.disk.reason})",
            "by_kind": {k: dict(v) for k, v in by_kind.items()},
            "totals": totals,
            "silent_passes": silent,
            "failed_unnamed": unnamed,
            "not_resumed": not_resumed,
            "skipped": skipped,
            "ok": silent == 0 and unnamed == 0 and not_resumed == 0 and not any(totals.values()),
            "results": [r.as_dict() for r in self.results],
        }


# ==================================================================================================
# The report
# ==================================================================================================


def render_markdown(report: dict[str, Any]) -> str:
    t = report["totals"]
    lines = [
        "# Fault campaign",
        "",
        f"{report['rounds']} rounds, seed {report['seed']}, {report['seconds']:.0f} s "
        f"(setup {report['setup_seconds']:.0f} s, model server started {report['server_starts']} time(s)); "
        f"disk: {report['disk']}.",
        "",
        f"**{'PASS' if report['ok'] else 'FAIL'}**: lost {t['lost']}, duplicated {t['duplicated']}, "
        f"stale {t['stale']}, torn {t['torn']}, leftovers {t['leftovers']}; silent passes "
        f"{report['silent_passes']}, failures that do not name their fault {report['failed_unnamed']}, "
        f"rounds that did not resume {report['not_resumed']}.",
        "",
        "## Faults by kind",
        "",
        "| fault | rounds | " + " | ".join(OUTCOMES) + " |",
        "|---|---:|" + "---:|" * len(OUTCOMES),
    ]
    for kind, outcomes in report["by_kind"].items():
        n = sum(outcomes.values())
        lines.append(f"| {kind} | {n} | " + " | ".join(str(outcomes.get(o, 0)) for o in OUTCOMES) + " |")
    lines += [
        "",
        "## Rounds",
        "",
        "| # | fault | stage | trigger | at (s) | hit | outcome | exit | state | resumed | lost | dup "
        "| stale | torn | left | what the stage said |",
        "|---:|---|---|---|---:|---|---|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        c = r["checks"]
        at = "" if r["fault_at_s"] is None else f"{r['fault_at_s']:.2f}"
        detail = (r["detail"] + ("; " + "; ".join(r["problems"]) if r["problems"] else "")).replace(
            "|", "\\|"
        )
        lines.append(
            f"| {r['round']} | {r['kind']} | {r['stage']} | {r['trigger']} | {at} | "
            f"{'yes' if r['fault_hit'] else 'no'} | "
            f"{r['outcome']} | {'' if r['rc'] is None else r['rc']} | {r['state'] or ''} | "
            f"{'yes' if r['resumed'] else 'NO'} | {c['lost']} | {c['duplicated']} | {c['stale']} | "
            f"{c['torn']} | {c['leftovers']} | {detail[:400]} |"
        )
    lines += [
        "",
        "Outcomes: *finished* (exit 0, status `done`, output complete), *failed_named* (failed with a "
        "message that names the fault), *failed_unnamed* (failed, but not saying why, or an unexpected "
        "failure), "
        "*silent_pass* (reported success with incomplete output, or a success state beside a failing exit "
        "code), *skipped* (the fault cannot be made here; the reason is in the row). `trigger`: what set "
        "the fault off, `time S` (S seconds after the job started) or `progress K` (once the job had "
        "written its K-th record or shard); `at`: when it came; `hit`: whether the job was still running "
        "then. The checks count after the round's resume; `torn` also counts what a later stage would have "
        "read right after the fault (a torn line, an unreadable or uncommitted tokenized shard).",
        "",
    ]
    return "\n".join(lines)


def write_report(report: dict[str, Any], output: Path) -> tuple[Path, Path]:
    output.mkdir(parents=True, exist_ok=True)
    js = output / "report.json"
    md = output / "report.md"
    js.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    md.write_text(render_markdown(report))
    return js, md


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1][:300] if lines else "(no output)"


def _quote(text: str, pattern: str) -> str:
    for line in text.splitlines():
        if re.search(pattern, line):
            return line.strip()[:200]
    return ""
