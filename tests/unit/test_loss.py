"""Loss functions against hand-computed references (tiny tensors)."""

import math

import pytest
import torch

from posttrain.algorithms.loss import (
    LOSS_REGISTRY,
    ClippedPGLoss,
    NLLLoss,
    build_loss,
    masked_mean,
    masked_sum,
    per_token_kl,
)
from posttrain.algorithms.preference_loss import DPOLoss, PreferenceLoss
from posttrain.config.schema import LossConfig
from posttrain.utils.metrics import accumulate, valid_counts


def one_row_batch(log_ratio, advantages, gen_minus_prev=None):
    """One sequence whose positions 1.. are all trained on; prev = 0, logprobs = log_ratio."""
    n = len(log_ratio)
    prev = torch.zeros(1, n + 1)
    logprobs = torch.tensor([[0.0, *log_ratio]], requires_grad=True)
    gen = prev.clone()
    if gen_minus_prev is not None:
        gen[0, 1:] = torch.tensor(gen_minus_prev)
    batch = {
        "token_mask": torch.tensor([[0.0] + [1.0] * n]),
        "sample_mask": torch.ones(1),
        "advantages": torch.tensor([[0.0] + list(advantages)]),
        "prev_logprobs": prev,
        "generation_logprobs": gen,
    }
    return logprobs, batch


def call(loss_fn, logprobs, batch):
    seqs, toks = valid_counts(batch)
    return loss_fn(logprobs, batch, seqs, toks)


# ------------------------------------------------------------------------------------- helpers
def test_masked_helpers_and_counts():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    assert masked_sum(values, mask).item() == 4.0
    assert masked_mean(values, mask).item() == 2.0
    assert masked_mean(values, mask, dim=-1).tolist() == [2.0, 0.0]  # empty row: 0, not NaN
    assert masked_mean(values, mask, global_normalization_factor=8).item() == 0.5

    batch = {"token_mask": torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 1.0, 1.0]]),
             "sample_mask": torch.tensor([1.0, 1.0, 0.0])}
    seqs, toks = valid_counts(batch)
    assert seqs.item() == 2.0 and toks.item() == 3.0  # position 0 never counts


def test_nll_loss_value():
    logprobs = torch.tensor([[0.0, -1.0, -2.0, -9.0], [0.0, -3.0, -9.0, -9.0]])
    batch = {"token_mask": torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]), "sample_mask": torch.ones(2)}
    loss, metrics = call(NLLLoss(), logprobs, batch)
    assert loss.item() == pytest.approx((1 + 2 + 3) / 3)
    assert metrics["num_valid_tokens"] == 3 and metrics["num_valid_samples"] == 2


# -------------------------------------------------------------------------------- clipped PG loss
RATIOS = [0.5, 0.9, 1.1, 1.5]


@pytest.mark.parametrize("advantage, expected", [(1.0, [-0.5, -0.9, -1.1, -1.28]), (-1.0, [0.8, 0.9, 1.1, 1.5])])
def test_asymmetric_clip(advantage, expected):
    """clip-higher: r_hat = clamp(r, 0.8, 1.28); L = max(-A r, -A r_hat)."""
    logprobs, batch = one_row_batch([math.log(r) for r in RATIOS], [advantage] * 4)
    loss_fn = ClippedPGLoss(ratio_clip_min=0.2, ratio_clip_max=0.28)
    loss, metrics = call(loss_fn, logprobs, batch)
    assert loss.item() == pytest.approx(sum(expected) / 4)
    assert metrics["clip_fraction"] == pytest.approx(0.25)
    assert metrics["probs_ratio"] == pytest.approx(sum(RATIOS) / 4)
    assert metrics["probs_ratio_min"] == pytest.approx(0.5) and metrics["probs_ratio_max"] == pytest.approx(1.5)
    assert metrics["probs_ratio_clamped_min"] == pytest.approx(0.8)
    assert metrics["probs_ratio_clamped_max"] == pytest.approx(1.28)
    loss.backward()
    # The binding clipped token gets no gradient; others get -A * r / 4 (d r / d logp = r).
    clipped = 3 if advantage > 0 else 0
    for i, r in enumerate(RATIOS):
        want = 0.0 if i == clipped else -advantage * r / 4
        assert logprobs.grad[0, i + 1].item() == pytest.approx(want)


def test_dual_clip():
    """A < 0: L = min(max(-A r, -A r_hat), -A c); A > 0 is untouched."""
    logprobs, batch = one_row_batch([math.log(5.0), math.log(2.0), math.log(5.0)], [-1.0, -1.0, 1.0])
    loss, _ = call(ClippedPGLoss(ratio_clip_c=3.0), logprobs, batch)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)


def test_force_on_policy_and_reinforce():
    logprobs, batch = one_row_batch([-0.5, -1.0], [2.0, -1.0])
    del batch["prev_logprobs"]  # not needed when the ratio is forced to 1
    loss, metrics = call(ClippedPGLoss(force_on_policy_ratio=True), logprobs, batch)
    assert loss.item() == pytest.approx((-2.0 + 1.0) / 2)
    assert metrics["probs_ratio"] == pytest.approx(1.0)
    loss.backward()
    assert logprobs.grad[0, 1:].tolist() == pytest.approx([-1.0, 0.5])  # -A / n_tokens

    logprobs, batch = one_row_batch([-0.5, -1.0], [2.0, -1.0])
    loss, _ = call(ClippedPGLoss(disable_ppo_ratio=True), logprobs, batch)
    assert loss.item() == pytest.approx((2.0 * 0.5 + (-1.0) * 1.0) / 2)  # -A * logp


def test_per_token_kl_estimators_and_clamps():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # log r = ref - logp = -1
    assert per_token_kl(logp, ref, "k1").item() == pytest.approx(1.0)
    assert per_token_kl(logp, ref, "k2").item() == pytest.approx(0.5)
    assert per_token_kl(logp, ref, "k3").item() == pytest.approx(math.exp(-1))
    far = torch.tensor([-30.0])  # log r = -30, input-clamped to -20
    assert per_token_kl(torch.zeros(1), far, "k1", input_clamp_value=20.0).item() == pytest.approx(20.0)
    assert per_token_kl(torch.zeros(1), far, "k3", input_clamp_value=20.0).item() == pytest.approx(19.0, abs=1e-6)
    assert per_token_kl(torch.zeros(1), far, "k3", 20.0, output_clamp_value=10.0).item() == pytest.approx(10.0)
    with pytest.raises(ValueError, match="k4"):
        per_token_kl(logp, ref, "k4")


def test_kl_term_in_loss():
    logprobs, batch = one_row_batch([-1.0, -1.0], [0.0, 0.0])
    batch["reference_policy_logprobs"] = torch.tensor([[0.0, -2.0, -1.0]])  # log r = -1, 0
    loss, metrics = call(ClippedPGLoss(reference_policy_kl_penalty=0.1, reference_policy_kl_type="k2"), logprobs, batch)
    assert metrics["kl_penalty"] == pytest.approx(0.25)  # (0.5 + 0) / 2
    assert loss.item() == pytest.approx(0.025)
    missing = {k: v for k, v in batch.items() if k != "reference_policy_logprobs"}
    with pytest.raises(KeyError, match="reference_policy_logprobs"):
        call(ClippedPGLoss(reference_policy_kl_penalty=0.1), logprobs, missing)


def test_gspo_sequence_ratio():
    """GSPO: r = exp(mean_t(logp - prev)) per sequence, sequence-level mean of per-token losses."""
    logprobs = torch.tensor([[0.0, 0.1, 0.3, 0.0], [0.0, -0.4, 0.0, 0.0]], requires_grad=True)
    batch = {
        "token_mask": torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]),
        "sample_mask": torch.ones(2),
        "advantages": torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, -2.0, -2.0, -2.0]]),
        "prev_logprobs": torch.zeros(2, 4),
        "generation_logprobs": torch.zeros(2, 4),
    }
    cfg = dict(sequence_level_importance_ratios=True, token_level_loss=False, ratio_clip_min=0.5, ratio_clip_max=0.5)
    loss, metrics = call(ClippedPGLoss(**cfg), logprobs, batch)
    r0, r1 = math.exp(0.2), math.exp(-0.4)
    assert loss.item() == pytest.approx((-1.0 * r0 + 2.0 * r1) / 2)
    assert metrics["probs_ratio"] == pytest.approx((2 * r0 + r1) / 3)


def test_token_vs_sequence_aggregation():
    """Per-token losses -A (ratio 1): token-level = sum / 4 tokens, sequence-level = mean of row means."""
    logprobs = torch.zeros(2, 4)
    batch = {
        "token_mask": torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]]),
        "sample_mask": torch.ones(2),
        "advantages": torch.tensor([[0.0, 4.0, 0.0, 0.0], [0.0, 1.0, 2.0, 3.0]]),
        "prev_logprobs": torch.zeros(2, 4),
        "generation_logprobs": torch.zeros(2, 4),
    }
    token_loss, _ = call(ClippedPGLoss(token_level_loss=True), logprobs, batch)
    seq_loss, _ = call(ClippedPGLoss(token_level_loss=False), logprobs, batch)
    assert token_loss.item() == pytest.approx(-(4 + 1 + 2 + 3) / 4)
    assert seq_loss.item() == pytest.approx(-(4 + 2) / 2)


# ------------------------------------------------------------------------------ importance sampling
# prev - gen = log w with w = [0.5, 1, 3]; advantages 1 and ratio 1, so each token's loss is -w.
IS_WEIGHTS = [0.5, 1.0, 3.0]


def is_loss(**cfg):
    logprobs, batch = one_row_batch([0.0, 0.0, 0.0], [1.0] * 3, [-math.log(w) for w in IS_WEIGHTS])
    return call(ClippedPGLoss(use_importance_sampling_correction=True, **cfg), logprobs, batch)


def test_importance_sampling_correction_and_truncation():
    loss, metrics = is_loss()
    assert loss.item() == pytest.approx(-sum(IS_WEIGHTS) / 3)
    assert metrics["sampling_importance_ratio"] == pytest.approx(sum(IS_WEIGHTS) / 3)
    loss, _ = is_loss(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0)
    assert loss.item() == pytest.approx(-(0.5 + 1 + 2) / 3)
    loss, _ = is_loss(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0,
                      truncated_importance_sampling_ratio_min=0.6)
    assert loss.item() == pytest.approx(-(0.6 + 1 + 2) / 3)
    loss, metrics = is_loss(truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=2.0,
                            truncated_importance_sampling_ratio_min=0.6)
    assert loss.item() == pytest.approx(-1.0 / 3)
    assert metrics["is_oob_ratio"] == pytest.approx(2 / 3)
    # Without the correction flag the weights only show up in metrics.
    logprobs, batch = one_row_batch([0.0, 0.0, 0.0], [1.0] * 3, [-math.log(w) for w in IS_WEIGHTS])
    assert call(ClippedPGLoss(), logprobs, batch)[0].item() == pytest.approx(-1.0)


def test_seq_mask_tis_and_non_finite_weights():
    # Row 0: log w = [0.1, -0.1] (geometric mean 1, kept); row 1: [1.0, 1.0] (geometric mean e, dropped).
    log_w = torch.tensor([[0.0, 0.1, -0.1], [0.0, 1.0, 1.0]])
    batch = {
        "token_mask": torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]),
        "sample_mask": torch.ones(2),
        "advantages": torch.ones(2, 3),
        "prev_logprobs": log_w,
        "generation_logprobs": torch.zeros(2, 3),
    }
    loss_fn = ClippedPGLoss(use_importance_sampling_correction=True, truncated_importance_sampling_type="seq-mask-tis",
                            truncated_importance_sampling_ratio=1.5, truncated_importance_sampling_ratio_min=0.5)
    loss, metrics = call(loss_fn, log_w.clone(), batch)  # logprobs == prev: ratio 1
    assert loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(-0.1)) / 4)  # raw token weights kept
    assert metrics["is_oob_ratio"] == pytest.approx(0.5)

    # A -inf generation logprob gives an infinite weight, which becomes 0.
    logprobs, batch = one_row_batch([0.0, 0.0], [1.0, 1.0], [float("-inf"), 0.0])
    loss, _ = call(ClippedPGLoss(use_importance_sampling_correction=True), logprobs, batch)
    assert loss.item() == pytest.approx(-0.5)


def test_gspo_sequence_importance_weight():
    # Under GSPO the weight is exp(sum_t(prev - gen)) for the whole sequence.
    logprobs, batch = one_row_batch([0.0, 0.0], [1.0, 1.0], [-0.2, -0.3])
    cfg = dict(sequence_level_importance_ratios=True, token_level_loss=False, use_importance_sampling_correction=True)
    loss, metrics = call(ClippedPGLoss(**cfg), logprobs, batch)
    assert loss.item() == pytest.approx(-math.exp(0.5))
    assert metrics["sampling_importance_ratio"] == pytest.approx(math.exp(0.5))


# ------------------------------------------------------------------------------- mismatch metrics
def test_token_mult_prob_error_and_gen_kl():
    logprobs, batch = one_row_batch([-0.3, -0.7], [1.0, 1.0])
    _, metrics = call(ClippedPGLoss(), logprobs, batch)
    assert metrics["token_mult_prob_error"] == pytest.approx(1.0)
    assert metrics["gen_kl_error"] == pytest.approx(0.0)

    logprobs, batch = one_row_batch([0.0, 0.0], [1.0, 1.0], [0.1, -0.2])  # gen - prev
    _, metrics = call(ClippedPGLoss(), logprobs, batch)
    assert metrics["token_mult_prob_error"] == pytest.approx((math.exp(0.1) + math.exp(0.2)) / 2)
    k3 = [math.exp(d) - 1 - d for d in (-0.1, 0.2)]  # log r = prev - gen
    assert metrics["gen_kl_error"] == pytest.approx(sum(k3) / 2)
    assert metrics["num_valid_samples"] == 1.0


# ---------------------------------------------------------------------- micro-batch = full batch
def random_pg_batch(generator, batch_size=6, seq_len=7):
    lengths = torch.randint(3, seq_len + 1, (batch_size,), generator=generator)
    positions = torch.arange(seq_len)[None, :]
    token_mask = ((positions >= 2) & (positions < lengths[:, None])).float()
    lp = lambda: -torch.rand(batch_size, seq_len, generator=generator) * 2 * token_mask  # noqa: E731
    advantages = torch.randn(batch_size, 1, generator=generator).expand(-1, seq_len).clone()
    batch = {
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0]),
        "advantages": advantages,
        "prev_logprobs": lp(),
        "generation_logprobs": lp(),
        "reference_policy_logprobs": lp(),
    }
    return lp(), batch


@pytest.mark.parametrize(
    "cfg",
    [
        dict(reference_policy_kl_penalty=0.1, use_importance_sampling_correction=True, ratio_clip_c=3.0),
        dict(token_level_loss=False, sequence_level_importance_ratios=True, reference_policy_kl_penalty=0.05,
             use_on_policy_kl_approximation=True),
        dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
             truncated_importance_sampling_ratio=1.5, truncated_importance_sampling_ratio_min=0.7),
        dict(use_cispo=True, ratio_clip_min=0.2, ratio_clip_max=0.28, use_importance_sampling_correction=True),
    ],
)
def test_microbatches_sum_to_full_batch(cfg):
    logprobs, batch = random_pg_batch(torch.Generator().manual_seed(0))
    loss_fn = ClippedPGLoss(**cfg)
    seqs, toks = valid_counts(batch)

    full_lp = logprobs.clone().requires_grad_()
    full_loss, full_metrics = loss_fn(full_lp, batch, seqs, toks)
    full_loss.backward()

    split_lp = logprobs.clone().requires_grad_()
    total, summed = 0.0, {}
    for rows in (slice(0, 2), slice(2, 6)):
        micro = {k: v[rows] for k, v in batch.items()}
        loss, metrics = loss_fn(split_lp[rows], micro, seqs, toks)
        loss.backward()
        total += loss.item()
        accumulate(summed, metrics)  # the policy worker's rule: sum, _min / _max by min / max
    assert total == pytest.approx(full_loss.item(), rel=1e-5)
    assert summed.keys() == full_metrics.keys()
    for name, value in full_metrics.items():
        assert summed[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    torch.testing.assert_close(split_lp.grad, full_lp.grad)


# ------------------------------------------------------------------------------------ preferences
def dpo_batch():
    # Pair: chosen sum(logp - ref) = 1.0 over 2 tokens, rejected = -0.5 over 1 token.
    logprobs = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, 0.0]])
    batch = {
        "token_mask": torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]),
        "sample_mask": torch.ones(2),
        "reference_policy_logprobs": torch.tensor([[0.0, -1.5, -2.5], [0.0, -2.5, -7.0]]),
    }
    return logprobs, batch


def test_dpo_loss_values():
    logprobs, batch = dpo_batch()
    loss, metrics = call(DPOLoss(beta=0.1), logprobs, batch)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.15)))
    assert metrics["accuracy"] == 1.0
    assert metrics["rewards_chosen_mean"] == pytest.approx(1.0)
    assert metrics["rewards_rejected_mean"] == pytest.approx(-0.5)
    assert metrics["reward_margin"] == pytest.approx(1.5)
    assert metrics["num_valid_samples"] == 1.0

    loss, metrics = call(DPOLoss(beta=0.1, sft_loss_weight=0.5, preference_loss_weight=2.0), logprobs, batch)
    assert metrics["sft_loss"] == pytest.approx(3.0)  # -sum(logp) of the chosen row
    assert loss.item() == pytest.approx(2 * math.log1p(math.exp(-0.15)) + 0.5 * 3.0)

    loss, metrics = call(DPOLoss(beta=0.1, preference_average_log_probs=True), logprobs, batch)
    assert metrics["rewards_chosen_mean"] == pytest.approx(0.5)  # 1.0 / 2 tokens
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.1)))


def test_bradley_terry_loss_and_accuracy():
    scores = torch.tensor([2.0, 1.0, 0.0, 1.0])
    batch = {"sample_mask": torch.ones(4)}
    loss, metrics = PreferenceLoss()(scores, batch, 4.0, 0.0)
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1)) + math.log1p(math.exp(1))) / 2)
    assert metrics["accuracy"] == 0.5
    assert metrics["rewards_chosen_mean"] == pytest.approx(1.0)
    assert metrics["rewards_rejected_mean"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="odd"):
        PreferenceLoss()(scores[:3], {"sample_mask": torch.ones(3)}, 3.0, 0.0)


def test_preference_ties_count_half():
    """A tie is a coin flip, not a loss: DPO at step 0 (policy == reference, every pair tied) and a
    reward model scoring a pair equally get accuracy 0.5 for it."""
    logprobs, batch = dpo_batch()
    batch["reference_policy_logprobs"] = logprobs.clone()  # step 0: every implicit reward is 0
    _, metrics = call(DPOLoss(beta=0.1), logprobs, batch)
    assert metrics["accuracy"] == 0.5 and metrics["reward_margin"] == 0.0
    scores = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0, 3.0])  # a win, a tie, a loss
    _, metrics = PreferenceLoss()(scores, {"sample_mask": torch.ones(6)}, 6.0, 0.0)
    assert metrics["accuracy"] == pytest.approx(0.5)
    _, metrics = PreferenceLoss()(scores[:4], {"sample_mask": torch.ones(4)}, 4.0, 0.0)  # a win and a tie
    assert metrics["accuracy"] == pytest.approx(0.75)


# ------------------------------------------------------------------------------- registry, errors
def test_registry_and_config_errors():
    assert isinstance(build_loss("clipped_pg", ratio_clip_max=0.28), ClippedPGLoss)
    assert build_loss(LossConfig(), ratio_clip_max=0.28).cfg.ratio_clip_max == 0.28
    assert isinstance(build_loss("nll"), NLLLoss)
    assert build_loss("dpo", beta=0.2).beta == 0.2
    assert build_loss("preference").input_type == "scores"
    assert build_loss("posttrain.algorithms.preference_loss:DPOLoss", beta=0.3).beta == 0.3
    with pytest.raises(KeyError, match=r"unknown loss 'dpo2'.*'distillation'.*did you mean 'dpo'"):
        build_loss("dpo2")  # the error lists every built-in loss, also those registered beside loss.py
    assert {"nll", "clipped_pg", "preference", "dpo", "distillation"} <= set(LOSS_REGISTRY)
    with pytest.raises(ValueError, match="truncated_importance_sampling_ratio"):
        ClippedPGLoss(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis")
    with pytest.raises(ValueError, match="use_importance_sampling_correction"):
        ClippedPGLoss(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0)
    logprobs, batch = one_row_batch([0.0], [1.0])
    with pytest.raises(ValueError, match="advantages"):
        call(ClippedPGLoss(), logprobs, {**batch, "advantages": torch.zeros(1)})


def test_prev_logprobs_may_be_left_out_for_a_single_optimizer_step():
    # Without prev_logprobs the loss uses the current logprobs, detached: the same loss, gradient
    # and metrics as passing prev = logprobs exactly, for every ratio variant.
    for options in ({}, {"ratio_clip_c": 3.0}, {"sequence_level_importance_ratios": True, "token_level_loss": False},
                    {"use_importance_sampling_correction": True}):
        results = []
        for with_prev in (True, False):
            logprobs, batch = one_row_batch([-0.5, -1.0, -0.25], [2.0, -1.0, 0.5], gen_minus_prev=[0.1, -0.2, 0.0])
            gen_offset = batch["generation_logprobs"] - batch["prev_logprobs"]
            batch["prev_logprobs"] = logprobs.detach().clone()
            batch["generation_logprobs"] = batch["prev_logprobs"] + gen_offset
            if not with_prev:
                del batch["prev_logprobs"]
            loss, metrics = call(ClippedPGLoss(**options), logprobs, batch)
            loss.backward()
            results.append((loss.item(), logprobs.grad.clone(), metrics))
        (loss_a, grad_a, m_a), (loss_b, grad_b, m_b) = results
        assert loss_a == loss_b and torch.equal(grad_a, grad_b), options
        assert m_a == m_b, options
        assert m_b["probs_ratio"] == 1.0 and m_b["token_mult_prob_error"] > 1.0  # gen differs from prev


def test_check_train_batch_refuses_several_steps_without_prev_logprobs():
    _, batch = one_row_batch([-0.5], [1.0])
    del batch["prev_logprobs"]
    ClippedPGLoss().check_train_batch(batch, num_optimizer_steps=1)
    ClippedPGLoss(force_on_policy_ratio=True).check_train_batch(batch, num_optimizer_steps=3)
    with pytest.raises(ValueError, match="spans 2 optimizer steps but has no 'prev_logprobs'"):
        ClippedPGLoss().check_train_batch(batch, num_optimizer_steps=2)


# ------------------------------------------------------------------ conventions shared with peers
def kl_gradient(form, kl_type="k3", on_policy_approx=False, gen_minus_prev=None):
    """d loss / d logp of one token with logp = log 0.5, ref = log 0.25, beta = 1, advantage 0."""
    logprobs, batch = one_row_batch([math.log(0.5)], [0.0], gen_minus_prev)
    batch["prev_logprobs"][0, 1] = math.log(0.5)
    batch["generation_logprobs"][0, 1] += math.log(0.5)
    batch["reference_policy_logprobs"] = torch.tensor([[0.0, math.log(0.25)]])
    loss_fn = ClippedPGLoss(reference_policy_kl_penalty=1.0, reference_policy_kl_type=kl_type,
                            reference_policy_kl_gradient=form, use_on_policy_kl_approximation=on_policy_approx)
    loss, metrics = call(loss_fn, logprobs, batch)
    loss.backward()
    return logprobs.grad[0, 1].item(), metrics["kl_penalty"]


def test_kl_penalty_gradient_forms():
    # log r = ref - logp = log 0.5: k3 = 0.5 - 1 - log 0.5 = 0.1931..., d k3 / d logp = 1 - 0.5.
    k3 = 0.5 - 1 - math.log(0.5)
    grad, value = kl_gradient("estimator")  # DeepSeek-GRPO / TRL default: the gradient of KL(ref || pi)
    assert value == pytest.approx(k3) and grad == pytest.approx(0.5)
    grad, value = kl_gradient("score_function")  # NeMo-RL: + k3 * d logp / d logp, gradient of KL(pi || ref)
    assert value == pytest.approx(k3) and grad == pytest.approx(0.5 + k3)
    # k1 = logp - ref = log 2: the estimator form has gradient 1, the score-function form 1 + log 2.
    assert kl_gradient("estimator", "k1")[0] == pytest.approx(1.0)
    assert kl_gradient("score_function", "k1")[0] == pytest.approx(1.0 + math.log(2))
    # On-policy approximation: weight pi / pi_gen = e^0.3 in value; the score-function form
    # differentiates it too (d/dlogp [w k3] = w (dk3 + k3)), the estimator form only w dk3.
    w = math.exp(0.3)
    grad, value = kl_gradient("score_function", on_policy_approx=True, gen_minus_prev=[-0.3])
    assert value == pytest.approx(w * k3) and grad == pytest.approx(w * (0.5 + k3))
    grad, _ = kl_gradient("estimator", on_policy_approx=True, gen_minus_prev=[-0.3])
    assert grad == pytest.approx(w * 0.5)


def test_kl_output_clamp_after_weighting_in_score_function_form():
    # k1 = logp - ref = 30 clamps to 20 (input clamp) and then 10 (output clamp); the weight's
    # gradient is clamped away with it under "score_function", as NeMo-RL clamps the weighted value.
    logprobs, batch = one_row_batch([0.0], [0.0])
    batch["reference_policy_logprobs"] = torch.tensor([[0.0, -30.0]])
    for form in ("score_function", "estimator"):
        lp = logprobs.detach().clone().requires_grad_(True)
        loss, metrics = call(ClippedPGLoss(reference_policy_kl_penalty=1.0, reference_policy_kl_type="k1",
                                           reference_policy_kl_gradient=form), lp, batch)
        loss.backward()
        assert metrics["kl_penalty"] == pytest.approx(10.0)
        assert lp.grad[0, 1].item() == pytest.approx(0.0)


def test_importance_weight_metrics_for_every_truncation_mode():
    # Weights 0.5, 1, 3 (prev - gen = log w); bounds [0.6, 2].
    logprobs, batch = one_row_batch([0.0, 0.0, 0.0], [1.0] * 3, [-math.log(w) for w in (0.5, 1.0, 3.0)])
    bounds = dict(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.0,
                  truncated_importance_sampling_ratio_min=0.6)
    _, tis = call(ClippedPGLoss(truncated_importance_sampling_type="tis", **bounds), logprobs, batch)
    assert tis["is_oob_ratio"] == pytest.approx(2 / 3)
    assert tis["sampling_importance_ratio"] == pytest.approx((0.6 + 1 + 2) / 3)  # the weights used
    assert tis["sampling_importance_ratio_untruncated"] == pytest.approx((0.5 + 1 + 3) / 3)
    _, icepop = call(ClippedPGLoss(truncated_importance_sampling_type="icepop", **bounds), logprobs, batch)
    assert icepop["is_oob_ratio"] == pytest.approx(2 / 3)
    assert icepop["sampling_importance_ratio"] == pytest.approx(1 / 3)
    assert icepop["sampling_importance_ratio_untruncated"] == pytest.approx(1.5)
    _, plain = call(ClippedPGLoss(), logprobs, batch)
    assert "is_oob_ratio" not in plain
    assert plain["sampling_importance_ratio"] == plain["sampling_importance_ratio_untruncated"] == pytest.approx(1.5)


def test_gen_kl_error_follows_the_configured_estimator():
    logprobs, batch = one_row_batch([0.0, 0.0], [1.0, 1.0], [0.1, -0.2])  # gen - prev
    _, k1 = call(ClippedPGLoss(reference_policy_kl_type="k1"), logprobs, batch)
    assert k1["gen_kl_error"] == pytest.approx((0.1 - 0.2) / 2)  # k1 = -log r = gen - prev
    _, k2 = call(ClippedPGLoss(reference_policy_kl_type="k2"), logprobs, batch)
    assert k2["gen_kl_error"] == pytest.approx((0.01 + 0.04) / 4)


def test_truncation_bounds_refused_when_empty():
    from pydantic import ValidationError

    from posttrain.config.schema import LossConfig

    bad = dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
               truncated_importance_sampling_ratio=1.5, truncated_importance_sampling_ratio_min=2.0)
    with pytest.raises(ValidationError, match="truncated_importance_sampling_ratio_min=2.0 is greater than"):
        LossConfig(**bad)
    with pytest.raises(ValueError, match="is greater than"):
        ClippedPGLoss(LossConfig().model_copy(update=bad))


def test_score_function_weight_is_detached_where_the_kl_input_clamp_binds():
    """NeMo-RL's case: k3, input clamp 2, logp [-3, -1], reference 0. Token 0's log-ratio 3 is
    clamped to 2, so its estimate is a constant and (NeMo-RL) its weight is detached too: gradient
    0 there, not k3(2) = e^2 - 3 = 4.389; token 1 keeps -(e - 1) + (e - 2) = -1."""
    logprobs = torch.tensor([-3.0, -1.0], requires_grad=True)
    loss_fn = ClippedPGLoss(reference_policy_kl_penalty=1.0, reference_policy_kl_type="k3",
                            reference_policy_kl_gradient="score_function", kl_input_clamp_value=2.0)
    kl = loss_fn._kl_penalty(logprobs, torch.zeros(2), logprobs.detach())
    kl.sum().backward()
    assert logprobs.grad.tolist() == pytest.approx([0.0, -1.0])
    assert kl.tolist() == pytest.approx([math.exp(2) - 3, math.e - 2])


def test_force_on_policy_ratio_ignores_prev_logprobs_in_the_importance_weights():
    """With the ratio forced to 1 the current policy is the previous one: the importance weights
    are pi / pi_gen, whatever prev_logprobs the batch carries (NeMo-RL)."""
    logprobs, batch = one_row_batch([-0.5, -1.0], [2.0, -1.0])  # prev = gen = 0: pi_prev / pi_gen = 1
    loss_fn = ClippedPGLoss(force_on_policy_ratio=True, use_importance_sampling_correction=True,
                            truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=2.0,
                            truncated_importance_sampling_ratio_min=0.5)
    loss, metrics = call(loss_fn, logprobs, batch)
    w = [math.exp(-0.5), math.exp(-1.0)]  # pi / pi_gen; the second is below 0.5, dropped by icepop
    assert loss.item() == pytest.approx((-2.0 * w[0]) / 2)
    assert metrics["is_oob_ratio"] == pytest.approx(1 / 2)


def test_gspo_weights_the_kl_by_the_sequence_ratio():
    """Under GSPO the score-function weight is the sequence's geometric-mean ratio (TRL's
    use_bias_correction_kl with sequence-level importance sampling): d/dlogp_t of sum_s k_s w =
    dk_t + mean_s k_s, where the per-token form gives dk_t + k_t."""
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    k3 = (ref - logp).exp() - 1 - (ref - logp)
    dk3 = 1 - (ref - logp).exp()
    for gspo, expected in ((False, dk3 + k3), (True, dk3 + k3.mean())):
        logprobs = logp.clone().requires_grad_()
        loss_fn = ClippedPGLoss(reference_policy_kl_penalty=1.0, reference_policy_kl_type="k3",
                                reference_policy_kl_gradient="score_function", sequence_level_importance_ratios=gspo,
                                token_level_loss=not gspo)
        kl = loss_fn._kl_penalty(logprobs, ref, logprobs.detach(), torch.ones(1, 2))
        kl.sum().backward()
        assert kl[0].tolist() == pytest.approx(k3[0].tolist())  # the same value either way
        assert logprobs.grad[0].tolist() == pytest.approx(expected[0].tolist())
