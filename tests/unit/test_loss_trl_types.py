"""TRL's GRPO loss types as `loss_fn.preset`s: loss and gradient against TRL's formulas on shared
inputs. `trl_loss` below is TRL's `GRPOTrainer._compute_loss` (trl 1.10.0.dev0, f2cd577) written out
from its formulas: the per-token loss of each `loss_type` and its aggregation."""

import math

import pytest
import torch

from posttrain.algorithms.loss import ClippedPGLoss
from posttrain.config.schema import LossConfig
from posttrain.utils.metrics import valid_counts

# Three completions of 4, 3 and 2 tokens (0-padded), their advantages, and the current, previous
# (pi_old) and generating policies' logprobs. Ratios exp(logp - old) go from 0.55 to 1.65, so
# PPO's clip binds on some tokens.
LOGP = [[-1.0, -0.5, -2.0, -0.3], [-0.7, -1.2, -0.4, 0.0], [-2.2, -0.9, 0.0, 0.0]]
OLD = [[-1.3, -0.4, -1.5, -0.6], [-0.9, -0.7, -0.5, 0.0], [-1.9, -1.2, 0.0, 0.0]]
GEN = [[-1.2, -0.4, -1.6, -0.5], [-0.2, -0.1, -0.1, 0.0], [-1.8, -1.1, 0.0, 0.0]]
MASK = [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
ADV = [1.5, -0.5, -2.0]


def trl_loss(loss_type, logp, level="token", eps_low=0.2, eps_high=0.2, sapo_pos=1.0, sapo_neg=1.05,
             vespo=(2.0, 3.0, 3.0, 2.0), off_policy_threshold=None):
    """TRL's loss for `loss_type` on the shared inputs (one process, no accumulation, no KL)."""
    old, mask, gen = torch.tensor(OLD), torch.tensor(MASK), torch.tensor(GEN)
    advantages = torch.tensor(ADV).unsqueeze(1)
    log_ratio = logp - old
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if loss_type in ("grpo", "bnpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, sapo_pos, sapo_neg)
        per_token_loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
    elif loss_type == "vespo":
        k_pos, lambda_pos, k_neg, lambda_neg = vespo
        with torch.no_grad():
            seq_log_ratio = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
            log_w = torch.clamp(seq_log_ratio, math.log(1e-8), 20.0)
            k = torch.where(advantages >= 0, k_pos, k_neg)
            lam = torch.where(advantages >= 0, lambda_pos, lambda_neg)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        per_token_loss = -phi * advantages * logp
    if off_policy_threshold is not None:  # DeepSeek-V3.2's off-policy sequence mask
        kl = ((gen - logp.detach()) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
        per_token_loss = per_token_loss * ((advantages >= 0) | (kl <= off_policy_threshold)).float()
    if loss_type in ("grpo", "sapo"):
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo", "vespo"):  # dapo/vespo: num_items_in_batch, here the batch's tokens
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "luspo":
        return (per_token_loss * mask.sum(1, keepdim=True)).mean()
    raise ValueError(loss_type)


def ours(cfg: LossConfig):
    """Our loss and d loss / d logp [B, 4] on the shared inputs (position 0 is the prompt)."""
    pad = lambda rows: torch.tensor([[0.0] + row for row in rows])  # noqa: E731
    logprobs = pad(LOGP).requires_grad_()
    batch = {"token_mask": pad(MASK), "sample_mask": torch.ones(3), "prev_logprobs": pad(OLD),
             "generation_logprobs": pad(GEN), "advantages": pad([[a * m for m in row] for a, row in zip(ADV, MASK)])}
    loss, metrics = ClippedPGLoss(cfg)(logprobs, batch, *valid_counts(batch))
    loss.backward()
    return loss, logprobs.grad[:, 1:] * torch.tensor(MASK), metrics


def trl(loss_type, **kw):
    logp = torch.tensor(LOGP, requires_grad=True)
    loss = trl_loss(loss_type, logp, **kw)
    loss.backward()
    return loss, logp.grad * torch.tensor(MASK)


@pytest.mark.parametrize("preset, trl_options", [
    ("grpo", {}),
    ("bnpo", {}),
    ("dapo", {}),
    ("sapo", {}),
    ("luspo", {"level": "sequence"}),
    ("vespo", {}),
])
def test_preset_matches_trl_loss_type(preset, trl_options):
    loss, grad, _ = ours(LossConfig(preset=preset))
    expected_loss, expected_grad = trl(preset, **trl_options)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6, abs=1e-7)
    assert grad.flatten().tolist() == pytest.approx(expected_grad.flatten().tolist(), rel=1e-5, abs=1e-7)


def test_the_trl_reference_tells_the_loss_types_apart():
    # The shared inputs separate every pair (else the comparisons above would prove less).
    values = {t: trl(t, **({"level": "sequence"} if t == "luspo" else {}))[0].item()
              for t in ("grpo", "bnpo", "sapo", "luspo", "vespo")}
    assert len({round(v, 6) for v in values.values()}) == len(values)


def test_sapo_temperatures_and_vespo_parameters_are_used():
    loss, _, _ = ours(LossConfig(preset="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=3.0))
    assert loss.item() == pytest.approx(trl("sapo", sapo_pos=2.0, sapo_neg=3.0)[0].item(), rel=1e-6)
    loss, _, _ = ours(LossConfig(preset="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
                                 vespo_lambda_neg=1.5))
    assert loss.item() == pytest.approx(trl("vespo", vespo=(1.0, 0.5, 4.0, 1.5))[0].item(), rel=1e-6)


def test_off_policy_mask_matches_trl():
    """Row 1 (A < 0) has mean KL(gen - logp) = (0.5 + 1.1 + 0.3) / 3 = 0.633 > 0.5: masked. Row 2
    (A < 0, KL 0.1) and row 0 (A > 0) are kept."""
    loss, grad, metrics = ours(LossConfig(preset="dapo", ratio_clip_max=0.28, off_policy_mask_threshold=0.5))
    expected_loss, expected_grad = trl("dapo", eps_high=0.28, off_policy_threshold=0.5)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    assert grad.flatten().tolist() == pytest.approx(expected_grad.flatten().tolist(), rel=1e-5, abs=1e-7)
    assert metrics["off_policy_masked_fraction"] == pytest.approx(1 / 3)
    assert grad[1].abs().sum().item() == 0.0 and grad[2].abs().sum().item() > 0


def test_preset_sets_its_variant_over_the_section_and_bad_values_fail_in_one_line():
    # The embedded default sets token_level_loss=true; preset 'grpo' still means the per-sequence mean.
    assert LossConfig(preset="grpo", token_level_loss=True).token_level_loss is False
    assert LossConfig(preset="dapo", ratio_clip_max=0.28).ratio_clip_max == 0.28  # hyperparameters stay
    with pytest.raises(ValueError, match=r"loss_fn.preset='sapoo' is not one of .*did you mean 'sapo'"):
        LossConfig(preset="sapoo")
    with pytest.raises(ValueError, match="loss_fn.ratio_gate='vespo' cannot be combined with "
                                         "loss_fn.sequence_level_importance_ratios"):
        LossConfig(ratio_gate="vespo", sequence_level_importance_ratios=True, token_level_loss=False)
    with pytest.raises(ValueError, match="loss_fn.ratio_gate='sapo' cannot be combined with loss_fn.use_cispo"):
        LossConfig(ratio_gate="sapo", use_cispo=True)
    with pytest.raises(ValueError, match="sequence_token_reduction='sum' .* needs loss_fn.token_level_loss=false"):
        LossConfig(sequence_token_reduction="sum")
