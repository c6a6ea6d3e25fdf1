"""Preference losses: the Bradley-Terry loss of reward models (`PreferenceLoss`, "preference") and
Direct Preference Optimization (`DPOLoss`, "dpo").

Both follow the loss contract of `posttrain.algorithms.loss` (NeMo-RL's `PreferenceLossFn` and
`DPOLossFn`): rows interleave chosen and rejected responses ``[c0, r0, c1, r1, ...]``; the loss
and its metrics are means over the pairs of the whole optimizer step, ``global_valid_seqs / 2``
(`posttrain.utils.metrics.valid_counts`), so micro-batches and ranks sum to the full-batch value.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

import torch
import torch.nn.functional as F

from posttrain.algorithms.loss import (
    Count, Metrics, as_count, loss_mask, masked_mean, masked_sum, register_loss, require, shifted,
)


def _split_pairs(values: torch.Tensor, sample_mask: torch.Tensor, who: str) -> tuple[torch.Tensor, ...]:
    """Rows interleave chosen and rejected ``[c0, r0, c1, r1, ...]``: return chosen, rejected and
    the pair mask (both rows of a pair must carry the same sample_mask)."""
    if values.shape[0] % 2:
        raise ValueError(f"{who}: batch rows must interleave chosen/rejected pairs, got an odd size {values.shape[0]}")
    if not torch.equal(sample_mask[::2], sample_mask[1::2]):
        raise ValueError(f"{who}: chosen and rejected rows of a pair have different sample_mask values")
    return values[::2], values[1::2], sample_mask[::2]


def _pair_metrics(
    chosen: torch.Tensor, rejected: torch.Tensor, pair_mask: torch.Tensor, pairs: torch.Tensor
) -> Metrics:
    chosen, rejected = chosen.detach(), rejected.detach()
    return {
        # A tie (e.g. every pair at step 0 of DPO, where the policy is its reference) is a coin flip: half right.
        "accuracy": masked_mean((chosen > rejected).float() + 0.5 * (chosen == rejected).float(), pair_mask,
                                global_normalization_factor=pairs).item(),
        "rewards_chosen_mean": masked_mean(chosen, pair_mask, global_normalization_factor=pairs).item(),
        "rewards_rejected_mean": masked_mean(rejected, pair_mask, global_normalization_factor=pairs).item(),
        "reward_margin": masked_mean(chosen - rejected, pair_mask, global_normalization_factor=pairs).item(),
        "num_valid_samples": pair_mask.sum().item(),  # pairs
    }


@register_loss("preference")
class PreferenceLoss:
    """Bradley-Terry reward-model loss (Bradley & Terry 1952; Ouyang et al. 2022):
    ``-logsigmoid(s_chosen - s_rejected)`` averaged over pairs (``global_valid_seqs / 2``).

    Input is one score per sequence ``[B]`` (or ``[B, 1]``); rows interleave chosen and rejected.
    Metrics: ``loss``, ``accuracy`` (s_c > s_r), ``rewards_chosen_mean``, ``rewards_rejected_mean``,
    ``reward_margin``, ``num_valid_samples`` (pairs).
    """

    loss_type: Literal["token", "sequence"] = "sequence"
    input_type: Literal["logprobs", "scores"] = "scores"

    def __call__(
        self, logprobs: torch.Tensor, batch: Mapping[str, Any], global_valid_seqs: Count, global_valid_toks: Count
    ) -> tuple[torch.Tensor, Metrics]:
        who = "preference loss"
        require(batch, ("sample_mask",), who)
        scores = logprobs.float().reshape(-1) if logprobs.ndim == 2 and logprobs.shape[1] == 1 else logprobs.float()
        if scores.ndim != 1:
            raise ValueError(f"{who}: expected scores of shape [B] or [B, 1], got {tuple(logprobs.shape)}")
        chosen, rejected, pair_mask = _split_pairs(scores, batch["sample_mask"].float(), who)
        pairs = as_count(global_valid_seqs, scores) / 2
        loss = masked_mean(-F.logsigmoid(chosen - rejected), pair_mask, global_normalization_factor=pairs)
        return loss, {"loss": loss.item(), **_pair_metrics(chosen, rejected, pair_mask, pairs)}


@register_loss("dpo")
class DPOLoss:
    """Direct Preference Optimization (Rafailov et al. 2023).

    Implicit reward per sequence ``r = sum_t (logp - logp_ref) * mask`` (divided by the number of
    tokens when ``preference_average_log_probs``). Per pair
    ``L = preference_loss_weight * -logsigmoid(beta * (r_c - r_r)) + sft_loss_weight * NLL(chosen)``,
    averaged over pairs (``global_valid_seqs / 2``). NLL(chosen) is ``-sum_t logp`` of the chosen
    sequence (a token mean when ``preference_average_log_probs``), as in NeMo-RL. Rows interleave
    chosen and rejected; the batch needs ``reference_policy_logprobs``. Reported rewards are the
    unscaled log-ratio sums (no beta), as in NeMo-RL.

    Args:
        beta: inverse temperature of the preference (default 0.1; config key
            ``dpo.reference_policy_kl_penalty``).
        preference_average_log_probs: average instead of sum the log-ratio over tokens (default False;
            length-normalised variant, cf. SimPO, Meng et al. 2024).
        sft_loss_weight: weight of the auxiliary NLL on chosen responses (default 0.0; RPO,
            Pang et al. 2024).
        preference_loss_weight: weight of the preference term (default 1.0).
    """

    loss_type: Literal["token", "sequence"] = "sequence"
    input_type: Literal["logprobs", "scores"] = "logprobs"

    def __init__(
        self,
        beta: float = 0.1,
        preference_average_log_probs: bool = False,
        sft_loss_weight: float = 0.0,
        preference_loss_weight: float = 1.0,
    ):
        if beta <= 0:
            raise ValueError(f"dpo: beta must be > 0, got {beta}")
        self.beta = beta
        self.preference_average_log_probs = preference_average_log_probs
        self.sft_loss_weight = sft_loss_weight
        self.preference_loss_weight = preference_loss_weight

    def __call__(
        self, logprobs: torch.Tensor, batch: Mapping[str, Any], global_valid_seqs: Count, global_valid_toks: Count
    ) -> tuple[torch.Tensor, Metrics]:
        who = "dpo loss"
        require(batch, ("reference_policy_logprobs",), who)
        logprobs, _, sample_mask, mask = loss_mask(logprobs, batch, who)
        reference = shifted(batch, "reference_policy_logprobs", logprobs, who)
        num_tokens = mask.sum(-1).clamp(min=1) if self.preference_average_log_probs else 1.0
        rewards = masked_sum(logprobs - reference, mask, dim=-1) / num_tokens
        sequence_nll = -masked_sum(logprobs, mask, dim=-1) / num_tokens

        chosen, rejected, pair_mask = _split_pairs(rewards, sample_mask, who)
        pairs = as_count(global_valid_seqs, rewards) / 2
        preference_loss = masked_mean(
            -F.logsigmoid(self.beta * (chosen - rejected)), pair_mask, global_normalization_factor=pairs
        )
        sft_loss = masked_mean(sequence_nll[::2], pair_mask, global_normalization_factor=pairs)
        loss = self.preference_loss_weight * preference_loss + self.sft_loss_weight * sft_loss
        return loss, {
            "loss": loss.item(),
            "preference_loss": preference_loss.item(),
            "sft_loss": sft_loss.item(),
            **_pair_metrics(chosen, rejected, pair_mask, pairs),
        }
