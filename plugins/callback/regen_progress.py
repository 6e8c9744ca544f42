"""Stdout callback: Ansible's default output, with a job's progress instead of its wait loop's retries.

The stages wait for their long jobs with an `until:` loop (async_status every few seconds), and the default
callback prints one "FAILED - RETRYING: [host]: Wait for the generation job (302343 retries left)." line per
poll: some seventy lines for the demo's generation alone, none of which says how far the job is. This
callback prints no such line. Instead, at most every `progress_interval` seconds per task and host (and on
the first poll), one line with how long the task has waited and the `line` of the job's status document,
when the task names it in a task variable whose name ends in `_progress_file` (roles prefix their own
variables: `_completions_progress_file`) and the file is readable here (the job runs
on the controller, as on the embedded default). From verbosity 1 (-v) the retry lines come back as well.
Everything else is the default callback's.
"""

from __future__ import annotations

import json
import os
import time

from ansible.plugins.callback.default import CallbackModule as DefaultCallback

# The controller runs from the project venv, where the regen package is: one duration format for the
# jobs' status views and this progress line.
from regen.jobs.eta import fmt_eta

DOCUMENTATION = r"""
name: regen_progress
type: stdout
short_description: Ansible's default output with job progress instead of "FAILED - RETRYING" lines
description:
  - The default stdout callback, except that the retries of an C(until) loop print no "FAILED - RETRYING"
    line; at most every O(progress_interval) seconds per task and host a progress line shows how long the
    task has waited and the C(line) of the status document the task names in a task variable whose name
    ends in C(_progress_file) (when the controller can read it).
  - At verbosity 1 and above the retry lines are printed as well.
extends_documentation_fragment:
  - default_callback
  - result_format_callback
options:
  progress_interval:
    description: Seconds between two progress lines of one waiting task on one host.
    type: float
    default: 15
    env:
      - name: REGEN_PROGRESS_INTERVAL_S
    ini:
      - section: callback_regen_progress
        key: progress_interval
"""

# How a task variable that names the status document of the job a wait loop waits on ends.
PROGRESS_FILE_SUFFIX = "_progress_file"



def _number(value):
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def status_line(path):
    """What the status document at `path` says of the job's progress (regen.status/1 keys: `done` of
    `total` `item`s, `eta_s`, and its own `line`), or None (absent, unreadable, not yet written)."""
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict):
        return None
    parts = []
    done, total = _number(document.get("done")), _number(document.get("total"))
    eta = _number(document.get("eta_s"))
    if done is not None and total:
        parts.append(f"{done:g}/{total:g} {document.get('item') or 'item'}s ({100 * done / total:.0f}%)")
    if eta is not None and eta >= 0:
        parts.append(f"ETA {fmt_eta(eta)}")
    line = document.get("line")
    if isinstance(line, str) and line:
        parts.append(line)
    return ", ".join(parts) or None


class CallbackModule(DefaultCallback):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "regen_progress"

    def __init__(self):
        super().__init__()
        self._play = None
        # (task uuid, host) -> [first poll time, last progress line time]
        self._waits = {}

    def v2_playbook_on_play_start(self, play):
        self._play = play
        super().v2_playbook_on_play_start(play)

    def v2_runner_retry(self, result):
        if self._display.verbosity >= 1:
            super().v2_runner_retry(result)
        now = time.monotonic()
        key = (result._task._uuid, result._host.get_name())
        wait = self._waits.setdefault(key, [now, None])
        interval = float(self.get_option("progress_interval"))
        if wait[1] is not None and now - wait[1] < interval:
            return
        wait[1] = now
        if self._last_task_banner != result._task._uuid:  # the banner first, as for any result
            self._print_task_banner(result._task)
        line = self._job_line(result)
        waited = fmt_eta(now - wait[0])
        text = f"  [{result._host.get_name()}] {result.task_name}: waiting {waited}"
        self._display.display(f"{text}: {line}" if line else f"{text}, the job is still running")

    def _job_line(self, result):
        task_vars = result._task.vars or {}
        raw = next((v for k, v in task_vars.items() if k.endswith(PROGRESS_FILE_SUFFIX)), None)
        if not raw or self._play is None:
            return None
        try:
            path = self._template(raw, result)
        except Exception:  # a path that cannot be templated here is shown without progress, never fails
            return None
        return status_line(path) if isinstance(path, str) and os.path.isabs(path) else None

    def _template(self, raw, result):
        # Task variables reach a callback untemplated: resolve this one with the play's variables for
        # the host (role defaults and registered results included), as the task itself saw them.
        from ansible.template import Templar

        manager = self._play.get_variable_manager()
        variables = manager.get_vars(play=self._play, host=result._host, task=result._task)
        return Templar(loader=self._play._loader, variables=variables).template(raw)
