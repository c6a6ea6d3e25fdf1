#!/usr/bin/env bash
# The whole test suite beside a CPU hog on every core: no test may depend on how fast the machine
# is at the moment (wait on events with generous deadlines, never race a clock).
#   tests/stress.sh                 # the suite, as `./run.sh pytest`, beside one busy loop per core
#   tests/stress.sh tests/unit -x   # arguments go to pytest
#   HOGS=4 tests/stress.sh          # more busy loops than cores
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOGS="${HOGS:-$(nproc)}"
pids=()
stop_hogs() {
    if [ "${#pids[@]}" -gt 0 ]; then
        kill "${pids[@]}" 2>/dev/null || true
        wait "${pids[@]}" 2>/dev/null || true
    fi
}
trap stop_hogs EXIT INT TERM
for _ in $(seq "$HOGS"); do
    python3 -c 'while True: pass' &
    pids+=("$!")
done
echo "[stress] ${HOGS} CPU hogs running (pids ${pids[*]}); the suite runs beside them" >&2
cd "$REPO"
"$REPO/run.sh" pytest "$@"
