"""Clusters that outlive their jobs: one process running job after job on the same Ray (a test
session, a sweep through the Python API) hands a finished job's `VirtualCluster`, with its idle
worker processes (`worker_host.py`), to the next job that asks for the same shape.

Why: a job's cluster releases its placement groups when the job ends, and Ray ends every actor
placed in them, so each job started its worker processes again: seconds of CPU each for the
imports alone (`worker_host.py`), more than the steps of a small job. With reuse on
(`reuse_clusters()`, off by default), `job.make_cluster` asks `take` for an idle cluster of the
same shape first; the job's `VirtualCluster.shutdown` asks `keep` to park it instead of releasing
it. A cluster is parked only when every worker group placed on it was shut down (a group that saw
a failure has already killed its processes, so a failure never carries over), and only while Ray
is up.

Parked clusters hold their reservation. Any other reservation (a cluster of another shape, of
this job or the next) first releases every parked one (`release_idle`), so they never stand in
the way of a request; `shutdown_ray` releases them before Ray stops.

Environment actors are reused the same way, whatever the shape: with reuse on, `create_env`
builds a Ray environment actor inside a `WorkerHost` (`hosted_environment`), and an environment
that shut down cleanly leaves its process idle (`keep_environment_process`) for the next job's
environments, of any class. Those processes reserve no CPU (an environment actor's `num_cpus` is
0), so they stay when clusters are released; at most `MAX_IDLE_ENVIRONMENT_PROCESSES` wait, and
`release_environment_processes` (turning reuse off, `shutdown_ray`) ends them.
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
_environment_hosts: Optional[Any] = None  # idle environment processes (worker_host.HostPool), made on first use

# Idle environment processes kept at most (each holds ~0.3 GB: torch and the environment's modules).
MAX_IDLE_ENVIRONMENT_PROCESSES = 8
# What an environment actor reserves (`create_env`'s default); only such actors are hosted.
_ENVIRONMENT_RESOURCES = {"num_cpus": 0.0}


def reuse_clusters(enabled: bool = True) -> None:
    """Let later jobs of this process take over the clusters of finished ones (default off: a job
    releases its reservation when it ends). Turning it off releases what is parked."""
    global _enabled
    _enabled = enabled
    if not enabled:
        release_idle()
        release_environment_processes()


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


# ------------------------------------------------------------------ environment processes
def hosted_environment(actor_cls: type, cfg: Any) -> Any:
    """`actor_cls(cfg)` built in a reusable process: an idle one left by an earlier environment
    when there is one, else a new `WorkerHost` reserving no CPU. Returns the `HostedWorker` that
    stands for the environment's actor handle (`handle.step.remote(...)`). Its construction is not
    waited for: a constructor that raised is reported by the first call."""
    from posttrain.distributed.worker_host import HostedWorker, HostPool, remote_host_class

    global _environment_hosts
    with _lock:
        if _environment_hosts is None or _environment_hosts.closed:
            _environment_hosts = HostPool()
        pool = _environment_hosts
    host = _take_live(pool) or remote_host_class().options(**_ENVIRONMENT_RESOURCES).remote()
    environment = HostedWorker(host, None, _ENVIRONMENT_RESOURCES)
    # Positional, as Ray's `actor_cls.remote(cfg)` passes it: an environment names its argument as it likes.
    environment.construct(functools.partial(actor_cls, cfg), {}, {})
    return environment


def _take_live(pool: Any) -> Optional[Any]:
    """An idle host of `pool` that Ray knows as alive (one of a Ray that was restarted meanwhile is
    unknown to the new one, and dropped)."""
    import ray._private.state as ray_state

    while (host := pool.take(None, _ENVIRONMENT_RESOURCES)) is not None:
        if (ray_state.actors(actor_id=host._actor_id.hex()) or {}).get("State") == "ALIVE":
            return host
    return None


def may_keep_environment_process(environment: Any) -> bool:
    """Whether `environment`'s process could be kept at its shutdown (`keep_environment_process`):
    a hosted environment, reuse on, and room among the idle processes."""
    from posttrain.distributed.worker_host import HostedWorker

    pool = _environment_hosts
    return (_enabled and pool is not None and isinstance(environment, HostedWorker) and environment.bundle is None
            and pool.count(None) < MAX_IDLE_ENVIRONMENT_PROCESSES)


def keep_environment_process(environment: Any, timeout_s: float) -> bool:
    """Keep the process of `environment` (a `HostedWorker` whose `shutdown` returned) for the next
    environments, once it has freed the environment object; False when it must be killed instead:
    not a hosted environment, reuse is off, enough processes wait already, or the object stayed
    referenced (a thread of it still runs, say)."""
    if not may_keep_environment_process(environment):
        return False
    return _environment_hosts.take_back([environment], [], timeout_s)


def release_environment_processes() -> int:
    """End every idle environment process; how many."""
    global _environment_hosts
    with _lock:
        pool, _environment_hosts = _environment_hosts, None
    if pool is None:
        return 0
    count = pool.count(None)
    pool.close()
    return count


def idle_environment_processes() -> int:
    """Environment processes waiting for the next environments."""
    pool = _environment_hosts
    return 0 if pool is None else pool.count(None)
