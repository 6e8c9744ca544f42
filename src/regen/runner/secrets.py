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
  ``********``), in every encoding the value can take there (YAML, JSON, ``repr``, shell quoting, URL,
  HTML, base64, nested; see :func:`secret_pattern`); stdout is written from the scrubbed events, event
  data runner never read (a cancelled run's partial files) is scrubbed when the run ends, and
  secret-looking variables of the caller's own environment are masked in the recorded ``command`` file.

Roles still mark tasks that handle secrets ``no_log: true``; this is the net under that.
"""

from __future__ import annotations

import base64
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


# How a value can look once Ansible, ansible-runner or a job has written it into stdout or an event:
# JSON (``\"``, ``\\``, ``\u00e9``, surrogate pairs), YAML (single-quoted ``''``, double-quoted escapes,
# lines folded at the callback's 80 columns), Python ``repr`` (``\'``, ``\x85``, bytes as ``\xc3\xa9``),
# shell quoting (``'"'"'``, ``'\''``, nested for ``/bin/sh -c '...'`` at -vvv), percent- and HTML-encoding,
# base64, and any of these inside another (JSON in YAML, shell in JSON). The redactor matches a secret
# character by character, each character in any of its forms, so nesting needs no list of combinations.
# Matching a little more than the exact encodings only ever masks more.
_ANSI = r"(?:\x1b\[[0-9;]*m)*"  # the colour codes runner's event stdout keeps around each line
# A line break as is, or escaped once a folded text was written as JSON or repr.
_NEWLINE = r"(?:\r?\n|\\+(?:r\\+)?n)"
# A YAML line fold between two characters: double-quoted scalars break anywhere with ``\`` + newline +
# indent (and escape a space that starts the next line); runner's stdout wraps each line in colour codes.
_FOLD = rf"(?:\\?{_ANSI}{_NEWLINE}{_ANSI}[ \t]*\\?)?"
_QUOTES = "'\""
_NAMED_ESCAPES = {  # JSON, Python and YAML double-quoted backslash escapes of one character
    "\n": "n",
    "\t": "t",
    "\r": "r",
    "\b": "b",
    "\f": "f",
    "\0": "0",
    "\a": "a",
    "\v": "v",
    "\x1b": "e",
    "\x85": "N",
    "\xa0": "_",
    "\u2028": "L",
    "\u2029": "P",
}
_HTML_NAMED = {"'": "apos", '"': "quot", "&": "amp", "<": "lt", ">": "gt"}
_MIN_BASE64_CORE = 8  # shorter stable base64 runs would mask unrelated base64 text


def _char_pattern(ch: str) -> str:
    """A regex for one character of a secret in any of the forms above."""
    cp = ord(ch)
    utf8 = ch.encode("utf-8", "surrogatepass")
    # A quote: as is, \' \" '' '"'"' '\'' and their nestings, i.e. a run of quotes and backslashes. Any other
    # character: as is, or after a run of escaping backslashes (\\, \/, \$).
    forms = [r"[\\'\"]+"] if ch in _QUOTES else [r"\\*" + re.escape(ch)]
    hex_escapes = [f"u{cp:04x}"] if cp <= 0xFFFF else []
    hex_escapes.append(f"U{cp:08x}")
    if cp <= 0xFF:
        hex_escapes.append(f"x{cp:02x}")
    if cp > 0xFFFF:  # JSON writes a character outside the BMP as a surrogate pair
        high, low = 0xD800 + ((cp - 0x10000) >> 10), 0xDC00 + ((cp - 0x10000) & 0x3FF)
        hex_escapes.append(rf"u{high:04x}\\+u{low:04x}")
    if cp > 0x7F:  # Python's repr of bytes: the UTF-8 bytes
        hex_escapes.append(r"\\+".join(f"x{b:02x}" for b in utf8))
    escapes = [f"(?i:{'|'.join(hex_escapes)})"]
    if ch in _NAMED_ESCAPES:
        escapes.append(re.escape(_NAMED_ESCAPES[ch]))
    forms.append(r"\\+(?:" + "|".join(escapes) + ")")
    forms.append("(?i:" + "".join(f"%{b:02x}" for b in utf8) + ")")  # percent-encoding (URLs)
    forms.append(f"&#0*{cp};|(?i:&#x0*{cp:x};)")
    if ch in _HTML_NAMED:
        forms.append(f"&{_HTML_NAMED[ch]};")
    if ch == " ":  # form-encoded, or a YAML fold that replaced the space with a line break
        forms += [r"\+", rf"{_ANSI}{_NEWLINE}{_ANSI}[ \t]*"]
    return "(?:" + "|".join(forms) + ")"


def _base64_cores(raw: bytes) -> list[str]:
    """The base64 text a value always encodes to inside larger data, at each of the 3 byte alignments."""
    cores = []
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + raw).decode("ascii")
        # output character j carries input bits [6j, 6j + 6): keep those that only the value's bits make
        start, end = -(-8 * offset // 6), (8 * (offset + len(raw))) // 6
        core = encoded[start:end]
        if len(core) >= _MIN_BASE64_CORE:
            cores += [core, core.replace("+", "-").replace("/", "_")]
    return cores


def secret_pattern(value: str) -> str:
    """A regex that matches ``value`` in any encoding it can take in stdout and job events."""
    spelled = _FOLD.join(_char_pattern(ch) for ch in value)
    cores = _base64_cores(value.encode("utf-8", "surrogatepass"))
    return "|".join([spelled, *(re.escape(c) for c in dict.fromkeys(cores))])


class Redactor:
    """Replaces secret values wherever they appear in event data (strings, nested lists and dicts), in
    every encoding :func:`secret_pattern` knows."""

    def __init__(self, values: Iterable[object]) -> None:
        texts = {str(v) for v in values if v is not None and len(str(v)) >= _MIN_SECRET_LEN}
        # Longest first, so a secret that contains another is masked whole.
        self._pattern = (
            re.compile("|".join(secret_pattern(t) for t in sorted(texts, key=len, reverse=True)))
            if texts
            else None
        )

    def __bool__(self) -> bool:
        return self._pattern is not None

    def text(self, value: str) -> str:
        return self._pattern.sub(MASK, value) if self._pattern else value

    def scrub(self, value: Any) -> Any:
        """Mask secrets in ``value`` in place (dict keys too) and return it."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            for key in list(value):
                item = self.scrub(value[key])
                clean = self.text(key) if isinstance(key, str) else key
                if clean != key:
                    del value[key]
                value[clean] = item
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
