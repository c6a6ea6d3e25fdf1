"""WorkerGroup across two (simulated) Ray nodes: one worker per node, gloo all-reduce between them.

This module runs its own two-node Ray cluster: it stops the session Ray first and its own at the
end; the session Ray comes back for the next test that asks for it (see tests/conftest.py). It
must not use the `ray_cluster` fixture.
"""

from __future__ import annotations

import os

import pytest
import ray
from conftest import WORKER_ENV, stop_test_ray
from ray.cluster_utils import Cluster

from posttrain.distributed.cluster import VirtualCluster
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
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
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
