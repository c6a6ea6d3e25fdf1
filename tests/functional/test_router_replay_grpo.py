"""Router replay in a GRPO job (`policy.moe_router_replay=true`, tiny Qwen3-MoE, one process): the
native engine's recorded experts travel with the rollouts into the training batch (every fed
generated token has its experts), the steps run with the trainer agreeing with the engine, and the
policy's logprob forward routes by the batch's `routed_experts` (forced experts change the logprobs
exactly as an in-process replay does)."""

from __future__ import annotations

import pytest
import torch
from test_grpo import read_metrics, small_cfg

from posttrain.distributed.batch import Batch
from posttrain.models import router_replay
from posttrain.models.hf import load_causal_lm

pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]


def grpo_train_batches(ctx) -> list[Batch]:
    """Run GRPO on `ctx`; the batches its policy trained on."""
    from posttrain.algorithms import grpo

    trained: list[Batch] = []
    train = ctx.policy.train

    def spy(batch, *args, **kwargs):
        trained.append(batch)
        return train(batch, *args, **kwargs)

    ctx.policy.train = spy
    grpo.grpo_train(ctx)
    return trained


def test_grpo_with_router_replay_carries_the_engines_experts_into_training(tmp_path):
    from posttrain.algorithms import grpo

    ctx = grpo.setup(small_cfg(tmp_path, "policy.model_name=tiny-qwen3_moe", "policy.moe_router_replay=true",
                               "cluster.backend=local", "grpo.max_num_steps=1"))
    try:
        trained = grpo_train_batches(ctx)
        metrics = read_metrics(tmp_path / "logs")
        assert 1.0 <= metrics[1]["train/token_mult_prob_error"] < 1.001
        [batch] = trained
        routed = batch[router_replay.ROUTED_EXPERTS]
        assert routed.shape == (*batch["input_ids"].shape, 2, 2)  # 2 MoE layers, top-2
        lengths = batch["input_lengths"]
        # Trained (generated) tokens were fed to the engine, all but each row's last one.
        fed = batch["token_mask"].bool() & (torch.arange(routed.shape[1])[None] < (lengths - 1)[:, None])
        assert fed.any() and (routed[fed] >= 0).all() and (routed[fed] < 4).all()

        # The policy routes by the batch's experts: all tokens forced to experts 2 and 3.
        ids = torch.randint(7, 100, (2, 8), generator=torch.Generator().manual_seed(0))
        forced = torch.full((2, 8, 2, 2), -1, dtype=torch.int16)
        forced[:, 3:] = torch.tensor([2, 3], dtype=torch.int16)
        probe = Batch(input_ids=ids, input_lengths=torch.tensor([8, 8]), routed_experts=forced)
        got = ctx.policy.get_logprobs(probe)["logprobs"]
        plain = ctx.policy.get_logprobs(Batch(input_ids=ids, input_lengths=torch.tensor([8, 8])))["logprobs"]
        model = load_causal_lm(ctx.policy.export_hf(tmp_path / "hf"))
        with torch.no_grad(), router_replay.replaying(model, forced.flatten(0, 1)):
            logits = model(input_ids=ids).logits
        expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        torch.testing.assert_close(got[:, 1:], expected, atol=1e-5, rtol=0)
        assert (got[:, 4:] - plain[:, 4:]).abs().max() > 1e-3
    finally:
        ctx.shutdown()
