"""Which inventory a data directory belongs to: two inventories of one checkout must not share one unawares.

The work directory (prompts, completions, tokenized data, checkpoints) and the artifacts directory (facts,
reports, the run history) are named by inventory variables. Two inventories that name the same ones (a copy
of inventory/local with other prompts) would overwrite each other's data: switching between them
regenerates everything, and the summary shows the other dataset's drafter. The first run that uses a
directory claims it for its inventory (`.regen-owner.json`); a run of another inventory fails at its start
with the fix, unless the user shares the directory on purpose (regen_shared_dirs).

Standard library only.
"""

from __future__ import annotations

import json
import os

OWNER_FILE = ".regen-owner.json"


def _same(a, b):
    return os.path.realpath(a) == os.path.realpath(b)


def owner(directory):
    """The inventory recorded in `directory` (None when unclaimed or unreadable)."""
    try:
        with open(os.path.join(directory, OWNER_FILE), encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, ValueError):
        return None
    value = document.get("inventory") if isinstance(document, dict) else None
    return value if isinstance(value, str) and value else None


def claim(directory, inventory, *, write=True):
    """`("claimed" | "owned" | "foreign", recorded owner)`: claim an unclaimed `directory` (or one whose
    recorded inventory is gone) for `inventory` (only when `write`; the directory is created), or say
    whether its owner is this inventory."""
    recorded = owner(directory)
    # An owner that no longer exists (a moved or renamed checkout, a deleted inventory) claims nothing.
    if recorded is None or not os.path.exists(recorded):
        if write:
            os.makedirs(directory, exist_ok=True)
            tmp = os.path.join(directory, f"{OWNER_FILE}.tmp{os.getpid()}")
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump({"inventory": os.path.realpath(inventory)}, handle)
                handle.write("\n")
            os.replace(tmp, os.path.join(directory, OWNER_FILE))
        return "claimed", os.path.realpath(inventory)
    return ("owned" if _same(recorded, inventory) else "foreign"), recorded


def describe_foreign(kind, variable, directory, recorded, inventory):
    """What to do when `directory` (the `kind` that `variable` names) belongs to inventory `recorded`."""
    directory = directory.rstrip("/")
    suggestion = f"{directory}-{os.path.basename(inventory.rstrip('/'))}"
    return (
        f"the {kind} {directory} ({variable}) holds the data of inventory {recorded}; this run's "
        f"inventory is {inventory}: sharing it would overwrite one data set with the other (a re-run of "
        "either regenerates everything, and the summary shows the other's drafter). Give this inventory "
        f"directories of its own (e.g. {variable}: {suggestion}), or set regen_shared_dirs: true to share "
        "on purpose"
    )
