"""The answer of a log diagnosis, shared by the generic reader (diagnose) and the table of failures public
reports explained (known_failures); a module of its own so that neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cause:
    """A likely reason a server did not come up, and what to do about it."""

    kind: str
    summary: str
    hint: str
    line: str = ""
