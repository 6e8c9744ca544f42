"""Errors of the runner API and the exit codes the ``regen`` command maps outcomes to."""

from __future__ import annotations

from enum import IntEnum


class RegenRunnerError(Exception):
    """Base class of the errors raised by :mod:`regen.runner`."""


class BadInput(RegenRunnerError, ValueError):
    """The caller asked for something that cannot run: an unknown stage, a missing inventory, bad extra
    vars. The message names what was wrong and how to fix it."""


class ExitCode(IntEnum):
    """Exit codes of ``regen``; also :attr:`regen.runner.RunResult.exit_code`.

    ``OK`` 0: everything ran. ``ERROR`` 1: ansible or regen failed outside any task (see the message).
    ``TASK_FAILED`` 2: a task failed, so its stage failed. ``UNREACHABLE`` 3: a host could not be reached.
    ``BAD_INPUT`` 4: bad usage or input (unknown stage, missing inventory, bad ``-e``, a playbook that does
    not parse). ``CANCELED`` 130: the run was interrupted (Ctrl-C or :meth:`RunHandle.cancel`).
    """

    OK = 0
    ERROR = 1
    TASK_FAILED = 2
    UNREACHABLE = 3
    BAD_INPUT = 4
    CANCELED = 130
