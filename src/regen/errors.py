"""The error a user can fix, raised by the jobs and by the domain code they call (loading a tokenizer,
reading a prompt set), so that the domain packages need not import the jobs for it.

The jobs' `run_main` (regen.jobs._common) turns it into its message and `exit_code`.
"""

from __future__ import annotations

EXIT_USAGE = 2  # bad arguments or bad input that stops the whole job (argparse uses 2 as well)


class JobError(Exception):
    """A problem the user can fix; the message names what is wrong and how to fix it."""

    exit_code = EXIT_USAGE
