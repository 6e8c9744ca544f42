#!/usr/bin/env bash
# Every test, in the least wall-clock time this machine allows (`make test`, and so CI):
#   - the molecule scenarios (marker `lxc`) run in their own LXC containers, in the background, from the start;
#   - meanwhile the unit + integration tests, then the local end-to-end runs, run in the foreground.
# The two halves share no port, directory or process (the containers have their own network namespace; the
# shared caches under .cache/ are written atomically), and molecule mostly waits on containers booting,
# apt and SSH, so running it beside the local tests costs them little and saves its whole duration.
# Exit status: 0 only when every part passed. The molecule log is printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=.cache/test-logs
mkdir -p "$logs"
lxc_log="$logs/lxc.log"

started=$(date +%s)
pytest -m "lxc" "$@" >"$lxc_log" 2>&1 &
lxc_pid=$!
# A Ctrl-C or a CI timeout stops the background half too, so no molecule run outlives this script.
trap 'kill -TERM "$lxc_pid" 2>/dev/null; wait "$lxc_pid" 2>/dev/null; exit 130' INT TERM
echo "== molecule scenarios (marker lxc) started in the background: $lxc_log"

echo "== unit and integration tests (not e2e)"
pytest -m "not e2e" "$@"
fast=$?
echo "== local end-to-end runs (e2e, not lxc)"
pytest -m "e2e and not lxc" "$@"
local_e2e=$?

echo "== waiting for the molecule scenarios"
wait "$lxc_pid"
lxc=$?
trap - INT TERM
cat "$lxc_log"
echo "== results after $(( $(date +%s) - started )) s: unit+integration exit $fast, local e2e exit $local_e2e, molecule exit $lxc"
[ "$fast" -eq 0 ] && [ "$local_e2e" -eq 0 ] && [ "$lxc" -eq 0 ]
