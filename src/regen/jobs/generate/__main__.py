"""`python -m regen.jobs.generate`: see the package docstring."""

import sys

from regen.jobs._common import run_main
from regen.jobs.generate.cli import main

sys.exit(run_main(main, own_process=True))
