"""An OS-level sandbox for untrusted programs (model-written code): see `runner`."""

from posttrain.environments.sandbox import cgroup
from posttrain.environments.sandbox.runner import (
    Limits, SandboxUnavailable, memory_enforcement, mode_problem, resolve_mode, run_tests,
)

__all__ = ["Limits", "SandboxUnavailable", "cgroup", "memory_enforcement", "mode_problem", "resolve_mode", "run_tests"]
