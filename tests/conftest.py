"""Shared pytest fixtures.

Ray in tests
------------
* Use the `ray_cluster` fixture for anything that needs Ray. It starts one local Ray cluster with
  `RAY_TEST_CPUS` logical CPUs (more than the 2 physical cores on purpose: actors mostly wait)
  on first use and reuses it for the whole session; Ray is shut down once at the end. The suite
  runs in two pytest-xdist workers (`-n 2 --dist loadfile`, pyproject.toml): each worker is a
  session of its own with its own Ray cluster, and a test file runs whole on one worker.
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

import gc
import os
import shutil
import sys
import subprocess
import tempfile
from pathlib import Path

import pytest

import posttrain  # noqa: F401 - before any test module imports torch: its OpenMP threads then wait passively
from posttrain.cpu_precision import AUTO_CPU_PRECISION_VAR

RAY_TEST_CPUS = 8
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# The caches a test session owns (see `pytest_configure`): posttrain's, and Hugging Face's.
SESSION_CACHE_VARS = ("POSTTRAIN_CACHE", "HF_HOME")
# With pytest-xdist (`-n 2`, pyproject's addopts) the controller makes the session's cache and its
# workers share it: the cache's entries are built under file locks, so each is built once.
XDIST_SHARED_CACHE = "POSTTRAIN_TEST_SESSION_CACHE"
# The session's own state (the unit-failure flag), shared the same way but never kept: a cache kept
# across sessions (`POSTTRAIN_TEST_CACHE`) must not carry one session's failure into the next.
XDIST_SESSION_DIR = "POSTTRAIN_TEST_SESSION_DIR"


# ------------------------------------------------------------------ the session's own caches
def pytest_configure(config: pytest.Config) -> None:
    """The suite never reads or writes the user's caches: posttrain's cache and Hugging Face's point
    into one new directory per test session, shared by its tests (so the tiny models, warm starts
    and the vLLM environment are built once) and deleted when the session ends. Every build a test
    needs therefore runs as on a fresh machine. `POSTTRAIN_TEST_CACHE=DIR` keeps them in DIR
    instead, across sessions (a developer's shortcut; CI never sets it)."""
    keep = os.environ.get("POSTTRAIN_TEST_CACHE")
    shared = os.environ.get(XDIST_SHARED_CACHE)  # set by the controller of a parallel session (-n)
    root = os.path.abspath(keep or shared or tempfile.mkdtemp(prefix="posttrain-test-cache-"))
    config._session_cache = None if keep or shared else root  # removed at the end when it is ours
    os.environ[XDIST_SHARED_CACHE] = root  # pytest-xdist's workers, started after this, inherit it
    if XDIST_SESSION_DIR not in os.environ:
        config._session_dir = os.environ[XDIST_SESSION_DIR] = tempfile.mkdtemp(prefix="posttrain-test-session-")
    for var, sub in zip(SESSION_CACHE_VARS, ("posttrain", "huggingface")):
        os.environ[var] = os.path.join(root, sub)
    # The suite's numerical tolerances are float32's: `precision: auto` means float32 on every CPU
    # here (Ray workers inherit it), as on a CPU without bfloat16 matmuls; test_cpu_precision.py
    # checks what auto picks by the CPU.
    os.environ.setdefault(AUTO_CPU_PRECISION_VAR, "float32")


def start_building_the_vllm_env(config: pytest.Config, items: list[pytest.Item]) -> None:
    """When vLLM tests are selected, their isolated environment (a couple of minutes of pip on an
    empty cache) is built in the background from the start, through the same `ensure_vllm_env` a
    user's first run calls, while the unit tests run; the `vllm_python` fixture then waits on its
    build lock (a file lock) or finds it ready. A separate process, not a thread: the build imports
    ray and more, and a module imported on a second thread while a test tears down changes dicts
    (sys.modules, logging's loggers) that the main thread may be iterating. Niced, so the tests
    around it keep the cores. A failure here is not reported: the fixture builds again and raises
    the real error."""
    if not any(item.get_closest_marker("vllm") for item in items):
        return
    cache = Path(os.environ["POSTTRAIN_CACHE"])
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "vllm-env-background.log", "a") as log:
        config._vllm_env_builder = subprocess.Popen(
            [sys.executable, "-c",
             "from posttrain.models.generation.vllm_env import ensure_vllm_env\n"
             "ensure_vllm_env(use_gpu=False, log=lambda line: print(line, flush=True))"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(10))


def pytest_unconfigure(config: pytest.Config) -> None:
    builder = getattr(config, "_vllm_env_builder", None)
    if builder is not None:
        builder.wait()  # its pip must not write into the directory removed below
    for ours in (getattr(config, "_session_cache", None), getattr(config, "_session_dir", None)):
        if ours:
            shutil.rmtree(ours, ignore_errors=True)


# For the simulated multi-node clusters (`_system_config` of the head): Ray declares a lost node
# dead once its health checks fail. A killed node refuses them at once (dead in about 5 s here
# rather than half a minute); a live one starved of CPU on a busy 2-core host may answer late, so
# each check waits 5 s and it takes 5 failures in a row.
FAST_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 5000,
                      "health_check_failure_threshold": 5}


@pytest.fixture
def patient_shutdowns(monkeypatch):
    """Clean shutdowns bounded by 120 s instead of 5 s (`worker_group.SHUTDOWN_TIMEOUT_S`,
    `registry.ENV_SHUTDOWN_TIMEOUT_S`): processes are given back for reuse only after a clean
    shutdown within the bound, and a busy machine must not turn one into a kill where a test asserts
    that the processes came back."""
    from posttrain.distributed import worker_group
    from posttrain.environments import registry

    monkeypatch.setattr(worker_group, "SHUTDOWN_TIMEOUT_S", 120.0)
    monkeypatch.setattr(registry, "ENV_SHUTDOWN_TIMEOUT_S", 120.0)


def start_test_ray() -> None:
    """Start (or reuse) the session's local Ray cluster."""
    from posttrain.distributed.ray_utils import init_ray

    init_ray(num_cpus=RAY_TEST_CPUS, env_vars={**WORKER_ENV, **{var: os.environ[var] for var in SESSION_CACHE_VARS}})


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
    """Stop before the first functional test when a unit test failed; bring the session Ray back
    (lazily) for a test that wants it after a module stopped it."""
    if (not is_unit(item) and unit_tests_failed()
            and not item.config.getoption("--keep-going-after-unit-failures")):
        # `shouldstop`, not `pytest.exit`: an exit raised inside an xdist worker is an internal error.
        item.session.shouldstop = ("unit tests failed, so the functional tests were not run (pass "
                                   "--keep-going-after-unit-failures to run them anyway)")
        pytest.skip(item.session.shouldstop)
    if "ray_cluster" in item.fixturenames:
        from posttrain.distributed.cluster_reuse import reuse_clusters

        start_test_ray()  # no-op while Ray is up
        # Jobs run in this process hand their clusters and idle worker processes on to the next
        # (`cluster_reuse.py`): most job tests start no new worker process. Not in the modules that
        # test a cluster's own pool.
        reuse_clusters(item.get_closest_marker("own_process_pools") is None)


# ------------------------------------------------------------------ unit tests first, fail fast
def is_unit(item: pytest.Item) -> bool:
    return "/tests/unit/" in str(item.path).replace("\\", "/")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Unit tests run before functional ones (a stable sort: each group keeps its file order), so a
    broken pure function is reported in a minute or two, not after the functional tests."""
    items.sort(key=lambda item: not is_unit(item))
    skip_gpu_tests_without_enough_gpus(items)
    start_building_the_vllm_env(config, items)
    # What collection imported (the test modules, torch, transformers) lives to the session's end:
    # the collector's full walks skip it from now on (`posttrain.utils.startup_gc` says why).
    gc.freeze()


def skip_gpu_tests_without_enough_gpus(items: list[pytest.Item]) -> None:
    """The GPU smoke suite (`tests/gpu`, run on a machine with 2 GPUs as `./run.sh pytest tests/gpu`):
    each test that wants more GPUs than this machine has (its `gpus` marker; 1 when absent) is
    skipped with the reason in one line. Here, not in a tests/gpu/conftest.py: a second module
    named `conftest` would shadow this one for the tests that import it."""
    gpu_items = [item for item in items if "/tests/gpu/" in str(item.path).replace("\\", "/")]
    if not gpu_items:
        return
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in gpu_items:
        marker = item.get_closest_marker("gpus")
        needed = marker.args[0] if marker else 1
        if available < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s), found {available}"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.failed and is_unit(item):
        unit_failed_flag().touch()  # seen by every xdist worker of the session
    return report


def unit_failed_flag() -> Path:
    return Path(os.environ[XDIST_SESSION_DIR]) / "unit-tests-failed"


def unit_tests_failed() -> bool:
    """A unit test failed in this process or in another worker of the session (with `-n`, a worker
    may start the functional files while the other still runs the last unit files)."""
    return unit_failed_flag().exists()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--keep-going-after-unit-failures", action="store_true",
                     help="run the functional tests even when a unit test failed")
