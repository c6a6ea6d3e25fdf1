"""posttrain: scalable RL post-training for language models.

Kept import-light on purpose: `posttrain --help` and config errors must answer in about a
second, so torch, transformers and ray are imported only inside the modules that need them.
"""

import os as _os
import sys as _sys

from posttrain.version import __version__

# OpenMP threads that spin while they wait for work make every parallel region wait for a thread
# the OS has not scheduled when other processes hold the cores: a 2-thread training step went from
# 0.32 s to 5.1 s beside a CPU hog, and stays at 0.74 s with passive waiting, which costs nothing on
# a quiet machine (docs/performance.md, "A busy machine"; benchmarks/busy_machine.py). OpenMP reads
# the variable once, when torch loads it, so it is set here, before anything of ours imports torch;
# the user's own setting wins, and Ray workers inherit it (posttrain.distributed.ray_utils).
OMP_WAIT_POLICY_DEFAULT = "PASSIVE"
OMP_WAIT_POLICY_SET_TOO_LATE = "OMP_WAIT_POLICY" not in _os.environ and "torch" in _sys.modules
_os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY_DEFAULT)

# The Python API (`posttrain.api`).
API_NAMES = ("GRPO", "PPO", "SFT", "DPO", "RewardModel", "Distill", "evaluate", "TrainResult")
__all__ = [*API_NAMES, "__version__"]


def __getattr__(name: str):
    """`from posttrain import GRPO, SFT, ...` (the Python API, `posttrain.api`), imported on first use."""
    if name in API_NAMES:
        from posttrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
