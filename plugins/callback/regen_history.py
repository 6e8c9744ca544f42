"""Notification callback: every run of a regen playbook joins one run history, however it was started.

`regen run` records its runs through ansible-runner; `make regen` and a plain `ansible-playbook` used to
leave nothing but the manifest of a distinct result. This callback writes one document per run,
`<regen_artifacts_dir>/runs/history/<run id>.json`, at the start (state `running`) and at the end: when and
how it ran, the inventory, tags, check mode, each play's counts and end, the recap per host, the failed
tasks, and the manifest the summary stage recorded (the id `regen compare` takes). `regen status` and
`regen plan` read these beside runner's records; `regen compare` accepts their ids.

The run id is `REGEN_RUN_ID` when the caller sets it (`regen run` sets runner's ident, so both records
name one run), else the start time, the inventory's name and four random hex digits. The callback exports
it as `REGEN_RUN_ID` to what the run starts on the controller (the summary stage's manifest records it).
A playbook without `regen_artifacts_dir` (not a regen inventory) is not recorded. Recording never fails
a run: an unwritable directory is a warning.
"""

from __future__ import annotations

import json
import os
import secrets
import time

from ansible import context
from ansible.plugins.callback import CallbackBase

DOCUMENTATION = r"""
name: regen_history
type: notification
short_description: Record every run of a regen playbook in the run history
description:
  - Writes C(<regen_artifacts_dir>/runs/history/<run id>.json) at the start and the end of every
    ansible-playbook run whose inventory sets C(regen_artifacts_dir), however it was started.
  - The run id is C(REGEN_RUN_ID) when set (regen's runner sets its ident), else the time, the inventory
    name and four random hex digits; it is exported as C(REGEN_RUN_ID) for what the run starts locally.
requirements:
  - enabled in ansible.cfg (callbacks_enabled)
"""

SCHEMA = "regen.run/1"
RUN_ID_VARIABLE = "REGEN_RUN_ID"
_COUNTS = ("ok", "changed", "failed", "unreachable", "skipped", "rescued", "ignored")


def _now_iso():
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat(timespec="milliseconds")  # stage times in the manifest come from these


def _message(result):
    res = result._result or {}
    text = res.get("msg") or res.get("stderr") or res.get("reason") or ""
    return str(text).strip().splitlines()[0][:500] if str(text).strip() else ""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "notification"
    CALLBACK_NAME = "regen_history"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self._path = None
        self._doc = None
        self._play = None
        self._t0 = time.time()

    # --- the record ------------------------------------------------------------------------------

    def _write(self):
        if self._path is None:
            return
        try:
            os.makedirs(os.path.dirname(self._path), exist_ok=True)
            tmp = f"{self._path}.tmp{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump(self._doc, handle, indent=1, default=str)
            os.replace(tmp, self._path)
        except OSError as exc:
            self._display.warning(f"regen_history: cannot record the run in {self._path}: {exc}")
            self._path = None

    def _artifacts_dir(self, play):
        """`regen_artifacts_dir` of the play's first host, templated as the play sees it (None if unset)."""
        from ansible.template import Templar

        manager = play.get_variable_manager()
        inventory = manager._inventory
        hosts = inventory.get_hosts(play.hosts) or inventory.get_hosts("all")
        if not hosts:
            return None
        variables = manager.get_vars(play=play, host=hosts[0])
        raw = variables.get("regen_artifacts_dir")
        if not raw:
            return None
        value = Templar(loader=play._loader, variables=variables).template(raw)
        return value if isinstance(value, str) and os.path.isabs(value) else None

    def _start(self, play):
        try:
            artifacts = self._artifacts_dir(play)
        except Exception as exc:  # an inventory that cannot be templated here is simply not recorded
            self._display.vvv(f"regen_history: no run record ({exc})")
            artifacts = None
        args = context.CLIARGS
        inventory = [os.path.abspath(os.path.expanduser(p)) for p in (args.get("inventory") or ())]
        run_id = os.environ.get(RUN_ID_VARIABLE)
        how = "regen run" if run_id else "ansible-playbook"
        if not run_id:
            name = os.path.basename(inventory[0].rstrip("/")) if inventory else "default"
            run_id = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(self._t0))}-{name}-{secrets.token_hex(2)}"
            os.environ[RUN_ID_VARIABLE] = run_id  # the summary's manifest records it
        self._doc = {
            "schema": SCHEMA,
            "ident": run_id,
            "how": how,
            "status": "running",
            "rc": None,
            "check": bool(args.get("check")),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._t0)),
            "finished": None,
            "duration": None,
            "inventory": inventory,
            "tags": [t for t in (args.get("tags") or ()) if t != "all"],
            "skip_tags": list(args.get("skip_tags") or ()),
            "playbooks": [os.path.abspath(p) for p in (args.get("args") or ())],
            "pid": os.getpid(),
            "plays": [],
            "hosts": {},
            "failures": [],
            "manifest": None,
        }
        self._path = os.path.join(artifacts, "runs", "history", f"{run_id}.json") if artifacts else None
        self._write()

    # --- events ----------------------------------------------------------------------------------

    def v2_playbook_on_play_start(self, play):
        if self._doc is None:
            self._start(play)
        self._close_play()
        self._play = {"name": play.get_name(), "started": _now_iso(), "finished": None,
                      "counts": dict.fromkeys(("ok", "changed", "failed", "unreachable", "skipped"), 0)}
        self._doc["plays"].append(self._play)

    def _close_play(self):
        if self._play is not None and self._play["finished"] is None:
            self._play["finished"] = _now_iso()

    def _count(self, key):
        if self._play is not None:
            self._play["counts"][key] += 1

    def v2_runner_on_ok(self, result):
        self._count("changed" if (result._result or {}).get("changed") else "ok")
        self._manifest_of(result)

    def v2_runner_on_skipped(self, result):
        self._count("skipped")

    def v2_runner_on_failed(self, result, ignore_errors=False):
        if ignore_errors:
            return
        self._count("failed")
        self._failure(result, unreachable=False)

    def v2_runner_on_unreachable(self, result):
        self._count("unreachable")
        self._failure(result, unreachable=True)

    def _failure(self, result, *, unreachable):
        if self._doc is None:
            return
        self._doc["failures"].append({
            "play": self._play["name"] if self._play else None,
            "task": result.task_name,
            "host": result._host.get_name(),
            "message": _message(result),
            "action": result._task.action,
            "unreachable": unreachable,
        })
        self._write()

    def _manifest_of(self, result):
        # The summary stage's `python -m regen.provenance record` prints the manifest's id.
        argv = (result._task.args or {}).get("argv")
        if self._doc is None or not isinstance(argv, list) or "regen.provenance" not in argv:
            return
        try:
            recorded = json.loads((result._result or {}).get("stdout") or "{}")
        except ValueError:
            return
        if isinstance(recorded, dict) and recorded.get("run_id"):
            self._doc["manifest"] = recorded["run_id"]

    def v2_playbook_on_stats(self, stats):
        if self._doc is None:
            return
        self._close_play()
        hosts = {}
        for host in sorted(stats.processed):
            summary = stats.summarize(host)
            # Ansible's recap calls failed results "failures"
            hosts[host] = {k: int(summary.get("failures" if k == "failed" else k, 0)) for k in _COUNTS}
        self._doc["hosts"] = hosts
        bad = any(h["failed"] or h["unreachable"] for h in hosts.values())
        self._doc["status"] = "failed" if bad else "successful"
        self._doc["rc"] = (4 if any(h["unreachable"] for h in hosts.values()) else 2) if bad else 0
        self._doc["finished"] = _now_iso()
        self._doc["duration"] = round(time.time() - self._t0, 1)
        self._write()
