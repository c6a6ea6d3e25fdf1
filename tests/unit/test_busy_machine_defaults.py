"""Defaults that keep a run fast on a machine other jobs are using: OpenMP threads wait passively
after a short bounded spin, and the top level's cluster settings reach the nested warm starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from posttrain.config.loader import load_config

PROBE = """
import json, os, sys
{first}
import posttrain
print(json.dumps({{"policy": os.environ.get("OMP_WAIT_POLICY"), "spin": os.environ.get("GOMP_SPINCOUNT"),
                  "too_late": posttrain.OMP_WAIT_POLICY_SET_TOO_LATE}}))
"""


def probe(first: str = "", **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env=environ, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_importing_posttrain_makes_openmp_threads_wait_passively_after_a_short_spin():
    assert probe() == {"policy": "PASSIVE", "spin": "10000", "too_late": False}


@pytest.mark.parametrize("env", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "5"}])
def test_the_users_own_wait_settings_win_and_nothing_is_added(env):
    # GOMP_SPINCOUNT would override a wait policy the user chose: it is set only with ours.
    expected = {"policy": env.get("OMP_WAIT_POLICY"), "spin": env.get("GOMP_SPINCOUNT"), "too_late": False}
    assert probe(**env) == expected


def test_torch_imported_first_is_noticed():
    # OpenMP has read its settings by then: a job warns once (posttrain.job.warn_if_threads_spin).
    assert probe(first="import torch")["too_late"] is True


def test_top_level_cluster_settings_reach_the_warm_starts():
    cfg = load_config("grpo", overrides=["cluster.cpus_per_worker=1"])
    assert cfg.cluster.cpus_per_worker == 1 and cfg.sft_warmup.cluster.cpus_per_worker == 1
    distill = load_config("distill", overrides=["cluster.cpus_per_worker=1"])
    assert distill.sft_warmup is None or distill.sft_warmup.cluster.cpus_per_worker == 1
    assert distill.teacher_warmup.cluster.cpus_per_worker == 1


def test_a_nested_jobs_own_cluster_setting_wins():
    cfg = load_config("grpo", overrides=["cluster.cpus_per_worker=1", "sft_warmup.cluster.cpus_per_worker=2"])
    assert cfg.cluster.cpus_per_worker == 1 and cfg.sft_warmup.cluster.cpus_per_worker == 2


@pytest.mark.parametrize("key", ["cluster.backend=local"])
def test_unset_keys_stay_unset_in_the_warm_start(key):
    cfg = load_config("grpo", overrides=[key])
    assert cfg.sft_warmup.cluster.backend == "local"
    assert cfg.sft_warmup.cluster.cpus_per_worker is None  # nothing set at the top, nothing inherited
