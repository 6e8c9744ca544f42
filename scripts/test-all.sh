#!/usr/bin/env bash
# Every check, in the least wall-clock time this machine allows (`make test`, and so CI): `make lint` beside
# the start of the tests (a minute of CPU while the background lane mostly waits on apt and containers
# booting; it reads only tracked files and the tests write only ignored ones), and the tests in two lanes:
#   - background: the tests in LXC containers of their own (marker `lxc`): the molecule scenario `serve`, and
#     beside it the scenario `default` then the GPU container and weights roles between containers (each in
#     containers of its own; they mostly wait on containers booting, apt and SSH); then the unit tests and the
#     provisioning tests (venvs built in temporary directories from copied locks), then the train stage and
#     Mooncake tests, end-to-end ones included (offline, rolling and online training runs, each in a work
#     directory of its own, on free loopback ports; they share the Mooncake venv, so they stay in one lane),
#     and the serve role's lifecycles (a model server on a free loopback port, here to even out the lanes);
#   - foreground: the other integration tests (real playbook runs on localhost), then the other local
#     end-to-end runs.
# The lanes share no port, directory or process: the containers have their own network namespace, unit
# tests work in temporary directories on ports they pick, and the shared caches under .cache/ are written
# atomically. Molecule mostly waits on containers booting, apt and SSH, so it costs the other lane little.
# Exit status: 0 only when every part passed. The background lane's log is printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=.cache/test-logs
mkdir -p "$logs"
lxc_log="$logs/background.log"

# The train stage and Mooncake tests, and the serve role's (background lane, after the unit tests).
background_tests=(tests/integration/test_train_stage.py tests/integration/test_train_online.py
                  tests/integration/test_mooncake_master.py tests/integration/test_capture_server.py
                  tests/integration/test_serve_role.py)
# Run one after the other beside the molecule scenario `serve` (the longest): their containers, wheelhouses
# and ports are their own, and what they share on the controller (the SSH key, the demo model, the regen
# wheel) is made under a lock or renamed into place.
beside_serve=(tests/e2e/test_gpu_container_and_weights_lxc.py "tests/e2e/test_molecule.py::test_molecule_scenario_on_lxc[default]")
not_background=()
for t in "${background_tests[@]}"; do not_background+=(--ignore="$t"); done

started=$(date +%s)
make --no-print-directory lint >"$logs/lint.log" 2>&1 &
lint_pid=$!
# The slowest tests of each part are listed at its end: where the suite's time goes, run after run.
set -- --durations=15 "$@"
(
  # lxc, debootstrap, the bridge and the cached root filesystem, once, before two runs could race to install
  # them (the tests say why when this fails, e.g. without root).
  scripts/lxc-test-host.sh rootfs >/dev/null 2>&1
  pytest -m "lxc" "${beside_serve[@]}" "$@" >"$logs/lxc-beside-serve.log" 2>&1 &
  beside=$!
  pytest -m "lxc" --ignore="${beside_serve[0]}" --deselect "${beside_serve[1]}" "$@"
  lxc=$?
  wait "$beside" || lxc=1
  cat "$logs/lxc-beside-serve.log"
  pytest tests/unit tests/integration/test_provision.py -m "not e2e" "$@"
  unit=$?
  pytest "${background_tests[@]}" -m "not lxc" "$@"
  training=$?
  echo "LXC containers exit $lxc, unit + provisioning exit $unit, train stage + Mooncake + serve role exit $training"
  [ "$lxc" -eq 0 ] && [ "$unit" -eq 0 ] && [ "$training" -eq 0 ]
) >"$lxc_log" 2>&1 &
lxc_pid=$!
# A Ctrl-C or a CI timeout stops the background lane too, so no molecule run outlives this script.
trap 'kill -TERM "$lint_pid" 2>/dev/null; pkill -TERM -P "$lxc_pid" 2>/dev/null; kill -TERM "$lxc_pid" 2>/dev/null; wait "$lxc_pid" 2>/dev/null; exit 130' INT TERM
echo "== background lane (LXC container tests, unit and provisioning tests, train stage + Mooncake + serve role) started: $lxc_log"

echo "== lint started beside the tests: $logs/lint.log"
echo "== integration tests but provisioning (not e2e)"
pytest tests --ignore=tests/unit --ignore=tests/integration/test_provision.py "${not_background[@]}" -m "not e2e" "$@"
fast=$?
echo "== local end-to-end runs (e2e, not lxc)"
pytest "${not_background[@]}" -m "e2e and not lxc" "$@"
local_e2e=$?

echo "== waiting for the background lane"
wait "$lxc_pid"
lxc=$?
wait "$lint_pid"
lint=$?
trap - INT TERM
echo "== lint (ruff, yamllint, ansible-lint)"
cat "$logs/lint.log"
cat "$lxc_log"
echo "== results after $(( $(date +%s) - started )) s: lint exit $lint, integration exit $fast, local e2e exit $local_e2e, background lane (LXC containers, unit, provisioning, train stage + Mooncake + serve role) exit $lxc"
[ "$lint" -eq 0 ] && [ "$fast" -eq 0 ] && [ "$local_e2e" -eq 0 ] && [ "$lxc" -eq 0 ]
