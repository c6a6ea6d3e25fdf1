"""PPO's pure parts against hand-computed values: GAE (the `gae` estimator), the clipped value
loss, explained variance, the value model's alignment, and the `ppo` config's checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.algorithms.advantages import compute_advantages, gae, masked_whiten, takes_values
from posttrain.algorithms.loss import build_loss
from posttrain.algorithms.value_loss import explained_variance

# One row: 2 prompt tokens, 3 generated (positions 2-4), 1 padding. Values as the critic aligns
# them: position i is V of the prefix before token i.
MASK = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 0.0]])
VALUES = torch.tensor([[0.0, 0.0, 0.5, 0.6, 0.7, 0.0]])


def gae_of(rewards, values, token_mask, **options):
    return compute_advantages("gae", torch.tensor(rewards), torch.zeros(len(rewards), dtype=torch.long),
                              values=values, token_mask=token_mask, **options)


@pytest.mark.parametrize("lam, expected", [
    # gamma 0.9; deltas: t4 = 1 - 0.7 = 0.3, t3 = 0.9 * 0.7 - 0.6 = 0.03, t2 = 0.9 * 0.6 - 0.5 = 0.04.
    (0.0, [0.04, 0.03, 0.3]),  # one-step TD errors
    (0.5, [0.04 + 0.45 * (0.03 + 0.45 * 0.3), 0.03 + 0.45 * 0.3, 0.3]),
    (1.0, [0.81 - 0.5, 0.9 - 0.6, 1.0 - 0.7]),  # discounted return minus value
])
def test_gae_by_hand(lam, expected):
    advantages = gae_of([1.0], VALUES, MASK, gamma=0.9, lam=lam)
    assert advantages[0, 2:5].tolist() == pytest.approx(expected, abs=1e-6)
    assert advantages[0, [0, 1, 5]].tolist() == [0.0, 0.0, 0.0]  # prompt and padding get none


def test_gae_gamma_one_lambda_one_is_reward_minus_value_and_token_rewards_add_up():
    advantages = gae_of([1.0], VALUES, MASK, gamma=1.0, lam=1.0)
    assert advantages[0, 2:5].tolist() == pytest.approx([0.5, 0.4, 0.3])
    # A per-token reward (PPO's -beta KL) at every generated token: the return sums what follows.
    kl = torch.tensor([[9.0, 9.0, -0.1, -0.2, -0.3, 9.0]])  # off the mask it must not count
    advantages = gae_of([1.0], VALUES, MASK, gamma=1.0, lam=1.0, token_rewards=kl)
    assert advantages[0, 2:5].tolist() == pytest.approx([0.4 - 0.5, 0.5 - 0.6, 0.7 - 0.7])


def test_multi_turn_observation_tokens_get_no_advantage_and_are_not_time_steps():
    # prompt p p | turn 1: a a | environment: o o | turn 2: b b | padding
    token_mask = torch.tensor([[0.0, 0, 1, 1, 0, 0, 1, 1, 0]])
    values = torch.tensor([[0.0, 0, 0.2, 0.3, 5.0, 5.0, 0.6, 0.8, 0]])  # observation values must not enter
    advantages = gae_of([1.0], values, token_mask, gamma=0.9, lam=0.5)
    # The same GAE over the four generated tokens alone, by hand: deltas then the backward sum.
    v = [0.2, 0.3, 0.6, 0.8]
    deltas = [0.9 * v[1] - v[0], 0.9 * v[2] - v[1], 0.9 * v[3] - v[2], 1.0 - v[3]]
    a3 = deltas[3]
    a2 = deltas[2] + 0.45 * a3
    a1 = deltas[1] + 0.45 * a2
    a0 = deltas[0] + 0.45 * a1
    assert advantages[0, [2, 3, 6, 7]].tolist() == pytest.approx([a0, a1, a2, a3])
    assert advantages[0, [0, 1, 4, 5, 8]].tolist() == [0.0] * 5
    # The reward arrives at the last generated token (position 7), not the last token of the row.
    assert gae(torch.zeros_like(values), values, token_mask, 1.0, 0.0)[0, 7].item() == pytest.approx(-0.8)


def test_masked_samples_get_nothing_and_rows_are_independent():
    values = VALUES.repeat(3, 1)
    advantages = compute_advantages("gae", torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]),
                                    torch.tensor([1.0, 1.0, 0.0]), values=values, token_mask=MASK.repeat(3, 1), lam=1.0)
    assert advantages[0, 2:5].tolist() == pytest.approx([0.5, 0.4, 0.3])
    assert advantages[1, 2:5].tolist() == pytest.approx([-0.5, -0.6, -0.7])  # reward 0
    assert advantages[2].abs().sum() == 0  # sample_mask 0


def test_gae_is_in_the_registry_as_an_estimator_of_values():
    assert takes_values("gae") and not takes_values("grpo") and not takes_values("reinforce_pp")
    with pytest.raises(TypeError, match="values"):
        compute_advantages("gae", torch.tensor([1.0]), torch.tensor([0]))  # no values: a clear error


def test_masked_whiten():
    values = torch.tensor([[0.0, 1.0, 3.0, 100.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    assert masked_whiten(values, mask)[0].tolist() == pytest.approx([0.0, -1.0, 1.0, 0.0], abs=1e-5)


# ------------------------------------------------------------------------------ value loss
def value_batch():
    return {
        "token_mask": torch.tensor([[0.0, 1.0, 1.0]]),
        "sample_mask": torch.tensor([1.0]),
        "prev_values": torch.tensor([[0.0, 0.2, 0.2]]),
        "returns": torch.tensor([[0.0, 1.0, 0.0]]),
    }


def test_clipped_value_loss_by_hand_both_branches():
    values = torch.tensor([[0.0, 0.5, 0.9]], requires_grad=True)
    loss, metrics = build_loss("value", value_clip=0.2)(values, value_batch(), 1, 2)
    # Token 1: V 0.5, old 0.2, R 1: unclipped 0.25 < clipped (0.4 - 1)^2 = 0.36: the clip binds.
    # Token 2: V 0.9, old 0.2, R 0: unclipped 0.81 > clipped 0.4^2 = 0.16: the plain error binds.
    assert loss.item() == pytest.approx(0.5 * (0.36 + 0.81) / 2)
    assert metrics["value_clip_fraction"] == pytest.approx(0.5)
    assert metrics["values_mean"] == pytest.approx(0.7)
    loss.backward()
    # No gradient through the clipped token; (V - R) / global tokens through the other.
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.9 / 2])


def test_value_loss_without_clip_and_its_checks():
    values = torch.tensor([[0.0, 0.5, 0.9]], requires_grad=True)
    batch = value_batch()
    del batch["prev_values"]  # not needed without a clip
    loss, metrics = build_loss("value", value_clip=None)(values, batch, 1, 2)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.81) / 2)
    assert metrics["value_clip_fraction"] == 0.0
    with pytest.raises(KeyError, match="prev_values"):
        build_loss("value", value_clip=0.2)(values, batch, 1, 2)
    with pytest.raises(ValueError, match="value_clip"):
        build_loss("value", value_clip=0.0)


def test_explained_variance_by_hand():
    mask = torch.tensor([0.0, 1, 1, 1, 1])
    returns = torch.tensor([7.0, 1, 0, 1, 0])
    # Residuals 0.1, -0.1, 0.4, -0.4: variance 0.085 over the returns' 0.25.
    assert explained_variance(torch.tensor([0.0, 0.9, 0.1, 0.6, 0.4]), returns, mask) == pytest.approx(1 - 0.34)
    assert explained_variance(torch.full((5,), 0.5), returns, mask) == pytest.approx(0.0)  # the mean: no better
    assert explained_variance(torch.tensor([0.0, 0, 1, 0, 1]), returns, mask) == pytest.approx(-3.0)  # worse
    assert explained_variance(torch.zeros(5), torch.ones(5), mask) == 0.0  # nothing to explain


# ------------------------------------------------------------------------ the value model
def test_values_are_aligned_like_logprobs_and_packing_agrees():
    from transformers import LlamaConfig, LlamaForTokenClassification

    from posttrain.data import packing
    from posttrain.distributed.batch import Batch
    from posttrain.models.policy.forward import MicroBatch, microbatch_values

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_labels=1, classifier_dropout=0.0, token_classification_bias=False)
    model = LlamaForTokenClassification(config).eval()
    rows = Batch(input_ids=torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]]), input_lengths=torch.tensor([4, 3]))
    cpu = torch.device("cpu")
    with torch.no_grad():
        padded = microbatch_values(model, MicroBatch(rows, torch.arange(2)), cpu, torch.float32)
        head = model(input_ids=rows["input_ids"][:1]).logits[0, :, 0]
        bin_ = packing.pack_sequences(rows["input_ids"], rows["input_lengths"], [[0, 1]])[0]
        packed = microbatch_values(model, MicroBatch(rows, torch.arange(2), packed=bin_), cpu, torch.float32)
    assert padded[0].tolist() == pytest.approx([0.0, *head[:3].tolist()])  # position i: the head at i - 1
    assert padded[1, 0] == 0 and padded[1, 3] == 0  # the first position and the padding
    assert torch.allclose(packed, padded, atol=1e-5)


# ---------------------------------------------------------------------------------- config
def test_ppo_config_defaults_and_refusals():
    from posttrain.config import ConfigError, load_config

    cfg = load_config("ppo")
    assert cfg.grpo.adv_estimator.name == "gae" and cfg.critic.lambda_critic == 1.0
    assert load_config("ppo", overrides=["grpo.adv_estimator.name=grpo"]).grpo.adv_estimator.name == "grpo"
    for overrides, message in [
        (["critic.kl_in_reward=true"], "reference_policy_kl_penalty > 0"),
        (["critic.num_workers=2"], "critic.colocated=false"),
        (["grpo.partial_rollouts.enabled=true", "loss_fn.use_importance_sampling_correction=true"],
         "posttrain ppo does not carry unfinished rollouts over"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config("ppo", overrides=overrides)


PPO_ASYNC_TINY = str(Path(__file__).resolve().parents[2] / "examples/configs/ppo_async_tiny.yaml")
ASYNC = ["grpo.async_grpo.enabled=true", "policy.generation.colocated.enabled=false",
         "loss_fn.use_importance_sampling_correction=true"]


def test_async_ppo_is_posttrain_ppo_with_async_grpos_section_and_its_refusals(capsys):
    """`grpo.async_grpo.enabled` under `posttrain ppo` is async PPO: the same `ppo.run` (which picks
    the loop), the section shown by --print-config, and async GRPO's requirements, each refused in
    one line naming its key."""
    from posttrain import cli
    from posttrain.config import ConfigError, load_config

    cfg = load_config("ppo", overrides=ASYNC)
    assert cfg.grpo.async_grpo.enabled and cfg.grpo.adv_estimator.name == "gae"
    assert cli.job_target("ppo", cfg) == ("posttrain.algorithms.ppo", "run")
    shipped = load_config("ppo", config_path=PPO_ASYNC_TINY)
    assert shipped == load_config("ppo", overrides=[*ASYNC, "policy.generation.colocated.num_workers=1",
                                                    "grpo.async_grpo.max_trajectory_age_steps=1",
                                                    "loss_fn.truncated_importance_sampling_type=tis",
                                                    "loss_fn.truncated_importance_sampling_ratio=2.0",
                                                    "logger.log_dir=logs/ppo_async_tiny",
                                                    "checkpointing.checkpoint_dir=checkpoints/ppo_async_tiny"])
    assert cli.config_algorithm(PPO_ASYNC_TINY) == "ppo"
    for left_out, message in [
        ("policy.generation.colocated.enabled=false", "needs generation on workers of its own: set "
                                                      "policy.generation.colocated.enabled=false"),
        ("loss_fn.use_importance_sampling_correction=true", "set loss_fn.use_importance_sampling_correction=true"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config("ppo", overrides=[o for o in ASYNC if o != left_out])
    with pytest.raises(ConfigError, match="force_on_policy_ratio=true would ignore the trajectories' staleness"):
        load_config("ppo", overrides=[*ASYNC, "loss_fn.force_on_policy_ratio=true"])
    assert cli.main(["ppo", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "  async_grpo:\n" in printed and "async PPO under posttrain ppo" in printed


def test_ppo_refuses_an_estimator_without_values_before_starting_anything(tmp_path):
    from posttrain.algorithms import ppo
    from posttrain.config import load_config
    from posttrain.errors import UserError

    cfg = load_config("ppo", overrides=["grpo.adv_estimator.name=grpo", f"logger.log_dir={tmp_path}"])
    with pytest.raises(UserError, match="does not take the critic's values"):
        ppo.setup(cfg)


def test_the_memory_plan_counts_the_critic():
    from posttrain import plan as mp
    from posttrain.config import load_config

    shape = mp.ModelShape(num_params=1_000_000, hidden_size=64, num_layers=4, vocab_size=100, num_heads=4,
                          num_kv_heads=2, head_dim=16, intermediate_size=256, largest_tensor=100_000)
    gpu = ["cluster.gpus_per_node=2", "policy.num_workers=2", "policy.train_global_batch_size=64"]
    colocated = mp.memory_plan(load_config("ppo", overrides=gpu), shape, 80 * mp.GiB)
    rows = colocated.devices[0].rows  # on the policy's GPUs, sharded over its 2 workers, offloaded while generating
    assert rows["critic parameters (fp32)"]["training"] == 4 * 1_000_000 // 2
    assert rows["critic optimizer state (adamw)"]["training"] == 8 * 1_000_000 // 2
    apart = mp.memory_plan(load_config("ppo", overrides=[*gpu, "critic.colocated=false", "critic.num_workers=4"]),
                           shape, 80 * mp.GiB)
    critic = next(device for device in apart.devices if device.name == "critic worker")
    assert critic.rows["critic parameters (fp32)"]["training"] == 4 * 1_000_000 // 4
    assert "critic gradients (fp32)" in critic.rows and apart.process_counts[apart.devices.index(critic)] == 4


def test_the_python_api_runs_ppo_with_its_config(tmp_path, monkeypatch):
    from posttrain import PPO
    from posttrain.config import PPOMasterConfig, load_config

    monkeypatch.chdir(tmp_path)
    trainer = PPO(config={"critic.warmup_steps": 3})
    assert trainer.command == "ppo" and isinstance(trainer.config, PPOMasterConfig)
    assert trainer.config == load_config("ppo", overrides=["critic.warmup_steps=3"])
    assert PPO(config=trainer.config).config == trainer.config


def test_the_kl_reward_compares_the_trainers_logprobs_not_the_engines():
    """`critic.kl_in_reward`: the per-token KL is between the policy's `get_logprobs` and the
    reference's, both trainer forwards; the engine's `generation_logprobs` (bf16 / vLLM, off by
    their mismatch) never enter it. The policy's logprobs become the batch's `prev_logprobs`, so
    the policy update does not run that forward again."""
    from types import SimpleNamespace

    from posttrain.algorithms.experience import update_policy
    from posttrain.algorithms.ppo import kl_rewards
    from posttrain.config import load_config
    from posttrain.distributed.batch import Batch
    from posttrain.utils.timer import Timer

    cfg = load_config("ppo", overrides=["sft_warmup=null", "critic.kl_in_reward=true",
                                        "loss_fn.reference_policy_kl_penalty=0.5", "loss_fn.reference_policy_kl_type=k1",
                                        "policy.train_global_batch_size=1"])
    trainer, reference = torch.tensor([[0.0, -1.0, -2.0, 0.0]]), torch.tensor([[0.0, -1.5, -1.0, 0.0]])
    calls = []

    class Policy:
        def get_logprobs(self, batch, temperature):
            calls.append("policy")
            return Batch(logprobs=trainer.clone())

        def get_reference_logprobs(self, batch, temperature):
            calls.append("reference")
            return Batch(logprobs=reference.clone())

        def train(self, batch, loss_fn, global_batch_size, temperature):
            return {"loss": 0.0}

    train_data = Batch(input_ids=torch.zeros(2, 4, dtype=torch.long), token_mask=torch.tensor([[0.0, 1, 1, 0]] * 2),
                       sample_mask=torch.ones(2), generation_logprobs=torch.full((2, 4), -9.0))
    trainer, reference = trainer.repeat(2, 1), reference.repeat(2, 1)
    ctx = SimpleNamespace(cfg=cfg, policy=Policy(), loss_fn=None, loop=SimpleNamespace(state={}))
    rewards, metrics = kl_rewards(ctx, train_data, Timer())
    # k1 = logp - logp_ref: [0.5, -1.0] on the generated tokens, times -beta.
    assert rewards[0].tolist() == pytest.approx([0.0, -0.25, 0.5, 0.0])
    assert metrics["train/reward_kl"] == pytest.approx(-0.25)
    assert torch.equal(train_data["prev_logprobs"], trainer)
    update_policy(ctx, train_data, Timer(), off_policy=False)  # 2 rows, 1 per optimizer step: needs prev_logprobs
    assert calls == ["policy", "reference"]  # neither forward runs twice
