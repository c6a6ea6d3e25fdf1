"""WorkerGroup across (simulated) Ray nodes: one worker per node, gloo all-reduce between them; a
lost node's worker moves to a live node with room when the group restarts, and without room the
restart says so in one line.

This module runs its own two-node Ray cluster: it stops the session Ray first and its own at the
end; the session Ray comes back for the next test that asks for it (see tests/conftest.py). It
must not use the `ray_cluster` fixture.
"""

from __future__ import annotations

import os
import time

import pytest
import ray
from conftest import FAST_HEALTH_CHECKS, WORKER_ENV, stop_test_ray
from ray.cluster_utils import Cluster

from posttrain.distributed.cluster import ClusterError, VirtualCluster
from posttrain.distributed.ray_utils import init_ray
from posttrain.distributed.worker_group import DistributedWorker, WorkerGroup

# The timeout is a hang guard, not a speed test: beside two CPU hogs this module ran 4-6x its quiet time.
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]


class NodeWorker(DistributedWorker):
    def local_rank_and_sum(self) -> tuple[str, float]:
        return os.environ["LOCAL_RANK"], self.all_reduce_sum(float(10 ** self.rank))


@pytest.fixture(scope="module")
def two_nodes():
    stop_test_ray()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "_system_config": FAST_HEALTH_CHECKS})
    nodes.add_node(num_cpus=2)
    nodes.wait_for_nodes()
    init_ray(address=nodes.address, env_vars=WORKER_ENV)
    yield nodes
    stop_test_ray()
    nodes.shutdown()


def test_one_worker_per_node_and_all_reduce_across(two_nodes):
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    cluster = VirtualCluster([1, 1], name="twonode")
    group = WorkerGroup(cluster, NodeWorker, name="spread")
    try:
        node_ids = group.run_all("get_node_id")
        assert node_ids[0] != node_ids[1]
        assert cluster.bundle_node_ids() == node_ids
        # Each worker is alone on its node, so both have LOCAL_RANK 0; 10**0 + 10**1 = 11.
        assert group.run_all("local_rank_and_sum") == [("0", 11.0), ("0", 11.0)]
    finally:
        group.shutdown()
        cluster.shutdown()


def test_the_rendezvous_address_is_read_here_on_this_node_and_by_a_task_on_another(two_nodes, monkeypatch):
    """A bundle on the driver's own node gets its address and port without a Ray task (which may
    start a worker process); a bundle on another node gets that node's, from a task there."""
    from posttrain.distributed import cluster as cluster_module

    cluster = VirtualCluster([1, 1], name="rendezvous")
    try:
        here = ray.get_runtime_context().get_node_id()
        local, remote = sorted(range(2), key=lambda b: cluster.bundle_node_ids()[b] != here)
        assert cluster.bundle_node_ids()[local] == here != cluster.bundle_node_ids()[remote]
        tasks = []
        real = cluster_module._address_and_free_port_on_node

        class CountingTask:
            def options(self, **kwargs):
                tasks.append(kwargs["scheduling_strategy"].placement_group_bundle_index)
                return real.options(**kwargs)

        monkeypatch.setattr(cluster_module, "_address_and_free_port_on_node", CountingTask())
        (address, port), (other_address, other_port) = (cluster.master_address_and_port(b) for b in (local, remote))
        assert tasks == [0]  # the other node's only placement group has one bundle: index 0
        address_of = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        assert address == address_of[here] and other_address == address_of[cluster.bundle_node_ids()[remote]]
        assert 0 < port < 65536 and 0 < other_port < 65536
    finally:
        cluster.shutdown()


def wait_for_faults(group: WorkerGroup) -> list:
    deadline = time.monotonic() + 120
    while not (faults := group.faults()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return faults


def test_a_lost_nodes_worker_moves_to_a_live_node_with_room_else_the_restart_says_why(two_nodes):
    # Two more nodes with a custom `slot` (the others have none): the group's one worker sits on one
    # of them, and once that node is lost it can only move to the other.
    spares = [two_nodes.add_node(num_cpus=1, resources={"slot": 1}) for _ in range(2)]
    two_nodes.wait_for_nodes()
    cluster = VirtualCluster([1], name="movable", bundle_resources={"slot": 1})
    group = WorkerGroup(cluster, NodeWorker, name="movable")
    try:
        first = group.run_all("get_node_id")[0]
        lost, other = sorted(spares, key=lambda node: node.node_id != first)
        assert lost.node_id == first
        two_nodes.remove_node(lost, allow_graceful=False)  # like a crash: SIGKILL
        (rank, cause, lost_ip), = wait_for_faults(group)
        assert (rank, cause) == (0, f"was lost with its node {lost_ip}")

        group.restart()
        assert group.run_all("get_node_id") == [other.node_id] == cluster.bundle_node_ids()
        assert group.run_all("local_rank_and_sum") == [("0", 1.0)]

        two_nodes.remove_node(other, allow_graceful=False)  # no live node has a slot now
        assert wait_for_faults(group)
        with pytest.raises(ClusterError, match=r"^VirtualCluster 'movable' lost node\(s\) .* and the remaining nodes "
                                               r"cannot hold its 1 node group\(s\) there: slot: asked 1, the cluster has 0$"):
            group.restart()
    finally:
        group.shutdown()
        cluster.shutdown()
