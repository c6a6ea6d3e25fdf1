"""Shared pytest fixtures.

Ray in tests
------------
* Use the `ray_cluster` fixture for anything that needs Ray. It starts one local Ray cluster with
  `RAY_TEST_CPUS` logical CPUs (more than the 2 physical cores on purpose: actors mostly wait)
  on first use and reuses it for the whole session; Ray is shut down once at the end.
* Worker processes get `WORKER_ENV` (one math thread each) so N actors do not oversubscribe the
  cores.
* A test module that needs a differently shaped Ray (e.g. the simulated two-node cluster of
  `tests/functional/test_worker_group_multinode.py`) uses a module-scoped fixture that calls
  `stop_test_ray()` first, builds its own cluster, and calls `restore_test_ray()` at the end.
  Such a module must not also use `ray_cluster` (or fixtures built on it): both would want Ray.
* Create actors and clusters in module- or function-scoped fixtures and shut them down in the
  fixture teardown, so nothing leaks from one module into the next.
"""

from __future__ import annotations

import sys

import pytest

RAY_TEST_CPUS = 8
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

_session_ray_wanted = False  # True once a test asked for the session Ray


def start_test_ray() -> None:
    """Start (or reuse) the session's local Ray cluster."""
    from posttrain.distributed.ray_utils import init_ray

    init_ray(num_cpus=RAY_TEST_CPUS, env_vars=WORKER_ENV)


def stop_test_ray() -> None:
    """Shut down whatever Ray this process is connected to (no-op if none)."""
    if "ray" in sys.modules:
        from posttrain.distributed.ray_utils import shutdown_ray

        shutdown_ray()


def restore_test_ray() -> None:
    """After a module used its own Ray: bring the session Ray back if tests had been using it."""
    stop_test_ray()
    if _session_ray_wanted:
        start_test_ray()


@pytest.fixture(scope="session")
def ray_cluster():
    """Local Ray cluster with `RAY_TEST_CPUS` logical CPUs, shared by the whole session."""
    global _session_ray_wanted
    _session_ray_wanted = True
    start_test_ray()
    yield
    stop_test_ray()
