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
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    "$VENV/bin/python" -m pip install -q torch==2.13.0 >&2
    "$VENV/bin/python" -m pip install -q -e ".[dev]" >&2
    rm -f "$VENV"/.installed-*
    touch "$STAMP"
fi
export PATH="$PWD/$VENV/bin:$PATH"
exec "$@"
