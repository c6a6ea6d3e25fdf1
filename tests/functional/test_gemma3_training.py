"""The tiny Gemma 3 preset (`tiny-gemma3`: a sliding-window layer of 8 positions beside a global
one, QK-norm, scaled and tied embeddings) on real workers: FSDP2 over 2 workers with sequence
packing gives one SGD step on the whole batch, the HF export and `posttrain convert` reload with the
policy's logprobs, and GRPO (full fine-tuning or LoRA) runs with refit into the native engine, whose
logprobs agree with the trainer's in float32. Rows are longer than the window, so it matters."""

from __future__ import annotations

import pytest
import torch
from test_grpo import SMALL, read_metrics
from test_moe_training import export_reloads_with_the_policys_logprobs
from test_policy import assert_weights_close, make_batch, policy_cfg, sgd_update

from posttrain import cli
from posttrain.algorithms.loss import NLLLoss
from posttrain.distributed.cluster import VirtualCluster
from posttrain.models.hf import load_causal_lm
from posttrain.models.policy.policy import Policy

# The timeout is a hang guard, not a speed test.
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]

MODEL = "tiny-gemma3"


def test_gemma3_fsdp2_packed_step_equals_one_big_batch_and_exports(ray_cluster, tmp_path):
    batch = make_batch()  # rows of 3 to 16 tokens
    expected = sgd_update(load_causal_lm(MODEL), batch, NLLLoss())
    cluster = VirtualCluster([2], name="gemma3-dp2")
    # Rank 1 builds the model on the meta device and receives rank 0's weights (sharded loading): the
    # tied head must stay tied there (sharded_load.py), or FSDP2's collectives and the optimizer differ.
    cfg = policy_cfg(model_name=MODEL, num_workers=2,
                     sequence_packing=dict(enabled=True, train_mb_tokens=20, logprob_mb_tokens=20))
    policy = Policy(cluster, cfg, init_reference_model=False, name="gemma3-dp2")
    try:
        metrics = policy.train(batch, NLLLoss())
        assert metrics["loss"] > 0 and metrics["grad_norm"] > 0
        assert_weights_close(policy.state_dict_for_export(), expected)
        reloaded = export_reloads_with_the_policys_logprobs(policy, tmp_path, "Gemma3ForCausalLM")
        assert reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight
        policy.save_checkpoint(str(tmp_path / "ckpt"))
        assert cli.main(["convert", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "converted")]) == 0
        converted = load_causal_lm(tmp_path / "converted")
        for (name, a), (_, b) in zip(reloaded.state_dict().items(), converted.state_dict().items()):
            assert torch.equal(a, b), name
    finally:
        policy.shutdown()
        cluster.shutdown()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gemma3_grpo_with_the_native_engine(tmp_path, lora):
    """Two GRPO steps in one process (local backend), sequence packing on: the refit engine's
    logprobs agree with the trainer's (`token_mult_prob_error` < 1.001 in float32)."""
    from posttrain.algorithms import grpo
    from posttrain.config.loader import load_config

    cfg = load_config("grpo", overrides=[
        *SMALL, "grpo.max_num_steps=2", f"policy.model_name={MODEL}", "cluster.backend=local",
        "policy.precision=float32", "policy.sequence_packing.enabled=true", "policy.generation.max_new_tokens=12",
        *(["policy.lora.enabled=true", "policy.lora.dim=4", "policy.lora.alpha=8"] if lora else []),
        "checkpointing.enabled=false", f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
    ])
    ctx = grpo.setup(cfg)
    try:
        grpo.grpo_train(ctx)  # verify_refit: the engine's weights equal the policy's after each refit
        metrics = read_metrics(tmp_path / "logs")
        for step in (1, 2):
            assert 1.0 <= metrics[step]["train/token_mult_prob_error"] < 1.001
        assert ctx.generation.weights_version == 1
    finally:
        ctx.shutdown()
