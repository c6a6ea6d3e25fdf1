"""Advantage estimators and reward shaping against hand-computed values."""

import math

import pytest
import torch

from posttrain.evals.eval import pass_at_k
from posttrain.algorithms.advantages import (
    apply_overlong_penalty,
    broadcast_to_tokens,
    compute_advantages,
    filter_zero_variance_groups,
    group_baseline_and_std,
    group_mean,
    group_std,
)

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def test_grpo_sample_std_is_the_default():
    # NeMo-RL and TRL divide by the sample std (n - 1): rewards [1, 3] -> mean 2, std sqrt(2).
    adv = compute_advantages("grpo", torch.tensor([1.0, 3.0]), torch.tensor([0, 0]))
    assert adv.tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], rel=1e-5)  # -+0.707
    adv = compute_advantages("grpo", torch.tensor([1.0, 3.0]), torch.tensor([0, 0]), group_std="population")
    assert adv.tolist() == pytest.approx([-1.0, 1.0], rel=1e-5)
    # Group of 4 [1, 0, 0, 1]: sample std sqrt(1/3), population 0.5.
    adv = compute_advantages("grpo", REWARDS, GROUPS)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="group_std"):
        compute_advantages("grpo", REWARDS, GROUPS, group_std="biased")


def test_grpo_sample_std_with_uneven_valid_counts():
    # Overlong filtering leaves 3 valid samples in group 0 and 2 in group 1.
    rewards = torch.tensor([0.0, 1.0, 2.0, 9.0, 4.0, 6.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    adv = compute_advantages("grpo", rewards, groups, mask)
    # Group 0: mean 1, sample std 1; group 1: mean 5, sample std sqrt(2).
    expected = [-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 0.0, -1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_grpo_mean_baseline_with_and_without_std():
    adv = compute_advantages("grpo", REWARDS, GROUPS, normalize_rewards=True, group_std="population")
    # Group 0: mean 0.5, population std 0.5; group 1 has std 0 and is left unnormalised (all 0).
    a = 0.5 / (0.5 + 1e-6)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0, 0, 0, 0])
    adv = compute_advantages("grpo", REWARDS, GROUPS, normalize_rewards=False)  # Dr.GRPO
    assert adv.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_grpo_leave_one_out():
    baseline, std = group_baseline_and_std(REWARDS, GROUPS, leave_one_out=True, unbiased=False)
    # r=1: others (0, 0, 1) -> mean 1/3; r=0: others (1, 0, 1) -> 2/3; both population std sqrt(2/9).
    assert baseline[:4].tolist() == pytest.approx([1 / 3, 2 / 3, 2 / 3, 1 / 3])
    assert std[:4].tolist() == pytest.approx([math.sqrt(2 / 9)] * 4)
    # Sample std of the other three (NeMo-RL's unbiased leave-one-out estimate): sqrt(1/3).
    _, std = group_baseline_and_std(REWARDS, GROUPS, leave_one_out=True)
    assert std[:4].tolist() == pytest.approx([math.sqrt(1 / 3)] * 4)
    adv = compute_advantages("grpo", REWARDS, GROUPS, normalize_rewards=False, leave_one_out=True)
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0])
    adv = compute_advantages("grpo", REWARDS, GROUPS, leave_one_out=True, group_std="population")
    assert adv[:4].tolist() == pytest.approx([math.sqrt(2), -math.sqrt(2), -math.sqrt(2), math.sqrt(2)], rel=1e-5)
    adv = compute_advantages("grpo", REWARDS, GROUPS, leave_one_out=True)
    b = (2 / 3) / math.sqrt(1 / 3)
    assert adv[:4].tolist() == pytest.approx([b, -b, -b, b], rel=1e-5)


def test_sample_mask_excluded_from_group_statistics():
    rewards = torch.tensor([1.0, 0.0, 0.0, 5.0, 2.0, 7.0])
    groups = torch.tensor([3, 3, 3, 3, 1, 1])  # ids need not be contiguous or sorted
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    adv = compute_advantages("grpo", rewards, groups, mask, normalize_rewards=False)
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0])  # lone valid sample: 0
    std = math.sqrt(1 / 3 - 1 / 9)
    adv = compute_advantages("grpo", rewards, groups, mask, group_std="population")
    assert adv[:3].tolist() == pytest.approx([2 / 3 / std, -1 / 3 / std, -1 / 3 / std], rel=1e-5)
    assert group_mean(rewards, groups, mask).tolist() == pytest.approx([0, 2.0, 0, 1 / 3])
    # group_std's default agrees with the advantage's (the sample std, divide by n - 1).
    assert group_std(rewards, groups, mask)[3].item() == pytest.approx(math.sqrt(1 / 3))
    assert group_std(rewards, groups, mask, unbiased=False)[3].item() == pytest.approx(std)


def test_reinforce_pp_global_whitening():
    adv = compute_advantages("reinforce_pp", torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.tensor([0, 0, 1, 1]))
    # Centred [0.5, -0.5, 0, 0]: global mean 0, population std sqrt(0.125).
    assert adv.tolist() == pytest.approx([math.sqrt(2), -math.sqrt(2), 0, 0], rel=1e-5)


def test_estimator_errors_and_broadcast():
    with pytest.raises(ValueError, match="registered"):
        compute_advantages("ppo", REWARDS, GROUPS)
    with pytest.raises(TypeError, match="grpo"):
        compute_advantages("grpo", REWARDS, GROUPS, use_leave_one_out_baseline=True)
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", REWARDS, GROUPS.float())
    token_mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    assert broadcast_to_tokens(torch.tensor([2.0, -1.0]), token_mask).tolist() == [[0, 2, 2], [0, 0, -1]]


def test_overlong_penalty():
    rewards = torch.ones(4)
    shaped = apply_overlong_penalty(rewards, torch.tensor([5, 6, 8, 10]), max_response_length=10, buffer_length=4)
    assert shaped.tolist() == pytest.approx([1.0, 1.0, 0.5, 0.0])
    shaped = apply_overlong_penalty(rewards, torch.tensor([8, 10, 6, 0]), 10, 4, penalty=0.5)
    assert shaped.tolist() == pytest.approx([0.75, 0.5, 1.0, 1.0])
    with pytest.raises(ValueError, match="buffer_length"):
        apply_overlong_penalty(rewards, torch.tensor([1, 2, 3, 4]), 10, 11)


def test_filter_zero_variance_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    assert filter_zero_variance_groups(rewards, groups).tolist() == [False, True, False]
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    assert filter_zero_variance_groups(rewards, groups, num_groups=4, sample_mask=mask).tolist() == [
        False, False, False, False,
    ]


def test_pass_at_k():
    assert pass_at_k(5, 2, 1).item() == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2).item() == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    values = pass_at_k(4, torch.tensor([0, 1, 3, 4]), 2)
    assert values.tolist() == pytest.approx([0.0, 0.5, 1.0, 1.0])  # C(3,2)/C(4,2) = 1/2
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
