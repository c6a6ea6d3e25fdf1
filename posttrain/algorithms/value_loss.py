"""PPO's critic loss and how well the critic explains the returns (`posttrain ppo`).

The critic (a value model: the policy's architecture with a one-output head on every token,
`model_type="value"`) gives values aligned like logprobs: position i holds V of the prefix before
token i, position 0 is 0. Its targets are GAE returns (`advantages.gae_advantages` with
`critic.lambda_critic`, plus the values they were computed from).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Optional

import torch

from posttrain.algorithms.loss import Count, Metrics, loss_mask, masked_mean, register_loss, require, shifted


@register_loss("value")
class ValueLoss:
    """Clipped squared error of the values against their returns (PPO, Schulman et al. 2017; the
    clipped form of OpenAI baselines, verl and NeMo-RL's `MseValueLossFn`):

        L = 0.5 * sum_t max((V_t - R_t)^2, (V_old_t + clamp(V_t - V_old_t, -c, c) - R_t)^2) / global_valid_toks

    where V_old are the values the returns were computed from (the batch's ``prev_values``) and c
    is ``value_clip`` (``critic.value_clip``; None: the plain squared error, ``prev_values`` not
    needed). The clip keeps one update from moving a value far from the one the advantages used.

    Batch keys: ``returns [B, S]``, ``prev_values [B, S]`` (with a clip), ``token_mask``, ``sample_mask``.
    Metrics: ``loss``, ``value_clip_fraction`` (share of tokens where the clipped branch is the
    larger, so it binds and gives no gradient; 0 without a clip), ``values_mean`` (the values
    being trained, token mean), ``num_valid_samples``.
    """

    loss_type: Literal["token", "sequence"] = "token"
    input_type: Literal["values"] = "values"

    def __init__(self, value_clip: Optional[float] = 0.2):
        if value_clip is not None and value_clip <= 0:
            raise ValueError(f"value loss: value_clip={value_clip} must be > 0 (or None for no clip)")
        self.value_clip = value_clip

    def __call__(
        self, values: torch.Tensor, batch: Mapping[str, Any], global_valid_seqs: Count, global_valid_toks: Count
    ) -> tuple[torch.Tensor, Metrics]:
        who = "value loss"
        require(batch, ("returns",) + (("prev_values",) if self.value_clip is not None else ()), who)
        values, _, sample_mask, mask = loss_mask(values, batch, who)
        returns = shifted(batch, "returns", values, who)
        error = (values - returns).square()
        clipped_fraction = torch.zeros((), device=values.device)
        if self.value_clip is not None:
            old = shifted(batch, "prev_values", values, who)
            clipped_values = old + (values - old).clamp(-self.value_clip, self.value_clip)
            clipped_error = (clipped_values - returns).square()
            with torch.no_grad():
                clipped_fraction = masked_mean((clipped_error > error).float(), mask,
                                               global_normalization_factor=global_valid_toks)
            error = torch.maximum(error, clipped_error)
        loss = 0.5 * masked_mean(error, mask, global_normalization_factor=global_valid_toks)
        with torch.no_grad():
            values_mean = masked_mean(values, mask, global_normalization_factor=global_valid_toks)
        return loss, {
            "loss": loss.item(),
            "value_clip_fraction": clipped_fraction.item(),
            "values_mean": values_mean.item(),
            "num_valid_samples": sample_mask.sum().item(),
        }


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the positions in ``mask``: 1 when the values predict the
    returns exactly, 0 when they do no better than the returns' mean, below 0 when worse. Returns
    that do not vary at all have nothing to explain: 0.0 then."""
    valid = mask > 0
    r, v = returns[valid].double(), values[valid].double()
    if r.numel() < 2:
        return 0.0
    variance = r.var(unbiased=False)
    if variance <= 0:
        return 0.0
    return float(1.0 - (r - v).var(unbiased=False) / variance)
