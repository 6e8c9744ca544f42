#!/usr/bin/env bash
# Builds (or reuses) the project's controller virtualenv in .venv from requirements/controller.lock
# (hashed: installed with pip --require-hashes), then regen itself as an editable install.
# The venv is rebuilt only when the lock, pyproject.toml or requirements.yml changed: a marker file
# holds their combined hash, so re-running this is a few milliseconds on an unchanged checkout.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${REGEN_VENV:-.venv}
MARKER="$VENV/.regen-lock.sha256"
want=$(cat requirements/controller.lock pyproject.toml requirements.yml requirements/collections.lock | sha256sum | cut -d' ' -f1)

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$want" ] && [ -x "$VENV/bin/ansible-playbook" ]; then
  exit 0
fi

echo "bootstrap: building $VENV from requirements/controller.lock (once per lock change)"
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), f"regen needs Python >= 3.11, found {sys.version.split()[0]}"'
[ -d "$VENV" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade 'pip==26.3'
# Hash-checking mode: every file pip fetches must match a sha256 the lock recorded when it was resolved.
# torch's CPU build is not on PyPI: pip finds it where its find-links point (this workplace's machines set
# PIP_FIND_LINKS=/opt/wheels); with none configured, the PyTorch CPU index's page for torch (the hash in
# the lock still decides which file is accepted).
if [ -z "${PIP_FIND_LINKS:-}" ] && ! "$VENV/bin/python" -m pip config list 2>/dev/null | grep -q 'find-links'; then
  export PIP_FIND_LINKS=https://download.pytorch.org/whl/cpu/torch/
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --require-hashes \
  -r requirements/controller.lock
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .

# Collections: only what requirements.yml pins, into a project-local path that ansible.cfg reads. They come
# from the `ansible` wheel on PyPI (Galaxy is not reachable everywhere), downloaded by pip with its sha256
# checked (hash-checking mode), of which only the pinned collections are extracted; each one's MANIFEST.json
# must show the pinned version.
if grep -qE '^\s*-\s*name:' requirements.yml; then
  "$VENV/bin/python" scripts/install_collections.py requirements.yml requirements/collections.lock .collections
fi
echo "$want" > "$MARKER"
echo "bootstrap: $VENV ready ($("$VENV/bin/ansible" --version | sed -n 1p))"
