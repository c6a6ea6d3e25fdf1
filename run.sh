#!/usr/bin/env bash
# Run any command inside the project's virtual environment, creating it on first use.
#   ./run.sh posttrain grpo        # the main job
#   ./run.sh pytest                # the test suite
# The venv lives in .venv; it is (re)installed only when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
VENV=.venv
STAMP="$VENV/.installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
    echo "[run.sh] setting up $VENV (first run only)..." >&2
    python3 -m venv "$VENV"
    # Plain pip (not uv): it honours this machine's pip configuration, so torch==2.13.0
    # resolves to the local CPU wheel instead of several GB of CUDA packages.
    LOG="$VENV/install.log"
    if ! { "$VENV/bin/python" -m pip install --upgrade pip &&
           "$VENV/bin/python" -m pip install torch==2.13.0 &&
           "$VENV/bin/python" -m pip install -e ".[dev]"; } >"$LOG" 2>&1; then
        tail -n 40 "$LOG" >&2
        echo "[run.sh] install failed; full log in $LOG" >&2
        exit 1
    fi
    rm -f "$VENV"/.installed-*
    touch "$STAMP"
fi
export PATH="$PWD/$VENV/bin:$PATH"
exec "$@"
