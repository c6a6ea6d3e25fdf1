"""Context parallelism (`policy.context_parallel_size`) on CPU over gloo, with real Ray workers: a
CP group of two gives the logprobs, losses, gradient norms and updated weights of one worker
(`models/policy/context_parallel.py`). The batch, the two clipped-SGD train calls and the
tolerances are those of `test_tensor_parallel.py` (1e-5 relative, 1e-6 absolute on weights):
CP changes only the order of the sums (attention blocks merged by log-sum-exp, the gradient summed
over the CP ranks by FSDP's reduce-scatter)."""

from __future__ import annotations

import pytest

from posttrain.distributed.cluster import VirtualCluster
from test_tensor_parallel import assert_same_run, make_batch, policy_cfg, run, run_one_worker

pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    cluster = VirtualCluster([4], max_colocated_worker_groups=2, reuse_worker_processes=True)  # worker_host.py
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def one_worker():
    return run_one_worker(policy_cfg(), "cp1")


def test_cp2_equals_one_worker(cluster, one_worker):
    """Two workers in one CP group (each holds half of every row's tokens, rows of 3-16 tokens padded
    to multiples of 4; the fused logprob head, the default): the run of one worker, with the counts
    not doubled although both ranks see all rows."""
    cp2 = run(cluster, policy_cfg(num_workers=2, context_parallel_size=2), "cp2")
    assert_same_run(cp2, one_worker)
    mask = make_batch()["token_mask"][:, 1:] * make_batch()["sample_mask"][:, None]
    assert cp2["metrics"][0]["global_valid_toks"] == mask.sum().item()


def test_cp2_by_tp2_with_sequence_parallel_equals_one_worker(cluster, one_worker):
    """Four workers as the mesh (dp 1, cp 2, tp 2) with sequence parallelism: each CP rank's half
    of the tokens goes through a TP pair (the ring runs per head shard; between the blocks each TP
    rank keeps a quarter of the row, rows padded to multiples of 8): one worker's run again."""
    cp2_tp2 = run(cluster, policy_cfg(num_workers=4, context_parallel_size=2, tensor_parallel_size=2,
                                      sequence_parallel=True), "cp2_tp2_sp")
    assert_same_run(cp2_tp2, one_worker)
    mask = make_batch()["token_mask"][:, 1:] * make_batch()["sample_mask"][:, None]
    assert cp2_tp2["metrics"][0]["global_valid_toks"] == mask.sum().item()


def test_cp2_with_packed_rows_and_checkpointed_activations_equals_one_worker(cluster, one_worker):
    """Sequence packing under CP: bins of <= 20 tokens (several rows in one `[1, T]` row, which the
    CP ranks split like any row; the ring's blocks stay within each sequence and rotary positions
    restart with it), with activation checkpointing recomputing the ring in backward."""
    packing = dict(enabled=True, train_mb_tokens=20, logprob_mb_tokens=20)
    cfg = policy_cfg(num_workers=2, context_parallel_size=2, sequence_packing=packing, activation_checkpointing=True)
    assert_same_run(run(cluster, cfg, "cp2_packed"), one_worker)


def test_gemma3_cp2_equals_one_worker(cluster):
    """Gemma 3 (`tiny-gemma3`: rows of up to 16 tokens run past its sliding-window layer's 8
    positions) in one CP group of two: the ring cut to the window gives one worker's run."""
    one = run_one_worker(policy_cfg(model_name="tiny-gemma3"), "gemma3_cp1")
    cp2 = run(cluster, policy_cfg(model_name="tiny-gemma3", num_workers=2, context_parallel_size=2), "gemma3_cp2")
    assert_same_run(cp2, one)
