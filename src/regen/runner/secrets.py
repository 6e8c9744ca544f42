"""Secrets (API keys, tokens) for a run, kept out of plain files and logs.

ansible-runner records every run on disk: the command line (extra vars given as a dict become a ``-e``
JSON argument), the whole environment (``artifacts/<ident>/command``), every event and the stdout. So
regen never gives it a secret in the clear:

* secret extra vars are encrypted with Ansible Vault under a random one-time password, written to a
  private (0600) file that holds only ciphertext, and passed as ``-e @file`` with ``--vault-id
  regen_secrets@prompt``;
* the one-time password reaches ansible-playbook through ansible-runner's ``passwords`` answer to the
  vault prompt: it lives in memory only (``suppress_env_files`` keeps runner from writing ``env/passwords``);
* every event is scrubbed before runner writes it (a role that prints a secret by mistake shows
  ``********``), stdout is written from the scrubbed events, and secret-looking variables of the
  caller's own environment are masked in the recorded ``command`` file.

Roles still mark tasks that handle secrets ``no_log: true``; this is the net under that.
"""

from __future__ import annotations

import json
import os
import re
import secrets as _random
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from regen.fsio import atomic_write_text
from regen.runner.errors import BadInput

VAULT_ID = "regen_secrets"
VAULT_PROMPT = rf"Vault password \({VAULT_ID}\):"
MASK = "********"
_MIN_SECRET_LEN = 4
_SECRET_ENV = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL)", re.I)


def encrypt_vars(variables: Mapping[str, Any], dest: Path, *, env: Mapping[str, str]) -> str:
    """Write ``variables`` to ``dest`` as a vault-encrypted YAML file; return the one-time password."""
    for name in variables:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise BadInput(f"secret name {name!r} is not a valid Ansible variable name")
    password = _random.token_urlsafe(32)
    request = json.dumps({"password": password, "vault_id": VAULT_ID, "vars": dict(variables)})
    proc = subprocess.run(
        [sys.executable, "-m", "regen.runner._ansible_helper", "vault-encrypt"],
        input=request,
        capture_output=True,
        text=True,
        env=dict(env),
        check=False,
    )
    if proc.returncode != 0:
        raise BadInput(f"could not encrypt the secrets with ansible-vault: {proc.stderr.strip()[-500:]}")
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(proc.stdout)
    return password


class Redactor:
    """Replaces secret values wherever they appear in event data (strings, nested lists and dicts)."""

    def __init__(self, values: Iterable[object]) -> None:
        texts = {str(v) for v in values if v is not None and len(str(v)) >= _MIN_SECRET_LEN}
        # Longest first, so a secret that contains another is masked whole.
        self._pattern = (
            re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))
            if texts
            else None
        )

    def __bool__(self) -> bool:
        return self._pattern is not None

    def text(self, value: str) -> str:
        return self._pattern.sub(MASK, value) if self._pattern else value

    def scrub(self, value: Any) -> Any:
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            for key in list(value):
                value[key] = self.scrub(value[key])
            return value
        if isinstance(value, list):
            for i, item in enumerate(value):
                value[i] = self.scrub(item)
            return value
        return value


def mask_environment(env: Mapping[str, str], extra_values: Iterable[str] = ()) -> dict[str, str]:
    """A copy of ``env`` with secret-looking variables (``*TOKEN*``, ``*API_KEY*``, ...) masked."""
    redactor = Redactor(extra_values)
    return {k: (MASK if _SECRET_ENV.search(k) and v else redactor.text(v)) for k, v in env.items()}


def scrub_command_file(path: Path, extra_values: Iterable[str] = ()) -> None:
    """Rewrite runner's ``command`` artifact with the environment masked (see :func:`mask_environment`)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(data.get("env"), dict):
        data["env"] = mask_environment(data["env"], extra_values)
    atomic_write_text(path, json.dumps(data, ensure_ascii=False), mode=0o600, durable=False)
