"""The Slurm launcher end to end on this machine, with `srun` / `scontrol` stand-ins: two Ray
"nodes" start (both here), the command sees both, its exit code is the job's, and every Ray
process the job started is gone afterwards.

Starting two `ray start` nodes takes about a minute on a loaded 2-core machine, so this test is
opt-in: `POSTTRAIN_SLURM_SMOKE=1 ./run.sh pytest tests/functional/test_slurm_launch.py`.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "launch" / "slurm" / "posttrain.sbatch"

pytestmark = [
    pytest.mark.functional,
    pytest.mark.timeout(400),
    pytest.mark.skipif(os.environ.get("POSTTRAIN_SLURM_SMOKE") != "1", reason="opt-in: POSTTRAIN_SLURM_SMOKE=1"),
]

FAKE_SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] || { echo "fake scontrol: $*" >&2; exit 1; }
for node in $FAKE_NODES; do echo "$node"; done
"""
FAKE_SRUN = """#!/usr/bin/env bash
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done  # every "node" is this machine
exec "$@"
"""
COMMAND = (
    "python -c 'import ray; ray.init(address=\"auto\"); "
    "print(\"ALIVE_NODES\", sum(n[\"Alive\"] for n in ray.nodes()))'; exit 7"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def test_sbatch_starts_two_nodes_runs_the_command_and_tears_down(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    job_id = str(90000 + os.getpid() % 10000)
    ray_tmp = f"/tmp/ray-smoke-{job_id}"  # short: Ray's socket paths must fit in 107 characters
    env = {
        **os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_ID": job_id, "FAKE_NODES": "node1 node2", "RAY_PORT": str(free_port()),
        "RAY_CLIENT_PORT": str(free_port()), "RAY_DASHBOARD_PORT": str(free_port()), "CPUS_PER_NODE": "1",
        "NODE_WAIT_S": "200", "COMMAND": COMMAND, "RAY_TMPDIR": ray_tmp,
    }
    result = subprocess.run(["bash", str(SBATCH)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=380)
    output = result.stdout + result.stderr
    assert result.returncode == 7, output[-3000:]  # the command's exit code
    assert "ALIVE_NODES 2" in output and "all 2 nodes joined" in output
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if ray_tmp in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, [" ".join(p.info["cmdline"])[:120] for p in leftovers]
