"""CISPO (`loss_fn.use_cispo`): loss and gradient against the formula worked by hand."""

import math

import pytest
import torch

from posttrain.algorithms.loss import ClippedPGLoss
from posttrain.config.schema import LossConfig
from posttrain.utils.metrics import valid_counts

# Ratios r = pi / pi_old per token, and the clip [1 - 0.2, 1 + 0.28] = [0.8, 1.28]: the clip binds
# below (0.5), above (1.5 and 3.0), and not at all (0.9, 1.1).
RATIOS = [0.5, 0.9, 1.1, 1.5, 3.0]
CLAMPED = [0.8, 0.9, 1.1, 1.28, 1.28]
ADVANTAGES = [1.0, -1.0, 2.0, 1.0, -0.5]
PREV = [-1.0, -2.0, -0.5, -3.0, -1.5]


def batch_of(ratios, advantages, prev, extra_row=True):
    """Row 0: the tokens above (position 0 is the prompt). Row 1 (`extra_row`): two tokens that are
    masked out of the loss (token_mask 0 and sample_mask 0) and must change nothing."""
    n = len(ratios)
    logprobs = [[0.0] + [p + math.log(r) for p, r in zip(prev, ratios)]]
    rows = {
        "token_mask": [[0.0] + [1.0] * n],
        "sample_mask": [1.0],
        "advantages": [[0.0] + list(advantages)],
        "prev_logprobs": [[0.0] + list(prev)],
    }
    if extra_row:
        logprobs.append([0.0, -0.3, -7.0] + [0.0] * (n - 2))
        rows["token_mask"].append([0.0, 1.0, 0.0] + [0.0] * (n - 2))
        rows["sample_mask"].append(0.0)
        rows["advantages"].append([0.0, 5.0, 5.0] + [0.0] * (n - 2))
        rows["prev_logprobs"].append([0.0, -1.0, -1.0] + [0.0] * (n - 2))
    batch = {k: torch.tensor(v) for k, v in rows.items()}
    batch["generation_logprobs"] = batch["prev_logprobs"].clone()
    return torch.tensor(logprobs, requires_grad=True), batch


def call(loss_fn, logprobs, batch):
    seqs, toks = valid_counts(batch)
    return loss_fn(logprobs, batch, seqs, toks)


def test_loss_and_gradient_match_the_formula_by_hand():
    """J = mean_t sg(clip(r_t)) A_t logp_t, so loss = -J and d loss / d logp_t = -clip(r_t) A_t / N:
    every token keeps a gradient, the clipped ones with their bound as the weight."""
    logprobs, batch = batch_of(RATIOS, ADVANTAGES, PREV)
    loss_fn = ClippedPGLoss(use_cispo=True, ratio_clip_min=0.2, ratio_clip_max=0.28)
    loss, metrics = call(loss_fn, logprobs, batch)

    n = len(RATIOS)
    logp = [p + math.log(r) for p, r in zip(PREV, RATIOS)]
    by_hand = -sum(c * a * lp for c, a, lp in zip(CLAMPED, ADVANTAGES, logp)) / n
    assert loss.item() == pytest.approx(by_hand, rel=1e-6)
    assert metrics["actor_loss"] == pytest.approx(by_hand, rel=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(3 / 5)  # 0.5 below, 1.5 and 3.0 above
    assert metrics["probs_ratio_clamped_min"] == pytest.approx(0.8)
    assert metrics["probs_ratio_clamped_max"] == pytest.approx(1.28)

    loss.backward()
    hand_gradient = [-c * a / n for c, a in zip(CLAMPED, ADVANTAGES)]
    assert logprobs.grad[0, 1:].tolist() == pytest.approx(hand_gradient, rel=1e-6)
    assert logprobs.grad[0, 0].item() == 0.0
    assert logprobs.grad[1].abs().sum().item() == 0.0  # masked row and tokens: no gradient

    # PPO's clip on the same tokens: the tokens where its clipped branch binds (A > 0 above the
    # range, A < 0 below it) get no gradient at all; CISPO's gradient there is -A * bound / N.
    logprobs_ppo, batch_ppo = batch_of(RATIOS, ADVANTAGES, PREV)
    ppo_loss, _ = call(ClippedPGLoss(ratio_clip_min=0.2, ratio_clip_max=0.28), logprobs_ppo, batch_ppo)
    ppo_loss.backward()
    assert logprobs_ppo.grad[0, 4].item() == 0.0  # r = 1.5, A = 1 > 0: clipped above
    assert logprobs.grad[0, 4].item() == pytest.approx(-1.28 * 1.0 / n)


def test_on_policy_it_is_reinforce_and_importance_correction_multiplies_on_top():
    # Without prev_logprobs (one optimizer step per batch) r = 1: the loss is -A * logp, REINFORCE's.
    logprobs, batch = batch_of([1.0] * 5, ADVANTAGES, PREV, extra_row=False)
    del batch["prev_logprobs"]
    cispo, _ = call(ClippedPGLoss(use_cispo=True), logprobs, batch)
    reinforce, _ = call(ClippedPGLoss(disable_ppo_ratio=True), logprobs, batch)
    assert cispo.item() == pytest.approx(reinforce.item(), rel=1e-6)

    # The train/inference importance weight exp(prev - gen) is a second detached factor.
    logprobs, batch = batch_of(RATIOS, ADVANTAGES, PREV, extra_row=False)
    batch["generation_logprobs"][0, 1:] -= math.log(2.0)  # w = 2 on every token
    loss, metrics = call(ClippedPGLoss(use_cispo=True, use_importance_sampling_correction=True,
                                       ratio_clip_min=0.2, ratio_clip_max=0.28), logprobs, batch)
    loss.backward()
    n = len(RATIOS)
    assert logprobs.grad[0, 1:].tolist() == pytest.approx([-2.0 * c * a / n for c, a in zip(CLAMPED, ADVANTAGES)],
                                                          rel=1e-5)
    assert metrics["sampling_importance_ratio"] == pytest.approx(2.0, rel=1e-5)


@pytest.mark.parametrize("option, key", [
    (dict(token_level_loss=False), "token_level_loss=false"),
    (dict(token_level_loss=False, sequence_level_importance_ratios=True), "token_level_loss=false"),
    (dict(ratio_clip_c=3.0), "ratio_clip_c"),
    (dict(force_on_policy_ratio=True), "force_on_policy_ratio"),
    (dict(disable_ppo_ratio=True), "disable_ppo_ratio"),
])
def test_options_cispo_cannot_take_are_refused_in_one_line(option, key):
    with pytest.raises(ValueError, match=rf"loss_fn.use_cispo cannot be combined with loss_fn.{key} "):
        LossConfig(use_cispo=True, **option)
    with pytest.raises(ValueError, match="loss_fn.use_cispo"):
        ClippedPGLoss(use_cispo=True, **option)
