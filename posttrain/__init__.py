"""posttrain: scalable RL post-training for language models.

Kept import-light on purpose: `posttrain --help` and config errors must answer in about a
second, so torch, transformers and ray are imported only inside the modules that need them.
"""

import os as _os
import sys as _sys

from posttrain.version import __version__

# OpenMP threads that spin while they wait for work make every parallel region wait for a thread
# the OS has not scheduled when other processes hold the cores: a 2-thread training step went from
# 0.32 s to 5.1 s beside a CPU hog, and stays at 0.74 s with passive waiting (docs/performance.md,
# "A busy machine"; benchmarks/busy_machine.py). Sleeping at once costs too: a decode step of a 135M
# model launches hundreds of small parallel regions, and waking a sleeping thread for each made it
# 1.6x slower (58 ms against 36). So threads wait passively, after a short bounded spin of GNU
# OpenMP's (GOMP_SPINCOUNT, about 0.1 ms; none while more OpenMP threads exist than cores, which
# `posttrain.utils.openmp.release_thread_team` keeps rare). OpenMP reads these once, when torch
# loads it, so they are set here, before anything of ours imports torch; a value of the user's own
# for either wins, and Ray workers get the same (posttrain.distributed.ray_utils).
OMP_WAIT_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}
_USER_SET_OMP_WAIT = any(name in _os.environ for name in OMP_WAIT_DEFAULTS)
OMP_WAIT_POLICY_SET_TOO_LATE = not _USER_SET_OMP_WAIT and "torch" in _sys.modules
if not _USER_SET_OMP_WAIT:
    _os.environ.update(OMP_WAIT_DEFAULTS)

# The Python API (`posttrain.api`).
API_NAMES = ("GRPO", "PPO", "SFT", "DPO", "RewardModel", "Distill", "evaluate", "TrainResult")
__all__ = [*API_NAMES, "__version__"]


def __getattr__(name: str):
    """`from posttrain import GRPO, SFT, ...` (the Python API, `posttrain.api`), imported on first use."""
    if name in API_NAMES:
        from posttrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
