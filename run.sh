#!/usr/bin/env bash
# Run any command inside the project's virtual environment, creating it on first use.
#   ./run.sh posttrain grpo        # the main job
#   ./run.sh pytest                # the test suite
# The venv lives in the repository's .venv; it is (re)installed only when pyproject.toml changes.
# The command runs in the directory you called this script from, so relative paths in your
# configs and arguments mean what you expect (`/path/to/posttrain/run.sh posttrain grpo --config my.yaml`).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$REPO/.venv"
STAMP="$VENV/.installed-$(sha1sum "$REPO/pyproject.toml" | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
    LOG="$REPO/.venv-install.log"
    echo "[run.sh] setting up $VENV (first run only, a few minutes); full log: $LOG" >&2
    phase() {  # phase NAME CMD...: one line per phase; on failure the log's tail and its path
        echo "[run.sh]   $1..." >&2
        shift
        if ! "$@" >>"$LOG" 2>&1; then
            tail -n 40 "$LOG" >&2
            echo "[run.sh] install failed; full log in $LOG" >&2
            exit 1
        fi
    }
    : >"$LOG"
    phase "creating the virtual environment" python3 -m venv "$VENV"
    phase "upgrading pip" "$VENV/bin/python" -m pip install --upgrade pip
    # Plain pip (not uv): it honours this machine's pip configuration, so torch==2.13.0
    # resolves to the local CPU wheel instead of several GB of CUDA packages.
    # --no-compile: pip would byte-compile all ~21,000 modules it installs (about a minute of one
    # core); a run imports a few thousand of them, compiled below or by their first import.
    phase "installing torch 2.13.0 (the largest download)" "$VENV/bin/python" -m pip install --no-compile torch==2.13.0
    phase "installing posttrain and its pinned dependencies (ray, transformers, ...)" \
        "$VENV/bin/python" -m pip install --no-compile -e "${REPO}[dev]"
    # An editable install leaves byte-compiling to the first import; where PYTHONDONTWRITEBYTECODE
    # is set (many CI containers) every process, each Ray worker among them, would compile the
    # package again: about 0.25 s of CPU a process. A stale .pyc is ignored, so edits are safe.
    phase "byte-compiling posttrain" "$VENV/bin/python" -m compileall -q "$REPO/posttrain"
    # Imports cache the bytecode they compile even under PYTHONDONTWRITEBYTECODE (many CI containers
    # set it; every process would compile torch again): the isolated environments' .pth line. Then
    # what every run imports (a job's driver, a policy worker, the math environment, the tiny
    # model's class: ~2,700 modules) is compiled once here: a run's first processes start together
    # and would each compile it (10 s of CPU apiece), and an environment others only read keeps it.
    phase "byte-compiling what a run imports" "$VENV/bin/python" -c "import pathlib, sys, sysconfig
from posttrain.distributed.isolated_env import BYTECODE_PTH
name, text = BYTECODE_PTH
(pathlib.Path(sysconfig.get_paths()['purelib']) / name).write_text(text)
sys.dont_write_bytecode = False  # as the line just written does for every later interpreter
import posttrain.algorithms.grpo, posttrain.models.policy.policy, posttrain.models.generation.native
import posttrain.environments.math_env
from transformers import LlamaForCausalLM"
    # The code environment's sandbox uses bubblewrap; without it, it falls back (loudly) to weaker
    # isolation (docs/sandbox.md). Installed here when we may; otherwise say how.
    if ! command -v bwrap >/dev/null 2>&1; then
        echo "[run.sh]   installing bubblewrap (the code sandbox)..." >&2
        if ! { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 &&
               apt-get install -y -q bubblewrap >>"$LOG" 2>&1; }; then
            echo "[run.sh] WARNING: could not install bubblewrap (bwrap); the code environment's sandbox will" \
                 "use weaker isolation. Install it with: sudo apt-get install bubblewrap" >&2
        fi
    fi
    rm -f "$VENV"/.installed-*
    touch "$STAMP"
    echo "[run.sh] environment ready" >&2
    # This process's start-up clock (posttrain/utils/startup.py) counts the install as its own phase.
    POSTTRAIN_INSTALL_DONE_AT="$(date +%s.%N)"
    export POSTTRAIN_INSTALL_DONE_AT
fi
export PATH="$VENV/bin:$PATH"
exec "$@"
