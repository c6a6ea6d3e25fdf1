"""Starting (or joining) Ray the way posttrain needs it.

One call, `init_ray`, used by the CLI, the algorithms and the tests. It is idempotent, keeps Ray
quiet (no dashboard, warnings only, no usage-stats ping) and makes every actor import the same
code as the driver by passing the driver's import path on as `PYTHONPATH`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

import ray

logger = logging.getLogger(__name__)

# Quiet defaults, set before Ray starts so its own processes see them; a user's value wins.
_RAY_ENV_DEFAULTS = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage-stats prompt or network call
    "RAY_DEDUP_LOGS": "1",  # "[repeated Nx across cluster]" instead of N copies of a log line
    # One "Loading weights" bar per worker and model interleaves with the run's own progress bar.
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    # Ray starts its workers at nice 15, to keep its own daemons responsive. posttrain's workers are
    # the job (training, generation): beside any other work at nice 0 they got a few percent of the
    # CPU and a run or the test suite crawled (seen: one functional test module 10x slower beside two
    # busy loops). Workers run at the driver's priority; `nice posttrain ...` still lowers them all.
    # Only a cluster this process starts: the raylet reads it at start-up.
    "RAY_worker_niceness": "0",
    # A cluster posttrain starts runs without the dashboard, so nothing reads the metrics its agents
    # collect (process accounting of the test suite: the dashboard agents' CPU fell by a third
    # without them). Nor does it prestart workers for the first driver: the job's actors start
    # when its groups are placed, and two idle workers cost 0.9 s of CPU a minute on 2 cores. Only
    # a cluster this process starts reads these: a joined cluster keeps its own settings.
    "RAY_enable_metrics_collection": "0",
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
}


def driver_pythonpath() -> str:
    """The driver's own import path (minus the interpreter's stdlib and site-packages).

    Ray workers start as fresh interpreters in the same venv; they already see installed
    packages but not directories the driver added at run time (the working tree, a test
    directory pytest put on `sys.path`). Classes defined there are pickled by reference, so
    the workers need the same entries to import them.
    """
    interpreter_dirs = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    entries: list[str] = []
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) + [os.getcwd()] + sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        resolved = Path(entry).resolve()
        if any(resolved == d or d in resolved.parents for d in interpreter_dirs):
            continue  # stdlib / site-packages: the worker interpreter has them already
        if str(resolved) not in entries:
            entries.append(str(resolved))
    return os.pathsep.join(entries)


def init_ray(
    address: str | None = None,
    num_cpus: float | None = None,
    num_gpus: int | None = None,
    env_vars: dict[str, str] | None = None,
) -> None:
    """Start a local Ray cluster or join an existing one; do nothing if Ray is already up.

    Args:
        address: Ray address to join (e.g. `"auto"` or `"10.0.0.1:6379"`); default None starts a
            new local cluster (never silently attaches to another user's `ray start` on the box).
        num_cpus: logical CPUs of the local cluster (default None: Ray counts the cores). It may
            exceed the physical cores: on CPU machines we run several small actors per core.
            Ignored when joining an existing cluster.
        num_gpus: GPUs of the local cluster (default None: Ray detects them). Ignored when joining.
        env_vars: extra environment variables for every worker process (e.g.
            `{"OMP_NUM_THREADS": "1"}`), on top of the driver's `PYTHONPATH`.
    """
    if ray.is_initialized():
        logger.debug("init_ray: Ray already initialised, reusing it")
        return
    for key, value in _RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)

    # OpenMP's wait settings and oneDNN's cache bound travel too: a joined cluster's workers were
    # not started by this process, so they would not inherit them (posttrain/__init__.py says why
    # they matter).
    from posttrain.utils.onednn import ONEDNN_DEFAULTS
    from posttrain.utils.openmp import OMP_WAIT_DEFAULTS

    worker_env = {"PYTHONPATH": driver_pythonpath()}
    worker_env.update({name: os.environ[name] for name in (*OMP_WAIT_DEFAULTS, *ONEDNN_DEFAULTS)
                       if name in os.environ})
    worker_env.update(env_vars or {})
    kwargs: dict = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    if address is None:
        _quiet_default_token_auth_notice()
        # A cluster this process starts gets the variables in the environment its raylet inherits,
        # and so every worker: a `runtime_env` would start each worker through Ray's
        # `setup_worker.py` first, 0.4 s more CPU per actor (measured on actors importing torch).
        with _environment(worker_env):
            ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, **kwargs)
        # The local cluster's processes must not outlive a killed controller (kill -9 included).
        from posttrain.distributed.reaper import start_reaper

        start_reaper()
    else:
        # A joined cluster's workers were not started by this process: the variables travel with
        # the job. Only a few chosen ones: a full copy of os.environ in runtime_env breaks Ray
        # (NeMo-RL issue #309).
        ray.init(address=address, runtime_env={"env_vars": worker_env}, **kwargs)


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """`os.environ` with `variables` set for the block, as it was afterwards."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _quiet_default_token_auth_notice() -> None:
    """Drop Ray's notice that a new local cluster uses token authentication (the safe default,
    printed on every start); warnings that authentication is *off* still show."""
    auth_logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropTokenAuthEnabledNotice) for f in auth_logger.filters):
        auth_logger.addFilter(_DropTokenAuthEnabledNotice())


class _DropTokenAuthEnabledNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


def shutdown_ray() -> None:
    """Disconnect from Ray (and stop the local cluster if this process started it), releasing the
    clusters parked for later jobs and the idle worker processes (`cluster_reuse.py`) first."""
    from posttrain.distributed import cluster_reuse

    cluster_reuse.release_idle()
    cluster_reuse.release_processes()
    if ray.is_initialized():
        ray.shutdown()
