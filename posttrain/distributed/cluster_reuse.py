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
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable, Hashable, Mapping

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_enabled = False
_idle: dict[Hashable, list[Any]] = {}  # shape -> parked clusters (VirtualCluster)


def reuse_clusters(enabled: bool = True) -> None:
    """Let later jobs of this process take over the clusters of finished ones (default off: a job
    releases its reservation when it ends). Turning it off releases what is parked."""
    global _enabled
    _enabled = enabled
    if not enabled:
        release_idle()


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
