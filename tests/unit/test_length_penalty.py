"""Kimi k1.5's per-group length reward (`reward_shaping.length_penalty`) against hand-computed values."""

from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms.advantages import length_reward
from posttrain.algorithms.experience import score_groups
from posttrain.config import load_config

# Group 0: lengths 4..12, three correct. Group 1: every response 3 tokens long. Group 2: the
# 20-token response is masked out (sample_mask 0), so the group's range is 2..10.
LENGTHS = torch.tensor([4.0, 6.0, 8.0, 12.0, 3.0, 3.0, 3.0, 2.0, 10.0, 6.0, 20.0])
REWARDS = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
MASK = torch.tensor([1.0] * 10 + [0.0])
# lambda = 0.5 - (len - min) / (max - min): group 0 (4..12) [0.5, 0.25, 0.0, -0.5]; correct samples
# keep lambda, the incorrect 8-token one min(0, 0.0) = 0. Group 1: equal lengths -> 0. Group 2
# (2..10): [0.5, -0.5, 0.0]; incorrect ones min(0, lambda): 0 and -0.5; the correct one 0.0.
EXPECTED = [0.5, 0.25, 0.0, -0.5, 0.0, 0.0, 0.0, 0.0, -0.5, 0.0, 0.0]


def test_kimi_length_reward_by_hand():
    assert length_reward(REWARDS, LENGTHS, GROUPS, MASK).tolist() == pytest.approx(EXPECTED)
    # Without the mask the 20-token response is group 2's longest: range 2..20.
    unmasked = length_reward(REWARDS, LENGTHS, GROUPS)
    assert unmasked[7:].tolist() == pytest.approx([0.0, min(0.0, 0.5 - 8 / 18), 0.5 - 4 / 18, -0.5])
    # A graded (non-binary) reward: correct means >= correct_reward.
    graded = length_reward(torch.tensor([0.9, 0.6]), torch.tensor([2.0, 4.0]), torch.tensor([0, 0]),
                           correct_reward=0.5)
    assert graded.tolist() == pytest.approx([0.5, -0.5])
    assert length_reward(torch.tensor([0.9, 0.6]), torch.tensor([2.0, 4.0]), torch.tensor([0, 0])).tolist() == [0.0, -0.5]
    with pytest.raises(ValueError, match="response_lengths"):
        length_reward(REWARDS, LENGTHS[:3], GROUPS)


def _rollout(lengths, rewards):
    samples = [SimpleNamespace(loss_multiplier=1.0, message_log=[
        {"role": "user", "token_ids": torch.zeros(3)},
        {"role": "assistant", "token_ids": torch.zeros(int(n)), "generation_logprobs": torch.zeros(int(n))}])
        for n in lengths]
    n = len(samples)
    return SimpleNamespace(samples=samples, rewards=torch.tensor(rewards), overlong=torch.zeros(n, dtype=torch.bool),
                           timed_out=torch.zeros(n, dtype=torch.bool))


@pytest.mark.parametrize("step, applied", [(1, False), (2, True)])
def test_grpo_adds_the_weighted_length_reward_before_the_advantages(step, applied):
    """Group of 4 with rewards [1, 1, 0, 1] and lengths [4, 6, 8, 12]: the shaped rewards are
    [1.25, 1.125, 0.0, 0.75] with weight 0.5, after `warmup_steps` 2 completed steps."""
    cfg = load_config("grpo", overrides=[
        "sft_warmup=null", "grpo.num_prompts_per_step=1", "grpo.num_generations_per_prompt=4",
        "policy.train_global_batch_size=4", "grpo.normalize_rewards=false",
        "reward_shaping.length_penalty.enabled=true", "reward_shaping.length_penalty.weight=0.5",
        "reward_shaping.length_penalty.warmup_steps=2",
    ])
    ctx = SimpleNamespace(cfg=cfg, step=step)
    (group,) = score_groups(ctx, _rollout([4, 6, 8, 12], [1.0, 1.0, 0.0, 1.0]), 1, version=step)
    shaped = [1.25, 1.125, 0.0, 0.75] if applied else [1.0, 1.0, 0.0, 1.0]
    mean = sum(shaped) / 4
    assert [s.advantage for s in group.samples] == pytest.approx([r - mean for r in shaped])  # Dr.GRPO: r - mean
    assert group.has_signal  # judged on the environment's rewards, before shaping


def test_ppo_gae_reads_the_length_reward():
    """PPO: the rewards GAE reads (`training_batch`'s `rewards`, placed on each row's last generated
    token) are the ones the group's advantages would use, length reward included: with values 0,
    gamma 1 and lambda 1 each generated token's advantage is its row's shaped reward."""
    from posttrain.algorithms.experience import training_batch
    from posttrain.algorithms.ppo import gae_targets
    from posttrain.data.sample import Sample

    cfg = load_config("ppo", overrides=[
        "sft_warmup=null", "grpo.num_prompts_per_step=1", "grpo.num_generations_per_prompt=4",
        "policy.train_global_batch_size=4", "reward_shaping.length_penalty.enabled=true",
        "reward_shaping.length_penalty.weight=0.5", "critic.gamma=1.0", "critic.lambda_actor=1.0",
        "critic.lambda_critic=1.0",
    ])
    lengths, rewards = [4, 6, 8, 12], [1.0, 1.0, 0.0, 1.0]
    samples = [Sample(message_log=[
        {"role": "user", "content": "q", "token_ids": torch.ones(3, dtype=torch.long)},
        {"role": "assistant", "content": "a", "token_ids": torch.ones(n, dtype=torch.long),
         "generation_logprobs": torch.zeros(n)}], prompt_length=3, reward=r) for n, r in zip(lengths, rewards)]
    rollout = SimpleNamespace(samples=samples, rewards=torch.tensor(rewards), overlong=torch.zeros(4, dtype=torch.bool),
                              timed_out=torch.zeros(4, dtype=torch.bool))
    ctx = SimpleNamespace(cfg=cfg, step=1, tokenizer=SimpleNamespace(pad_token_id=0), envs={})
    groups = score_groups(ctx, rollout, 1, version=1)
    train_data, _ = training_batch(ctx, groups, groups, [{}])
    shaped = [1.25, 1.125, 0.0, 0.75]  # as in the GRPO test above: weight 0.5 of [0.5, 0.25, 0.0, -0.5]
    assert train_data["rewards"].tolist() == pytest.approx(shaped)
    values = torch.zeros_like(train_data["token_mask"], dtype=torch.float32)
    advantages, returns = gae_targets(cfg, train_data, values, None)
    mask = train_data["token_mask"] > 0
    for row, reward in enumerate(shaped):
        assert advantages[row][mask[row]].tolist() == pytest.approx([reward] * lengths[row])
        assert returns[row][mask[row]].tolist() == pytest.approx([reward] * lengths[row])


@pytest.mark.parametrize("overrides, warned", [
    (["reward_shaping.length_penalty.enabled=true"], True),  # GRPO's std division: the warning
    (["reward_shaping.length_penalty.enabled=true", "grpo.normalize_rewards=false"], False),  # Dr.GRPO's advantages
    ([], False),  # no penalty
])
def test_the_length_penalty_under_the_std_division_is_warned_at_start_up(overrides, warned):
    from posttrain.config.schema import length_penalty_note

    note = length_penalty_note(load_config("grpo", None, overrides))
    assert (note is not None) == warned
    if warned:
        assert note.startswith("[posttrain] warning: reward_shaping.length_penalty with grpo.normalize_rewards=true")
        assert "grpo.normalize_rewards=false" in note and "\n" not in note
