"""Expert parallelism (`policy.expert_parallel_size`) on CPU over gloo, with real Ray workers: the
experts of the tiny Qwen3-MoE and DeepSeek-V3 presets split over 2 ranks (tokens dispatched and
combined by all-to-all), alone and as 2 EP x 2 data-parallel replicas, give one worker's
logprobs, losses, gradient norms (clipped SGD steps), reference logprobs and weights after two
train calls of two optimizer steps each.

Tolerances (expert_parallel.py's module doc): float32; EP changes only the order in which a
token's expert outputs are summed: 1e-5 relative on logprobs, losses and gradient norms, 1e-6
absolute on weights, as test_tensor_parallel.py allows.
"""

from __future__ import annotations

import pytest
from test_tensor_parallel import assert_same_run, policy_cfg, run

from posttrain.distributed.cluster import VirtualCluster

# The timeout is a hang guard, not a speed test.
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    cluster = VirtualCluster([4], max_colocated_worker_groups=2)
    yield cluster
    cluster.shutdown()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_ep2_equals_one_worker(cluster, arch):
    """Two workers, each holding half the experts of every MoE layer and its own rows."""
    model = f"tiny-{arch}"
    one = run(cluster, policy_cfg(model_name=model), f"ep1_{arch}")
    ep2 = run(cluster, policy_cfg(model_name=model, num_workers=2, expert_parallel_size=2), f"ep2_{arch}")
    assert_same_run(ep2, one)
    if arch == "qwen3_moe":  # the router's load-balancing loss is in the loss, from each rank's own tokens
        assert ep2["metrics"][0]["router_aux_loss"] == pytest.approx(one["metrics"][0]["router_aux_loss"], rel=1e-5)


def test_ep2_dp2_equals_one_worker(cluster):
    """Four workers: two EP groups of two (experts split within each, replicated across them)."""
    model = "tiny-qwen3_moe"
    one = run(cluster, policy_cfg(model_name=model), "ep1_dp")
    ep2_dp2 = run(cluster, policy_cfg(model_name=model, num_workers=4, expert_parallel_size=2), "ep2_dp2")
    assert_same_run(ep2_dp2, one)
