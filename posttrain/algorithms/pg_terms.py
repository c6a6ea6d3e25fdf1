"""Per-token terms of the clipped policy-gradient loss (`loss.ClippedPGLoss`) beyond PPO's clip:
soft ratio gates (SAPO, VESPO), the off-policy sequence mask (DeepSeek-V3.2) and the entropy
bonus. Pure functions on ``[B, T]`` tensors already shifted to the loss's positions; ``mask`` is
the loss mask (token mask times sample mask). Formulas follow the papers as TRL implements them
(``GRPOTrainer._compute_loss``), so that both give the same values on the same inputs
(tests/unit/test_loss_trl_types.py).
"""

from __future__ import annotations

import math

import torch

# VESPO clamps the sequence's log-ratio to [log 1e-8, 20] (as TRL), so w^k and e^{-lambda w} stay finite.
_VESPO_LOG_W_MIN = math.log(1e-8)
_LOG_RATIO_MAX = 20.0


def sapo_gated_loss(ratio: torch.Tensor, advantages: torch.Tensor, temperature_pos: float,
                    temperature_neg: float) -> torch.Tensor:
    """SAPO (arXiv:2511.20347): ``-A * sigmoid(tau (r - 1)) * 4 / tau`` per token, tau =
    ``temperature_pos`` where A > 0 and ``temperature_neg`` elsewhere. At r = 1 its gradient is
    PPO's (-A dr), and it fades smoothly as r leaves 1 instead of dropping to 0 at the clip."""
    tau = torch.where(advantages > 0, temperature_pos, temperature_neg).to(ratio.dtype)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


def vespo_weights(log_ratio: torch.Tensor, log_importance_weights: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float) -> torch.Tensor:
    """VESPO's Gamma weight per sequence ``[B, 1]`` (arXiv:2602.10693), detached:
    ``phi(w) = exp(lambda + k log w - lambda w)`` (phi(1) = 1) with ``log w = sum_t mask (log r_t +
    log iw_t)``, each token's log-ratio clamped to +-20 and the sum to [log 1e-8, 20]; k, lambda are
    ``k_pos, lambda_pos`` where the sequence's advantage is >= 0, else ``k_neg, lambda_neg``.
    ``log_importance_weights`` (pi_old / pi_gen, 0 when uncorrected) enter w rather than multiply
    the loss, as in TRL."""
    with torch.no_grad():
        per_token = log_ratio.clamp(-_LOG_RATIO_MAX, _LOG_RATIO_MAX)
        per_token = per_token + log_importance_weights.clamp(_VESPO_LOG_W_MIN, _LOG_RATIO_MAX)
        log_w = (per_token * mask).sum(-1, keepdim=True).clamp(_VESPO_LOG_W_MIN, _LOG_RATIO_MAX)
        non_negative = sequence_advantage(advantages, mask) >= 0
        k = torch.where(non_negative, k_pos, k_neg).to(log_w.dtype)
        lam = torch.where(non_negative, lambda_pos, lambda_neg).to(log_w.dtype)
        phi = (lam + k * log_w - lam * log_w.exp()).exp()
        return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def sequence_advantage(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1]``: each sequence's advantage, the mean over its tokens in ``mask`` (GRPO's advantage
    is the same on every token; 0 for a sequence without tokens)."""
    return ((advantages * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))


def off_policy_sequence_mask(logprobs: torch.Tensor, generation_logprobs: torch.Tensor, advantages: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv:2512.02556, eq. 9; TRL's
    ``off_policy_mask_threshold``) ``[B, 1]``: 0 for a sequence whose advantage is negative and whose
    mean per-token KL from the generating policy, ``mean_t(logp_gen - logp)``, exceeds ``threshold``
    (the model has moved away from what generated it, and pushing it further down is unsafe); 1
    otherwise. Detached."""
    with torch.no_grad():
        kl = ((generation_logprobs - logprobs) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        keep = (sequence_advantage(advantages, mask) >= 0) | (kl <= threshold)
        return keep.to(logprobs.dtype)


def entropy_surrogate(logprobs: torch.Tensor, generation_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of the policy's entropy at each position, from the sampled tokens, whose
    gradient is the entropy's.

    Value: ``-rho log pi(y_t)`` with ``rho = pi(y_t) / pi_gen(y_t)`` (detached): E_{y~pi}[-log pi(y)]
    is the entropy of the position's next-token distribution, and rho corrects for the tokens
    coming from the generator (the loss's ``approx_entropy`` metric, NeMo-RL's). Gradient:
    ``-rho log pi(y_t) d log pi(y_t)``, the score-function form of dH = -E[log pi d log pi]. It
    needs only the sampled tokens' logprobs (no vocabulary-sized logits), so it works with the fused
    logprob path, context and pipeline parallelism; TRL computes the exact entropy from the logits.
    """
    rho = torch.nan_to_num((logprobs - generation_logprobs).detach().exp(), nan=0.0, posinf=0.0)
    estimate = -rho * logprobs.detach()
    # Value `estimate`, gradient `estimate * d logp`: (logp - sg(logp)) is 0 with gradient d logp.
    return estimate + estimate * (logprobs - logprobs.detach())
