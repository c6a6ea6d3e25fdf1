"""An OS-level sandbox for untrusted programs (model-written code): see `runner`."""

from posttrain.environments.sandbox.runner import Limits, SandboxUnavailable, mode_problem, resolve_mode, run_tests

__all__ = ["Limits", "SandboxUnavailable", "mode_problem", "resolve_mode", "run_tests"]
