"""The runner's redactor against the real encoders a secret passes through on its way to stdout and events.

Each case encodes a sentence holding the secret the way Ansible's YAML callback, ``json``, ``repr``,
``shlex`` (nested, as in ``/bin/sh -c '...'`` at -vvv), URL and HTML quoting or base64 do, then checks that
no piece of the secret survives and that the surrounding text does.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import shlex
import urllib.parse

import pytest
import yaml
from ansible.plugins.callback import _AnsibleCallbackDumper

from regen.runner.secrets import MASK, Redactor

# Each holds pieces (letters and digits) that no encoder changes, separated by what they do change.
SECRETS = {
    "single quote": "Zq9'Wv3'Xp2",
    "all quoting characters": "sk-Zq9'Wv3\"Xp2\\Jm5 Ty8 \u00e9 \U0001f511-Rb4",
    "quote first and last": "'Zq9Wv3Xp2'",
    "space and slash": "Zq9 Wv3/Xp2 Jm5",
}
PIECES = ("Zq9", "Wv3", "Xp2", "Jm5", "Ty8", "Rb4")


def _yaml(value: object) -> str:
    """What Ansible's default callback prints with ``callback_result_format = yaml`` (folded at 80 cols)."""
    dumper = functools.partial(_AnsibleCallbackDumper, lossy=True)
    return yaml.dump({"msg": value}, Dumper=dumper, allow_unicode=True, default_flow_style=False)


ENCODERS = {
    "as is": str,
    "YAML": _yaml,
    "YAML double-quoted (a tab forces it)": lambda t: _yaml("\t" + t),
    "JSON": lambda t: json.dumps(t, ensure_ascii=False),
    "JSON, ASCII only": json.dumps,
    "JSON in JSON": lambda t: json.dumps(json.dumps(t)),
    "JSON in YAML": lambda t: _yaml(json.dumps({"key": t})),
    "YAML in JSON": lambda t: json.dumps(_yaml(t)),
    "shell": shlex.quote,
    "shell in shell": lambda t: shlex.quote("KEY=" + shlex.quote(t) + " python"),
    "shell in shell in shell": lambda t: shlex.quote(shlex.quote("KEY=" + shlex.quote(t))),
    "shell in YAML": lambda t: _yaml(shlex.quote(t)),
    "Python repr": repr,
    "Python bytes repr": lambda t: repr(t.encode()),
    "URL": urllib.parse.quote,
    "URL form": urllib.parse.quote_plus,
    "HTML": html.escape,
    "base64": lambda t: base64.b64encode(t.encode()).decode(),
    "base64, shifted a byte": lambda t: base64.b64encode(b"x" + t.encode()).decode(),
    "base64, shifted two bytes": lambda t: base64.b64encode(b"xy" + t.encode()).decode(),
}
BINARY = [f for name, f in ENCODERS.items() if name.startswith("base64")]  # no text left to compare

# Short and long lead-ins put the secret before and across the YAML callback's line fold.
LEADS = ("the key is ", "a preamble long enough to push the secret to where the dumper folds lines: key ")
TAIL = " and more words after it, so that the line grows long enough to be folded by the dumper"


@pytest.mark.parametrize("secret", SECRETS.values(), ids=SECRETS.keys())
@pytest.mark.parametrize("encoder", ENCODERS.values(), ids=ENCODERS.keys())
@pytest.mark.parametrize("lead", LEADS, ids=["short lead", "long lead"])
def test_no_piece_of_the_secret_survives_its_encoding(secret: str, encoder, lead: str) -> None:
    encoded = encoder(lead + secret + TAIL)
    redacted = Redactor([secret]).text(encoded)
    assert MASK in redacted, redacted
    assert [p for p in PIECES if p in redacted] == [], redacted
    if encoder not in BINARY:
        assert "dumper" in redacted, "the text around the secret was masked too"


def test_events_are_scrubbed_in_place_keys_included() -> None:
    secret = SECRETS["single quote"]
    event = {
        "stdout": "msg: 'key Zq9''Wv3''Xp2'",
        "res": {"cmd": ["printf", secret], secret: "a secret used as a key", "n": 3},
    }
    Redactor([secret]).scrub(event)
    assert event == {
        "stdout": f"msg: 'key {MASK}'",
        "res": {"cmd": ["printf", MASK], MASK: "a secret used as a key", "n": 3},
    }


def test_unrelated_text_is_left_alone() -> None:
    redactor = Redactor([SECRETS["all quoting characters"], "ab"])
    text = "sk-Zq9 Wv3: pieces of a key are not the key; 'ab' is too short to be one"
    assert redactor.text(text) == text
