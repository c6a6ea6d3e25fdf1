"""posttrain: scalable RL post-training for language models.

Kept import-light on purpose: `posttrain --help` and config errors must answer in about a
second, so torch, transformers and ray are imported only inside the modules that need them.
"""

import os as _os
import sys as _sys

from posttrain.version import __version__

# Full collections wait until the process has imported what it needs (posttrain.utils.startup_gc
# says why); first, so that torch's and transformers' imports are covered.
from posttrain.utils.startup_gc import defer_full_collections as _defer_full_collections

_defer_full_collections()

# How OpenMP threads wait (posttrain.utils.openmp says why): OpenMP reads it once, when torch loads
# it, so it is set here, before anything of ours imports torch; a value of the user's own for either
# variable wins (and then neither is set), and Ray workers get the same (distributed.ray_utils).
from posttrain.utils.openmp import OMP_WAIT_DEFAULTS as _OMP_WAIT_DEFAULTS

_USER_SET_OMP_WAIT = any(name in _os.environ for name in _OMP_WAIT_DEFAULTS)
OMP_WAIT_POLICY_SET_TOO_LATE = not _USER_SET_OMP_WAIT and "torch" in _sys.modules
if not _USER_SET_OMP_WAIT:
    _os.environ.update(_OMP_WAIT_DEFAULTS)

# How many compiled kernels oneDNN keeps (posttrain.utils.onednn says why): bounded, unless the
# user set it.
from posttrain.utils.onednn import ONEDNN_DEFAULTS as _ONEDNN_DEFAULTS

for _name, _value in _ONEDNN_DEFAULTS.items():
    _os.environ.setdefault(_name, _value)

# The Python API (`posttrain.api`).
API_NAMES = ("GRPO", "PPO", "SFT", "DPO", "RewardModel", "Distill", "evaluate", "TrainResult")
__all__ = [*API_NAMES, "__version__"]


def __getattr__(name: str):
    """`from posttrain import GRPO, SFT, ...` (the Python API, `posttrain.api`), imported on first use."""
    if name in API_NAMES:
        from posttrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
