"""The serving API key and the environment file that carries it, read one way by every reader (standard
library only; shared as module_utils/__init__.py describes).

The serve stage writes the key into a 0600 file as `REGEN_SERVING_API_KEY=<key>` (systemd's
EnvironmentFile= format); the server's unit, the supervisor, the quality gate, the sweep and the
evaluation jobs read it from there, never from their command lines.
"""

from __future__ import annotations

API_KEY_ENV = "REGEN_SERVING_API_KEY"


class SecretFileError(ValueError):
    """An environment file is missing or lacks the key asked for; the message says what to do."""


def read_env_file(path):
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them (comments, optional quotes); {} without a
    path."""
    if not path:
        return {}
    env = {}
    try:
        with open(path, encoding="utf-8") as handle:
            for raw in handle:
                line = raw.strip()
                if not line or line.startswith(("#", ";")) or "=" not in line:
                    continue
                key, value = line.split("=", 1)
                value = value.strip()
                if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                    value = value[1:-1]
                env[key.strip()] = value
    except FileNotFoundError as exc:
        raise SecretFileError(f"environment file {path} does not exist; re-run the serve stage") from exc
    return env


def read_api_key(path, name=API_KEY_ENV):
    """The API key `name` from the environment file `path`, or None when no file is given (a server
    without a key). A file without the key is an error: a request without it would only get a 401."""
    if not path:
        return None
    value = read_env_file(path).get(name)
    if not value:
        raise SecretFileError(f"{path} has no {name}= line; re-run the serve stage")
    return value
