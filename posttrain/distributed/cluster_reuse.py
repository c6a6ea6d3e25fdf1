"""Clusters and processes that outlive their jobs: one process running job after job on the same
Ray (a test session, a sweep through the Python API) hands a finished job's `VirtualCluster` to the
next job that asks for the same shape, and its idle worker processes (`worker_host.py`) to the
next members of any job, cluster or environment.

Why: each job used to start its worker processes again, seconds of CPU each for the imports alone
(`worker_host.py`), more than the steps of a small job. With reuse on (`reuse_clusters()`, off by
default), `job.make_cluster` asks `take` for an idle cluster of the same shape first; the job's
`VirtualCluster.shutdown` asks `keep` to park it instead of releasing it. A cluster is parked only
when every worker group placed on it was shut down (a group that saw a failure has already killed
its processes, so a failure never carries over), and only while Ray is up.

Parked clusters hold their reservation. Any other reservation (a cluster of another shape, of
this job or the next) first releases every parked one (`release_idle`), so they never stand in
the way of a request; `shutdown_ray` releases them before Ray stops.

The processes are not the clusters': with reuse on, every cluster's members and every
environment actor (`create_env` builds one inside a `WorkerHost`, `hosted_environment`) live in
processes of one pool per process (`process_pool`), which reserve no Ray resources themselves
(`worker_host.py`). So a released cluster leaves its idle processes to the next job whatever its
shape, and a policy worker may start in the process an environment left, or the other way round.
At most `MAX_IDLE_PROCESSES` wait (beyond, the one idle longest is ended); `release_processes`
(turning reuse off, `shutdown_ray`) ends them.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from typing import Any, Callable, Hashable, Mapping, Optional

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_enabled = False
_idle: dict[Hashable, list[Any]] = {}  # shape -> parked clusters (VirtualCluster)
_processes: Optional[Any] = None  # idle worker and environment processes (worker_host.HostPool), made on first use

# Idle processes kept at most (each holds about 0.55 GB resident: torch, transformers, its last member's modules).
MAX_IDLE_PROCESSES = 8


def reuse_clusters(enabled: bool = True) -> None:
    """Let later jobs of this process take over the clusters of finished ones (default off: a job
    releases its reservation when it ends). Turning it off releases what is parked."""
    global _enabled
    _enabled = enabled
    if not enabled:
        release_idle()
        release_processes()


def reusing() -> bool:
    return _enabled


def shape_key(shape: Mapping[str, Any]) -> str:
    """The parking key of a cluster shape (`VirtualCluster`'s arguments): equal shapes give equal
    keys whatever the order their dicts were written in (a `bundle_resources` mapping, say)."""
    return json.dumps(shape, sort_keys=True, default=repr)


def take(key: Hashable, build: Callable[[], Any]) -> Any:
    """A parked cluster of shape `key` whose placement groups still stand, else `build()` (whose
    cluster is then parked at its shutdown). `build` runs with nothing parked: what is parked
    would otherwise hold resources the new reservation may need."""
    if not _enabled:
        return build()
    while True:
        with _lock:
            parked = _idle.get(key)
            cluster = parked.pop() if parked else None
        if cluster is None:
            break
        if cluster.reservation_stands():
            logger.debug("reusing parked cluster %r", cluster)
            return cluster
        cluster.release()  # Ray restarted meanwhile, or its groups were removed: a new one
    cluster = build()
    cluster.reuse_key = key
    return cluster


def keep(cluster: Any) -> bool:
    """Park `cluster` (at its job's shutdown) for the next job of its shape; False when it must be
    released instead: reuse is off, it was not made by `take`, or a worker group still holds
    bundles of it."""
    key = getattr(cluster, "reuse_key", None)
    if not _enabled or key is None or cluster.open_groups() or not cluster.reservation_stands():
        return False
    with _lock:
        parked = _idle.setdefault(key, [])
        if not any(other is cluster for other in parked):  # shut down twice: parked once
            parked.append(cluster)
    return True


def release_idle() -> int:
    """Release every parked cluster (kill its idle processes, remove its placement groups); how many."""
    with _lock:
        parked = [cluster for clusters in _idle.values() for cluster in clusters]
        _idle.clear()
    for cluster in parked:
        cluster.release()
    return len(parked)


def parked_count(key: Hashable = None) -> int:
    """Clusters parked under shape `key` (default None: under any shape)."""
    with _lock:
        return sum(len(clusters) for shape, clusters in _idle.items() if key is None or shape == key)


# ------------------------------------------------------------------ processes
def process_pool() -> Optional[Any]:
    """The pool of idle worker processes that jobs and environments share (a `worker_host.HostPool`);
    None while reuse is off."""
    from posttrain.distributed.worker_host import HostPool

    global _processes
    if not _enabled:
        return None
    with _lock:
        if _processes is None or _processes.closed:
            _processes = HostPool(max_idle=MAX_IDLE_PROCESSES)
        return _processes


def hosted_environment(actor_cls: type, cfg: Any) -> Any:
    """`actor_cls(cfg)` built in a reusable process (`process_pool`: an idle one when there is one,
    else a new `WorkerHost`). Returns the `HostedWorker` that stands for the environment's actor
    handle (`handle.step.remote(...)`). Its construction is not waited for: a constructor that
    raised is reported by the first call."""
    environment = process_pool().host()
    # Positional, as Ray's `actor_cls.remote(cfg)` passes it: an environment names its argument as it likes.
    environment.construct(functools.partial(actor_cls, cfg), {}, {})
    return environment


def may_keep_environment_process(environment: Any) -> bool:
    """Whether `environment`'s process could be kept at its shutdown (`keep_environment_process`):
    a hosted environment of the pool that stands, with reuse on."""
    from posttrain.distributed.worker_host import HostedWorker

    return (_enabled and isinstance(environment, HostedWorker) and environment.pool is _processes
            and not environment.pool.closed)


def keep_environment_process(environment: Any, timeout_s: float) -> bool:
    """Keep the process of `environment` (a `HostedWorker` whose `shutdown` returned) for later
    members, once it has freed the environment object; False when it must be killed instead:
    not a hosted environment, reuse is off, or the object stayed referenced (a thread of it still
    runs, say)."""
    if not may_keep_environment_process(environment):
        return False
    return bool(environment.pool.take_back([environment], [], timeout_s))


def release_processes() -> int:
    """End every idle process of the pool; how many."""
    global _processes
    with _lock:
        pool, _processes = _processes, None
    return 0 if pool is None else pool.close()


def idle_processes() -> int:
    """Processes waiting for the next members (workers or environments)."""
    pool = _processes
    return 0 if pool is None else pool.count()
