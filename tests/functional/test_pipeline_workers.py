"""Pipeline parallelism (`policy.pipeline_parallel_size`) on CPU over gloo, with real Ray workers:
two pipeline stages give the logprobs, losses, gradient norms, updated weights and reference
logprobs of one worker, with 1F1B, interleaved 1F1B (2 stages per worker), as PP=2 x DP=2 and as
PP=2 x TP=2 (`models/policy/pipeline.py`); the trained stages refit a native engine whole, and a checkpoint
saved under PP=2 resumes under PP=1.

The model is the `small` preset (4 layers: 2 stages of 2, or 4 of 1 interleaved); the batch and
the two clipped-SGD train calls are `test_tensor_parallel.py`'s. Tolerances are its own (1e-5
relative on logprobs, losses and gradient norms, 1e-6 absolute on weights): PP computes the same
sums in float32, through the fused lm_head + logprob path and SDPA's causal kernel without a
padding mask, so the values differ from one worker's by float rounding only (measured over the four
layouts: logprobs within 1.4e-6, losses 8.3e-7 and gradient norms 5e-7 relative, weights 1.2e-7).
"""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.loss import ClippedPGLoss
from posttrain.config.schema import LossConfig
from posttrain.distributed.actors import LocalCluster
from posttrain.models.generation.native import NativeGeneration
from posttrain.models.generation.spec import GenerationSpec
from posttrain.models.policy.policy import Policy
from test_tensor_parallel import cluster  # noqa: F401 (the module-scoped fixture of 4 bundles)
from test_tensor_parallel import RTOL, assert_same_run, make_batch, policy_cfg, run, run_one_worker

pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]

MODEL = "small"


@pytest.fixture(scope="module")
def one_worker():
    return run_one_worker(policy_cfg(model_name=MODEL), "pp1")


@pytest.fixture(scope="module")
def pp2(cluster):
    """Two 1F1B stages, refitted at the end into a one-worker native engine."""
    spec = GenerationSpec(MODEL, {"max_new_tokens": 4}, precision="float32")
    generation = NativeGeneration(cluster, spec, bundle_indices=[2], name="pp2_engine")
    try:
        return run(cluster, policy_cfg(model_name=MODEL, num_workers=2, pipeline_parallel_size=2), "pp2",
                   generation=generation)
    finally:
        generation.shutdown()


def test_pp2_1f1b_equals_one_worker_and_refits_whole(one_worker, pp2):
    """1F1B over two stages: one worker's run (the counts not doubled although both stages see all
    rows; the gradient norm over both stages' parameters); the engine gets every tensor of both
    stages, equal to the trainer's."""
    assert_same_run(pp2, one_worker)
    mask = make_batch()["token_mask"][:, 1:] * make_batch()["sample_mask"][:, None]
    assert pp2["metrics"][0]["global_valid_toks"] == mask.sum().item()
    assert pp2["metrics"][0]["grad_norm"] > 0.5  # clipped
    [engine] = pp2["engine_weights"]
    assert set(engine) == set(one_worker["weights"])
    for name, value in pp2["weights"].items():
        assert torch.equal(engine[name], value), name
    [before] = pp2["engine_weights_before"]
    stale = [name for name, value in engine.items() if name.endswith("proj.weight") and torch.equal(value, before[name])]
    assert not stale, f"the refit left the initial value of {stale}"


@pytest.mark.parametrize("layout", ["interleaved", "pp2_dp2", "pp2_tp2"])
def test_interleaved_pp2_by_dp2_and_pp2_by_tp2_equal_one_worker(cluster, one_worker, layout):
    """Interleaved 1F1B (2 workers x 2 virtual stages of one layer; stages 0 and 2 on the first
    worker); PP=2 x DP=2 (4 workers: each pipeline gets half the rows, FSDP2 shards each stage
    over its 2 data-parallel ranks, micro-batches padded to the count the schedule needs); PP=2 x
    TP=2 (the mesh (dp 1, pp 2, tp 2): each stage's layers split by heads and MLP width): one
    worker's run."""
    sizes = {"interleaved": dict(num_workers=2, pipeline_schedule="interleaved_1f1b"),
             "pp2_dp2": dict(num_workers=4), "pp2_tp2": dict(num_workers=4, tensor_parallel_size=2)}[layout]
    cfg = policy_cfg(model_name=MODEL, pipeline_parallel_size=2, **sizes)
    assert_same_run(run(cluster, cfg, f"pp_{layout}"), one_worker)


def test_checkpoint_saved_under_pp2_resumes_under_pp1(cluster, tmp_path):
    """AdamW with warm-up: the DCP checkpoint of two stages (each rank its own layers and Adam
    moments, under the full model's names; the optimizer state flattened per parameter) loads into
    one worker, whose next train call gives the PP run's second call and weights. Adam turns the
    1e-7 float noise of the second step's gradient into up to 1% of a step where a moment is near
    its eps (`test_tensor_parallel.py`), hence 5e-5 on weights at lr 1e-3; a step without the
    restored moments would be off by about the learning rate."""
    adamw = dict(optimizer=dict(name="adamw", lr=1e-3), scheduler=dict(name="linear", warmup_steps=1, total_steps=4))
    pp2 = run(cluster, policy_cfg(model_name=MODEL, num_workers=2, pipeline_parallel_size=2, **adamw), "pp2_adamw",
              tmp_path)
    # The one worker runs in this process (the local backend): it only has to read the checkpoint.
    resumed = Policy(LocalCluster(), policy_cfg(model_name=MODEL, **adamw), init_reference_model=False,
                     weights_path=pp2["checkpoint"], name="pp_resumed")
    try:
        metrics = resumed.train(make_batch(), ClippedPGLoss(LossConfig()))
        weights = resumed.state_dict_for_export()
    finally:
        resumed.shutdown()
    for name in ("loss", "grad_norm", "lr"):
        assert metrics[name] == pytest.approx(pp2["metrics"][1][name], rel=RTOL), name
    assert set(weights) == set(pp2["weights"])
    for name, value in pp2["weights"].items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=5e-5, msg=lambda m: f"{name}: {m}")
