"""Context parallelism (`policy.context_parallel_size`) on CPU over gloo, with real Ray workers: a
CP group of two gives the logprobs, losses, gradient norms and updated weights of one worker
(`models/policy/context_parallel.py`). The batch, the two clipped-SGD train calls and the
tolerances are those of `test_tensor_parallel.py` (1e-5 relative, 1e-6 absolute on weights):
CP changes only the order of the sums (attention blocks merged by log-sum-exp, the gradient summed
over the CP ranks by FSDP's reduce-scatter)."""

from __future__ import annotations

import pytest

from posttrain.distributed.cluster import VirtualCluster
from test_tensor_parallel import assert_same_run, make_batch, policy_cfg, run

pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    cluster = VirtualCluster([2], max_colocated_worker_groups=2)
    yield cluster
    cluster.shutdown()


def test_cp2_equals_one_worker(cluster):
    """Two workers in one CP group (each holds half of every row's tokens, rows of 3-16 tokens padded
    to multiples of 4; the fused logprob head, the default): the run of one worker, with the counts
    not doubled although both ranks see all rows."""
    one = run(cluster, policy_cfg(), "cp1")
    cp2 = run(cluster, policy_cfg(num_workers=2, context_parallel_size=2), "cp2")
    assert_same_run(cp2, one)
    mask = make_batch()["token_mask"][:, 1:] * make_batch()["sample_mask"][:, None]
    assert cp2["metrics"][0]["global_valid_toks"] == mask.sum().item()
