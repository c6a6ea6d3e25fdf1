"""Jobs of one process taking over each other's clusters (`cluster_reuse.py`): a finished job's
cluster and idle worker processes serve the next job of the same shape, which then trains exactly
as in new processes; anything else asking for resources releases what is parked.

The session's Ray reuses clusters (tests/conftest.py), so other modules' jobs may have parked
some: each test asserts only on clusters and processes it made itself."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_grpo import _comparable, read_metrics, small_cfg

from posttrain.distributed import actors, cluster_reuse
from posttrain.distributed.cluster import VirtualCluster
from posttrain.distributed.worker_group import DistributedWorker, WorkerGroup

pytestmark = pytest.mark.functional


def _run_grpo(tmp_path: Path, *extra: str) -> tuple[list[str], list[VirtualCluster]]:
    """One small GRPO job to its end; the actor ids of its workers' processes and its clusters."""
    from posttrain.algorithms import grpo

    ctx = grpo.setup(small_cfg(tmp_path, "cluster.backend=ray", *extra))
    try:
        processes = [actors.actor_id(worker) for group in ctx.workers() for worker in group.worker_group.workers]
        clusters = list(ctx.clusters)
        grpo.grpo_train(ctx)
    finally:
        ctx.shutdown()
    return processes, clusters


def test_the_next_job_of_a_shape_takes_over_the_cluster_and_processes_and_trains_the_same(ray_cluster, tmp_path):
    # Two steps: the second generates with weights the first trained and refitted.
    first_processes, first_clusters = _run_grpo(tmp_path / "first", "grpo.max_num_steps=2")
    assert all(cluster.reservation_stands() for cluster in first_clusters)  # parked, not released
    second_processes, second_clusters = _run_grpo(tmp_path / "second", "grpo.max_num_steps=2")
    assert [id(c) for c in second_clusters] == [id(c) for c in first_clusters]
    # The same processes (policy and generation), though not always to the same group: a parked
    # cluster hands out first the process that went idle last.
    assert sorted(second_processes) == sorted(first_processes) and len(first_processes) >= 2
    # Nothing of the first job's members stayed in the processes: the same run, the same numbers.
    first, second = (_comparable(read_metrics(tmp_path / name / "logs")) for name in ("first", "second"))
    assert sorted(first) == [1, 2] and second == first

    # Another shape (generation on a cluster of its own) releases what is parked, and starts anew.
    third_processes, third_clusters = _run_grpo(tmp_path / "third", "grpo.max_num_steps=1",
                                                "policy.generation.colocated.enabled=false")
    assert not any(cluster.reservation_stands() for cluster in first_clusters)
    assert not set(third_processes) & set(first_processes)
    assert {c.name for c in third_clusters} == {"policy", "generation"}


class _Idle(DistributedWorker):
    pass


def _no_build() -> VirtualCluster:
    raise AssertionError("a parked cluster was expected")


def test_a_cluster_with_a_group_still_on_it_is_released_not_parked(ray_cluster):
    shape = ("reuse-test-open-group",)
    cluster = cluster_reuse.take(shape, lambda: VirtualCluster([1], name="open-group", reuse_worker_processes=True))
    group = WorkerGroup(cluster, _Idle, name="left-open")
    try:
        cluster.shutdown()  # the job forgot its group: the bundles are not free for the next job
        assert not cluster.reservation_stands()
        assert cluster_reuse.parked_count(shape) == 0
    finally:
        group.shutdown()


def test_a_parked_cluster_is_handed_out_once_and_released_by_another_reservation(ray_cluster):
    shape = ("reuse-test-parked",)
    cluster = cluster_reuse.take(shape, lambda: VirtualCluster([1], name="parked", reuse_worker_processes=True))
    group = WorkerGroup(cluster, _Idle, name="member")
    group.shutdown()
    cluster.shutdown()
    cluster.shutdown()  # twice: still parked once
    assert cluster.reservation_stands() and cluster.worker_hosts.count(0) == 1
    assert cluster_reuse.parked_count(shape) == 1
    assert cluster_reuse.take(shape, _no_build) is cluster
    assert cluster_reuse.parked_count(shape) == 0  # handed out: the next job of the shape builds its own
    cluster.shutdown()
    assert cluster_reuse.parked_count(shape) == 1

    other = VirtualCluster([1], name="another-shape")  # any new reservation releases what is parked
    try:
        assert not cluster.reservation_stands() and cluster.worker_hosts.count(0) == 0
        assert cluster_reuse.parked_count(shape) == 0
    finally:
        other.release()


def test_with_reuse_off_a_jobs_cluster_is_released(ray_cluster):
    cluster_reuse.reuse_clusters(False)
    try:
        shape = ("reuse-test-off",)
        cluster = cluster_reuse.take(shape, lambda: VirtualCluster([1], name="not-reused"))
        assert cluster.reuse_key is None
        cluster.shutdown()
        assert not cluster.reservation_stands()
    finally:
        cluster_reuse.reuse_clusters(True)
