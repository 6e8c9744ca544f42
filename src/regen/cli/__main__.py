"""`python -m regen.cli`: the `regen` command."""

import sys

from regen.cli import main

sys.exit(main())
