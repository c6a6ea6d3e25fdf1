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
  `stop_test_ray()` first, builds its own cluster, and calls `stop_test_ray()` again at the end;
  the next test that uses `ray_cluster` restarts the session Ray (see `pytest_runtest_setup`).
  Such a module must not also use `ray_cluster` (or fixtures built on it): both would want Ray.
* Create actors and clusters in module- or function-scoped fixtures and shut them down in the
  fixture teardown, so nothing leaks from one module into the next.
"""

from __future__ import annotations

import sys

import pytest

import posttrain  # noqa: F401 - before any test module imports torch: its OpenMP threads then wait passively

RAY_TEST_CPUS = 8
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def start_test_ray() -> None:
    """Start (or reuse) the session's local Ray cluster."""
    from posttrain.distributed.ray_utils import init_ray

    init_ray(num_cpus=RAY_TEST_CPUS, env_vars=WORKER_ENV)


def stop_test_ray() -> None:
    """Shut down whatever Ray this process is connected to (no-op if none)."""
    if "ray" in sys.modules:
        from posttrain.distributed.ray_utils import shutdown_ray

        shutdown_ray()


@pytest.fixture(scope="session")
def ray_cluster():
    """Local Ray cluster with `RAY_TEST_CPUS` logical CPUs, shared by the whole session."""
    start_test_ray()
    yield
    stop_test_ray()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Bring the session Ray back (lazily) for a test that wants it after a module stopped it."""
    if "ray_cluster" in item.fixturenames:
        start_test_ray()  # no-op while Ray is up
