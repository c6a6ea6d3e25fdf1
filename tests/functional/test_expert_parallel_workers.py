"""Expert parallelism (`policy.expert_parallel_size`) on CPU over gloo, with real Ray workers: the
experts of the tiny Qwen3-MoE and DeepSeek-V3 presets split over 2 ranks (tokens dispatched and
combined by all-to-all), alone and as 2 EP x 2 data-parallel replicas, give one worker's
logprobs, losses, gradient norms (clipped SGD steps), reference logprobs and weights after two
train calls of two optimizer steps each; an EP=2 checkpoint resumes in one worker (EP=1) as the
EP=2 run went on; GRPO with EP=2 (and router replay) refits the native engine (expert shards
gathered) exactly.

Tolerances (expert_parallel.py's module doc): float32; EP changes only the order in which a
token's expert outputs are summed: 1e-5 relative on logprobs, losses and gradient norms, 1e-6
absolute on weights, as test_tensor_parallel.py allows.
"""

from __future__ import annotations

import pytest
import torch
from test_tensor_parallel import cluster  # noqa: F401 (the module-scoped fixture of 4 bundles)
from test_tensor_parallel import assert_same_run, make_batch, policy_cfg, run, run_one_worker, two_grpo_steps

from posttrain.algorithms.loss import ClippedPGLoss
from posttrain.config.schema import LossConfig
from posttrain.distributed.actors import LocalCluster
from posttrain.models.policy.policy import Policy

# The timeout is a hang guard, not a speed test.
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def one_worker():
    """One worker's run of each preset (in this process), computed once for the tests below."""
    runs: dict[str, dict] = {}

    def of(arch: str) -> dict:
        if arch not in runs:
            runs[arch] = run_one_worker(policy_cfg(model_name=f"tiny-{arch}"), f"ep1_{arch}")
        return runs[arch]
    return of


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_ep2_equals_one_worker_and_resumes_in_one(cluster, one_worker, arch, tmp_path):
    """Two workers, each holding half the experts of every MoE layer and its own rows (DeepSeek-V3
    with activation checkpointing); the DeepSeek-V3 checkpoint written after the first train call (experts as DTensor shards) loads into
    one worker, whose next train call and weights are the EP=2 run's second."""
    model = f"tiny-{arch}"
    one = one_worker(arch)
    # DeepSeek-V3 also checkpoints activations: the backward recomputes each layer, all-to-alls included.
    cfg = policy_cfg(model_name=model, num_workers=2, expert_parallel_size=2,
                     activation_checkpointing=arch == "deepseek_v3")
    ep2 = run(cluster, cfg, f"ep2_{arch}", tmp_path if arch == "deepseek_v3" else None)
    assert_same_run(ep2, one)
    if arch == "qwen3_moe":  # the router's load-balancing loss is in the loss, from each rank's own tokens
        assert ep2["metrics"][0]["router_aux_loss"] == pytest.approx(one["metrics"][0]["router_aux_loss"], rel=1e-5)
        return
    # The one worker runs in this process (the local backend): it only has to read the checkpoint.
    resumed = Policy(LocalCluster(), policy_cfg(model_name=model), init_reference_model=False,
                     weights_path=ep2["checkpoint"], name=f"ep1_resumed_{arch}")
    try:
        metrics = resumed.train(make_batch(), ClippedPGLoss(LossConfig()))
        weights = resumed.state_dict_for_export()
    finally:
        resumed.shutdown()
    for name in ("loss", "grad_norm"):
        assert metrics[name] == pytest.approx(ep2["metrics"][1][name], rel=1e-5), name
    for name, value in ep2["weights"].items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_ep2_dp2_equals_one_worker(cluster, one_worker):
    """Four workers: two EP groups of two (experts split within each, replicated across them)."""
    ep2_dp2 = run(cluster, policy_cfg(model_name="tiny-qwen3_moe", num_workers=4, expert_parallel_size=2), "ep2_dp2")
    assert_same_run(ep2_dp2, one_worker("qwen3_moe"))


def test_grpo_with_ep2_refits_the_native_engine_exactly(ray_cluster, tmp_path):
    """`posttrain grpo policy.num_workers=2 policy.expert_parallel_size=2` on the tiny Qwen3-MoE: the
    native engine gets every expert (gathered from the two ranks' shards) at each refit, checksum
    verified, so its logprobs are the trainer's; with router replay on, the engine's recorded experts
    reach the EP workers' forwards with the rows they were sharded with."""
    metrics = two_grpo_steps(tmp_path, "policy.model_name=tiny-qwen3_moe", "policy.num_workers=2",
                             "policy.expert_parallel_size=2", "policy.moe_router_replay=true")
    for step in (1, 2):
        assert 1.0 <= metrics[step]["train/token_mult_prob_error"] < 1.001, metrics[step]
        assert 1.0 <= metrics[step]["train/moe/expert_load_max_over_mean"] <= 2.0  # E / k = 4 / 2 at most
