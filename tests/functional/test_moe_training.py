"""Mixture-of-experts models (the tiny Qwen3-MoE, Mixtral and DeepSeek-V3 presets) on real Ray
workers: the router's load-balancing loss is in the gradient and in the metrics, FSDP2 over 2
workers equals 1 worker, GRPO runs with refit into the native engine, the expert load metrics are
logged, DeepSeek-V3's balancing bias moves and travels with refits, checkpoints and the HF export,
and the HF export reloads."""

from __future__ import annotations

import math

import pytest
import torch
from test_grpo import SMALL, read_metrics
from test_policy import LR, assert_weights_close, make_batch, policy_cfg

from posttrain.algorithms.loss import NLLLoss
from posttrain.distributed.batch import Batch
from posttrain.distributed.cluster import VirtualCluster
from posttrain.models import moe
from posttrain.models.hf import load_causal_lm
from posttrain.models.policy.forward import fixed_size_microbatches
from posttrain.models.policy.policy import Policy

# The timeout is a hang guard, not a speed test: beside two CPU hogs this module ran 4-6x its quiet time.
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]

MICRO_BATCH = 2


def reference_step(model_name: str, batch: Batch, coef: float) -> tuple[dict[str, torch.Tensor], float]:
    """One SGD step in-process on micro-batches of 2 rows: NLL with global token counts plus
    `coef` x each micro-batch's load-balancing loss weighted by its share of the tokens."""
    model = load_causal_lm(model_name, dtype=torch.float32, device="cpu").train()
    mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    step_tokens = batch["input_lengths"].sum()
    router_loss_total = 0.0
    for mb in fixed_size_microbatches(batch, MICRO_BATCH):
        rows = mb.rows
        width = rows["input_ids"].shape[1]
        tokens = (torch.arange(width)[None] < rows["input_lengths"][:, None]).long()
        with moe.record_router_logits(model) as routers:
            logits = model(input_ids=rows["input_ids"], attention_mask=tokens).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, rows["input_ids"][:, 1:, None]).squeeze(-1)
        logprobs = torch.nn.functional.pad(logprobs, (1, 0))
        loss, _ = NLLLoss()(logprobs, rows, batch["sample_mask"].sum(), mask.sum())
        router_loss = moe.load_balancing_loss(model, routers.logits, tokens) * tokens.sum() / step_tokens
        (loss + coef * router_loss).backward()
        router_loss_total += router_loss.item()
    return {name: (p - LR * p.grad).detach() for name, p in model.named_parameters()}, router_loss_total


def test_moe_sft_step_two_workers_equal_one_and_include_the_router_loss(ray_cluster):
    batch = make_batch()
    cfg = policy_cfg(model_name="tiny-qwen3_moe", train_micro_batch_size=MICRO_BATCH)
    expected, expected_router_loss = reference_step("tiny-qwen3_moe", batch, coef=0.01)
    without_router_loss, _ = reference_step("tiny-qwen3_moe", batch, coef=0.0)
    one_cluster, two_cluster = VirtualCluster([1], name="moe-dp1"), VirtualCluster([2], name="moe-dp2")
    policies = []
    try:
        policies.append(Policy(one_cluster, cfg, init_reference_model=False, name="moe-dp1"))
        two_workers = cfg.model_copy(update={"num_workers": 2})
        policies.append(Policy(two_cluster, two_workers, init_reference_model=False, name="moe-dp2"))
        for policy in policies:
            metrics = policy.train(batch, NLLLoss())
            assert metrics["router_aux_loss"] == pytest.approx(expected_router_loss, rel=1e-5)
            assert_weights_close(policy.state_dict_for_export(), expected)
        # The router loss moved the routers: without it their weights would differ.
        gate = "model.layers.0.mlp.gate.weight"
        assert (expected[gate] - without_router_loss[gate]).abs().max() > 1e-4
    finally:
        for policy in policies:
            policy.shutdown()
        one_cluster.shutdown()
        two_cluster.shutdown()


def export_reloads_with_the_policys_logprobs(policy: Policy, tmp_path, class_name: str):
    """The policy's HF export reloads as `class_name` and gives the policy's logprobs; returns it."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(policy.export_hf(tmp_path / "hf")).eval()
    assert type(reloaded).__name__ == class_name
    ids = torch.randint(7, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    probe = Batch(input_ids=ids, input_lengths=torch.tensor([10, 10]))
    with torch.no_grad():
        logits = reloaded(input_ids=ids).logits
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(policy.get_logprobs(probe)["logprobs"][:, 1:], expected, atol=1e-5, rtol=0)
    return reloaded


def test_moe_grpo_refits_the_engine_logs_the_router_loss_and_exports(ray_cluster, tmp_path):
    from posttrain.algorithms import grpo
    from posttrain.config.loader import load_config

    cfg = load_config("grpo", overrides=[
        *SMALL, "grpo.max_num_steps=2", "policy.model_name=tiny-mixtral", "checkpointing.enabled=false",
        f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
    ])
    ctx = grpo.setup(cfg)
    try:
        grpo.grpo_train(ctx)  # verify_refit: generation's weights equal the policy's after each refit
        metrics = read_metrics(tmp_path / "logs")
        for step in (1, 2):
            assert metrics[step]["train/router_aux_loss"] > 0  # ~ num_experts_per_tok when balanced
            assert 1.0 <= metrics[step]["train/moe/expert_load_max_over_mean"] <= 2.0  # at most E / k = 4 / 2
            assert 0.0 < metrics[step]["train/moe/expert_load_entropy"] <= 1.0
            assert 1.0 <= metrics[step]["train/token_mult_prob_error"] < 1.001
        assert ctx.generation.weights_version == 1

        export_reloads_with_the_policys_logprobs(ctx.policy, tmp_path, "MixtralForCausalLM")
    finally:
        ctx.shutdown()


def test_deepseek_v3_grpo_balances_its_routers_and_generates_with_the_native_engine(tmp_path):
    """The tiny DeepSeek-V3 (multi-head latent attention, shared expert, sigmoid routing with a
    balancing bias) in one process (local backend): GRPO steps with the bias update on, the engine's
    logprobs agree with the trainer's, the bias moved and is in the engine, the checkpoint and the
    HF export."""
    from torch.distributed.checkpoint import FileSystemReader

    from posttrain.algorithms import grpo
    from posttrain.config.loader import load_config

    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    cfg = load_config("grpo", overrides=[
        *SMALL, "grpo.max_num_steps=2", "policy.model_name=tiny-deepseek_v3", "cluster.backend=local",
        "policy.moe_router_bias_update_rate=0.01", "checkpointing.enabled=true", "checkpointing.save_period=2",
        f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
    ])
    ctx = grpo.setup(cfg)
    try:
        grpo.grpo_train(ctx)  # verify_refit: the engine's weights (the bias included) equal the policy's
        metrics = read_metrics(tmp_path / "logs")
        for step in (1, 2):
            assert math.isfinite(metrics[step]["train/loss"])
            assert 1.0 <= metrics[step]["train/moe/expert_load_max_over_mean"] <= 4.0  # E / k = 8 / 2 at most
            assert 0.0 < metrics[step]["train/moe/expert_load_entropy"] <= 1.0
            assert 1.0 <= metrics[step]["train/token_mult_prob_error"] < 1.001
            assert "train/router_aux_loss" not in metrics[step]  # aux-loss-free
        state = ctx.policy.state_dict_for_export()
        # Two updates of +-0.01 per expert (0 only where an expert sat exactly at the mean).
        steps_taken = (state[bias].abs() / 0.01).tolist()  # float32 sums: 0.01 + 0.01 is 0.0199999995
        assert max(steps_taken) == pytest.approx(2, abs=1e-5)
        assert all(min(abs(n - k) for k in (0, 1, 2)) < 1e-5 for n in steps_taken), steps_taken
        assert ctx.generation.get_weights_checksums() == [ctx.policy.weights_checksum()]
        saved = FileSystemReader(str(tmp_path / "ckpt" / "step_2" / "policy" / "model")).read_metadata()
        assert any(key.endswith(bias) for key in saved.state_dict_metadata)

        reloaded = export_reloads_with_the_policys_logprobs(ctx.policy, tmp_path, "DeepseekV3ForCausalLM")
        assert torch.equal(reloaded.state_dict()[bias], state[bias])
    finally:
        ctx.shutdown()
