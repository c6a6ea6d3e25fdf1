"""Losses: what every loss shares (the call contract, the registry and the one builder, masked
means), supervised NLL and the clipped policy-gradient loss. The other families live beside it:
`preference_loss.py` (DPO, Bradley-Terry) and `distill_loss.py` (top-k KL of distillation).

Contract (docs/internals.md): every loss is called as

    loss, metrics = loss_fn(logprobs, batch, global_valid_seqs, global_valid_toks)

- ``logprobs`` is ``[B, S]`` aligned to ``input_ids`` (position *i* holds log p(token_i | tokens_<i),
  position 0 is 0). A loss with ``input_type == "scores"`` gets one scalar per sequence ``[B]``
  instead (reward models).
- Every loss looks at positions ``1:`` and uses ``mask = token_mask[:, 1:] * sample_mask[:, None]``.
  In training, logprobs outside that mask may be 0 rather than computed (the policy's fused path,
  ``policy.fused_logprobs``), so a loss must keep them out of anything that could overflow there.
- Losses and metrics are divided by the *global* valid counts of the whole optimizer step (all
  micro-batches, all data-parallel ranks), so per-micro-batch values **sum** to the full-batch
  value. Metric names ending in ``_min`` / ``_max`` are reduced by min / max instead. Both rules,
  the counts' formula and the reduction, are defined once in `posttrain.utils.metrics`.

Formulas follow NeMo-RL's losses (its ``ClippedPGLossFn``, ``NLLLossFn``, ``PreferenceLossFn`` and
``DPOLossFn``); the options are in docs/algorithms.md.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Literal, Mapping, Optional, Protocol, Union

import torch

from posttrain.algorithms import pg_terms
from posttrain.config.schema import LossConfig, loss_option_problem
from posttrain.utils.registry import registrar, resolve

Count = Union[torch.Tensor, float, int]
Metrics = dict[str, float]
_EPS = 1e-8


class LossFunction(Protocol):
    """What the policy worker needs from a loss object."""

    loss_type: Literal["token", "sequence"]
    input_type: Literal["logprobs", "scores", "logits", "values"]  # "logits": [B, S, V] (distillation); "values": [B, S] (a critic)

    def __call__(
        self, logprobs: torch.Tensor, batch: Mapping[str, Any], global_valid_seqs: Count, global_valid_toks: Count
    ) -> tuple[torch.Tensor, Metrics]: ...


# -------------------------------------------------------------------------------------- registry
LOSS_REGISTRY: dict[str, Callable[..., LossFunction]] = {}

# Class decorator: ``@register_loss("clipped_pg")`` makes the class reachable via `build_loss`.
register_loss = registrar(LOSS_REGISTRY, "loss")

# Built-in losses defined beside this file, registered when their module is imported (on first
# lookup: they import this file, so this file cannot import them).
_BUILTIN_LOSS_MODULES = {
    "preference": "posttrain.algorithms.preference_loss",
    "dpo": "posttrain.algorithms.preference_loss",
    "distillation": "posttrain.algorithms.distill_loss",
    "value": "posttrain.algorithms.value_loss",
}


def build_loss(spec: Union[LossConfig, str], **options: Any) -> LossFunction:
    """The one loss builder, for jobs and tests alike.

    - A `LossConfig` (GRPO's `loss_fn` section): `ClippedPGLoss(cfg)` for "clipped_pg", otherwise
      the loss `loss_fn.name` names built with `loss_fn.kwargs`.
    - A name: the loss registered under it (``@register_loss``; "nll", "clipped_pg", "preference",
      "dpo", "distillation", "value") or the class at an import path ('module:Class', 'file.py:Class'),
      built with ``options``: ``build_loss("dpo", beta=0.1)``, ``build_loss("clipped_pg",
      ratio_clip_max=0.28)``.

    An unknown name raises KeyError listing the registered losses and the closest one.
    """
    if isinstance(spec, LossConfig):
        if spec.name == "clipped_pg":
            return ClippedPGLoss(spec, **options)
        spec, options = spec.name, {**spec.kwargs, **options}
    if spec in _BUILTIN_LOSS_MODULES:
        importlib.import_module(_BUILTIN_LOSS_MODULES[spec])
    elif ":" not in spec:  # a mistake: the error lists every built-in too
        for module in sorted(set(_BUILTIN_LOSS_MODULES.values())):
            importlib.import_module(module)
    return resolve(LOSS_REGISTRY, spec, "loss")(**options)


# --------------------------------------------------------------------------------------- helpers
def as_count(count: Count, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(count, dtype=like.dtype, device=like.device)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """``sum(values * mask)`` over everything, or along ``dim``."""
    product = values * mask
    return product.sum() if dim is None else product.sum(dim)


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: Optional[int] = None,
    global_normalization_factor: Optional[Count] = None,
) -> torch.Tensor:
    """``sum(values * mask) / denominator``.

    The denominator is ``global_normalization_factor`` when given (so that means over micro-batches
    add up to the global mean), else ``sum(mask)`` (over ``dim``). An empty mask gives 0, not NaN.
    """
    numerator = masked_sum(values, mask, dim)
    if global_normalization_factor is not None:
        denominator = as_count(global_normalization_factor, numerator)
    else:
        denominator = mask.sum() if dim is None else mask.sum(dim)
    return numerator / denominator.clamp(min=_EPS)


def require(batch: Mapping[str, Any], keys: tuple[str, ...], who: str) -> None:
    """A KeyError naming the loss (`who`) when `batch` lacks any of `keys`."""
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"{who}: batch is missing key(s) {missing}; it has {sorted(batch.keys())}")


def shifted(batch: Mapping[str, Any], key: str, like: torch.Tensor, who: str) -> torch.Tensor:
    """``batch[key][:, 1:]`` as float, checked against the shape of ``like`` (already shifted)."""
    value = batch[key]
    if value.ndim != 2 or value[:, 1:].shape != like.shape:
        raise ValueError(
            f"{who}: batch[{key!r}] has shape {tuple(value.shape)}, expected [B, S] = "
            f"{(like.shape[0], like.shape[1] + 1)} like the logprobs"
        )
    return value[:, 1:].float()


def loss_mask(logprobs: torch.Tensor, batch: Mapping[str, Any], who: str) -> tuple[torch.Tensor, ...]:
    """Shifted ``(logprobs, token_mask, sample_mask, mask)`` with shapes checked: the positions
    ``1:`` every loss looks at, and ``mask = token_mask[:, 1:] * sample_mask[:, None]``, the mask
    whose sum over the optimizer step is `posttrain.utils.metrics.valid_counts`'s token count."""
    require(batch, ("token_mask", "sample_mask"), who)
    if logprobs.ndim != 2:
        raise ValueError(f"{who}: logprobs must be [B, S], got shape {tuple(logprobs.shape)}")
    logprobs = logprobs[:, 1:].float()
    token_mask = shifted(batch, "token_mask", logprobs, who)
    sample_mask = batch["sample_mask"].float()
    if sample_mask.shape != (logprobs.shape[0],):
        raise ValueError(f"{who}: sample_mask has shape {tuple(sample_mask.shape)}, expected [{logprobs.shape[0]}]")
    return logprobs, token_mask, sample_mask, token_mask * sample_mask[:, None]


def per_token_kl(
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    kl_type: Literal["k1", "k2", "k3"] = "k3",
    input_clamp_value: Optional[float] = None,
    output_clamp_value: Optional[float] = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
    divergence", 2020). With ``log_r = reference_logprobs - logprobs`` (clamped to
    ``+-input_clamp_value``): k1 = -log_r, k2 = log_r^2 / 2, k3 = exp(log_r) - 1 - log_r (unbiased,
    non-negative). The result is clamped to ``+-output_clamp_value``."""
    log_ratio = reference_logprobs - logprobs
    if input_clamp_value is not None:
        log_ratio = log_ratio.clamp(-input_clamp_value, input_clamp_value)
    if kl_type == "k1":
        kl = -log_ratio
    elif kl_type == "k2":
        kl = log_ratio.square() / 2
    elif kl_type == "k3":
        kl = log_ratio.exp() - 1 - log_ratio
    else:
        raise ValueError(f"unknown KL estimator {kl_type!r}; use 'k1', 'k2' or 'k3'")
    if output_clamp_value is not None:
        kl = kl.clamp(-output_clamp_value, output_clamp_value)
    return kl


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def _masked_min_max(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Min and max over positions where ``mask > 0``; (inf, -inf) when there are none, which
    leaves a min/max reduction over micro-batches unaffected."""
    selected = values.detach()[mask > 0]
    if selected.numel() == 0:
        return float("inf"), float("-inf")
    return selected.min().item(), selected.max().item()


# ------------------------------------------------------------------------------------------ SFT
@register_loss("nll")
class NLLLoss:
    """Negative log-likelihood for supervised fine-tuning: ``-sum(logp * mask) / global_valid_toks``.

    Metrics: ``loss``, ``num_valid_tokens``, ``num_valid_samples`` (local counts; they sum).
    """

    loss_type: Literal["token", "sequence"] = "token"
    input_type: Literal["logprobs", "scores"] = "logprobs"

    def __call__(
        self, logprobs: torch.Tensor, batch: Mapping[str, Any], global_valid_seqs: Count, global_valid_toks: Count
    ) -> tuple[torch.Tensor, Metrics]:
        logprobs, _, sample_mask, mask = loss_mask(logprobs, batch, "nll loss")
        loss = -masked_mean(logprobs, mask, global_normalization_factor=global_valid_toks)
        return loss, {
            "loss": loss.item(),
            "num_valid_tokens": mask.sum().item(),
            "num_valid_samples": sample_mask.sum().item(),
        }


# ------------------------------------------------------------------------------ policy gradient
@register_loss("clipped_pg")
class ClippedPGLoss:
    """Clipped policy-gradient loss with KL regularisation; one class covers

    - PPO (Schulman et al. 2017) and GRPO (Shao et al. 2024): ``ratio_clip_min = ratio_clip_max``.
    - DAPO clip-higher (Yu et al. 2025): ``ratio_clip_max > ratio_clip_min``, ``token_level_loss=True``.
    - GSPO (Zheng et al. 2025): ``sequence_level_importance_ratios=True`` (needs
      ``token_level_loss=False``): the ratio is exp(mean_t(logp - prev)) per sequence.
    - Dr.GRPO (Liu et al. 2025): token-level loss here plus no std normalisation in the advantages.
    - REINFORCE / RLOO: ``disable_ppo_ratio=True`` (the loss is -A * logp, no clipping).
    - Truly on-policy: ``force_on_policy_ratio=True`` (ratio = exp(logp - sg(logp)) = 1 with a live
      gradient; ``prev_logprobs`` may then be absent).
    - One optimizer step per batch: ``prev_logprobs`` may be left out; the previous policy is then
      the current one, ``prev = sg(logp)``, which is exact because no update happens between
      generation's refit and this forward (TRL does the same). GRPO skips its recompute pass this
      way; `check_train_batch` refuses a batch without them that spans several optimizer steps.
    - Dual clip (Ye et al. 2020): ``ratio_clip_c = c > 1`` bounds the loss by -A*c where A < 0.
    - CISPO (MiniMax-M1, MiniMax 2025, arXiv:2506.13585): ``use_cispo=True``: ``L = -sg(r_hat) A logp``, the clipped
      ratio as a detached weight, so every token keeps a gradient (token-level loss only).
    - SAPO (arXiv:2511.20347): ``ratio_gate="sapo"``, a soft gate instead of the clip; VESPO
      (arXiv:2602.10693): ``ratio_gate="vespo"``, a detached Gamma weight of the sequence's ratio on
      -A logp; LUSPO (arXiv:2602.05261): GSPO with ``sequence_token_reduction="sum"``
      (`pg_terms`; TRL's loss types are ``loss_fn.preset`` names, docs/algorithms.md).
    - DeepSeek-V3.2's off-policy sequence mask: ``off_policy_mask_threshold``.
    - An entropy bonus ``- entropy_coef * H`` (H: the token mean of `pg_terms.entropy_surrogate`);
      ``self.entropy_coef`` is the coefficient, which `adaptive_entropy` sets each step when adaptive.

    Per token, with r the ratio and r_hat = clamp(r, 1 - ratio_clip_min, 1 + ratio_clip_max):
    ``L = max(-A r, -A r_hat)``. The train/inference mismatch is corrected with importance weights
    ``w = exp(prev - gen)`` (detached; per sequence exp(sum_t(prev - gen)) under GSPO) when
    ``use_importance_sampling_correction``, optionally truncated (``truncated_importance_sampling_type``:
    "tis" clamps w to [ratio_min or 0, ratio]; "icepop" zeroes tokens with w outside [min, max];
    "seq-mask-tis" zeroes sequences whose geometric-mean w is outside [min, max]).
    Aggregation: token-level ``sum(w L mask) / global_valid_toks`` or sequence-level
    ``sum_seq(mean_t(w L)) / global_valid_seqs``. KL to the reference policy
    (``reference_policy_kl_penalty`` beta, estimator ``reference_policy_kl_type``) is reduced the same
    way and added: ``loss = actor_loss + beta * KL``.

    Batch keys: ``advantages [B,S]``, ``prev_logprobs``, ``generation_logprobs``, ``token_mask``,
    ``sample_mask``, and ``reference_policy_logprobs`` when beta > 0.

    Metrics: ``loss``, ``actor_loss``, ``kl_penalty`` (the KL before beta), ``probs_ratio`` and
    ``probs_ratio_clamped`` (token means) with ``_min``/``_max``, ``clip_fraction``,
    ``token_mult_prob_error``, ``gen_kl_error`` (KL(P_gen || P_train) with the configured estimator),
    ``sampling_importance_ratio`` (mean of the weights the loss uses, after truncation; the weights
    it would use when correction is off) and ``sampling_importance_ratio_untruncated``,
    ``approx_entropy``, ``num_valid_samples``, and ``is_oob_ratio`` (fraction of weights the
    truncation changed or dropped) under tis / icepop / seq-mask-tis. The KL penalty's gradient
    form is ``reference_policy_kl_gradient`` (see `_kl_penalty`).

    Args:
        cfg: a `LossConfig` (defaults: clip 0.2/0.2, beta 0, k3, token-level). Keyword arguments
            instead build one, so ``build_loss("clipped_pg", **cfg.model_dump())`` works.
    """

    input_type: Literal["logprobs", "scores"] = "logprobs"

    def __init__(self, cfg: Optional[LossConfig] = None, **overrides: Any):
        if cfg is None:
            cfg = LossConfig(**overrides)
        elif overrides:
            cfg = cfg.model_copy(update=overrides)
        self.cfg = cfg
        self.loss_type: Literal["token", "sequence"] = "token" if cfg.token_level_loss else "sequence"
        # The entropy bonus's coefficient; under `loss_fn.adaptive_entropy` the controller
        # (`posttrain.algorithms.adaptive_entropy`) sets it before each training step.
        self.entropy_coef = cfg.entropy_coef
        problem = loss_option_problem(cfg)  # the config check, for losses built in code
        if problem:
            raise ValueError(problem)

    # The two reductions of a per-token quantity; both sum correctly over micro-batches.
    def _reduce(
        self, values: torch.Tensor, mask: torch.Tensor, sample_mask: torch.Tensor, seqs: Count, toks: Count
    ) -> torch.Tensor:
        if self.loss_type == "token":
            return masked_mean(values, mask, global_normalization_factor=toks)
        if self.cfg.sequence_token_reduction == "sum":  # LUSPO: each sequence weighs by its length
            per_sequence = masked_sum(values, mask, dim=-1)
        else:
            per_sequence = masked_mean(values, mask, dim=-1)
        return masked_mean(per_sequence, sample_mask, global_normalization_factor=seqs)

    def _importance_weights(
        self, prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, sample_mask: torch.Tensor, seqs: Count, toks: Count
    ) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """Raw and truncated importance weights pi_prev / pi_gen (detached, broadcastable to [B,S-1])."""
        cfg = self.cfg
        log_w = (prev - gen).detach()
        if cfg.sequence_level_importance_ratios:
            raw = _finite_or_zero(masked_sum(log_w, mask, dim=-1).exp())[:, None]
        else:
            raw = _finite_or_zero(log_w.exp())
        upper = cfg.truncated_importance_sampling_ratio
        lower = cfg.truncated_importance_sampling_ratio_min or 0.0
        metrics: Metrics = {}
        truncation = cfg.truncated_importance_sampling_type
        if truncation == "tis":
            weights = raw.clamp(min=lower, max=upper)
            # Tokens (or, under GSPO, sequences) whose weight the clamp changed.
            out_of_bounds = ((raw < lower) | (raw > upper)).float().expand_as(mask)
            metrics["is_oob_ratio"] = masked_mean(out_of_bounds, mask, global_normalization_factor=toks).item()
        elif truncation == "icepop":
            kept = ((raw >= lower) & (raw <= upper)).float()
            weights = raw * kept
            out_of_bounds = (1 - kept).expand_as(mask)
            metrics["is_oob_ratio"] = masked_mean(out_of_bounds, mask, global_normalization_factor=toks).item()
        elif truncation == "seq-mask-tis":
            geometric_mean = masked_mean(_finite_or_zero(log_w), mask, dim=-1).exp()
            kept = ((geometric_mean >= lower) & (geometric_mean <= upper)).float()
            weights = raw * kept[:, None]
            metrics["is_oob_ratio"] = masked_mean(1 - kept, sample_mask, global_normalization_factor=seqs).item()
        else:
            weights = raw
        return raw, weights, metrics

    def __call__(
        self, logprobs: torch.Tensor, batch: Mapping[str, Any], global_valid_seqs: Count, global_valid_toks: Count
    ) -> tuple[torch.Tensor, Metrics]:
        cfg, who = self.cfg, "clipped_pg loss"
        required = ["advantages", "generation_logprobs"]
        if cfg.reference_policy_kl_penalty > 0:
            required.append("reference_policy_logprobs")
        require(batch, tuple(required), who)
        logprobs, _, sample_mask, mask = loss_mask(logprobs, batch, who)
        seqs, toks = global_valid_seqs, global_valid_toks
        advantages = shifted(batch, "advantages", logprobs, who)
        gen = shifted(batch, "generation_logprobs", logprobs, who)
        if "prev_logprobs" in batch and not cfg.force_on_policy_ratio:
            prev = shifted(batch, "prev_logprobs", logprobs, who)
        else:
            # One optimizer step per batch (see check_train_batch), or the ratio forced to 1: the
            # current policy is the previous one, also for the importance weights pi_prev / pi_gen
            # (NeMo-RL replaces prev_logprobs by the current ones under force_on_policy_ratio).
            prev = logprobs.detach()

        # Ratio r and its clamped version r_hat.
        if cfg.force_on_policy_ratio:
            ratio = (logprobs - logprobs.detach()).exp()
            ratio_clamped = ratio
        elif cfg.disable_ppo_ratio:
            ratio = logprobs  # REINFORCE: -A * logp
            ratio_clamped = logprobs
        else:
            # Outside the mask the training logprobs may be 0 (not computed: docs/internals.md)
            # while prev holds real values; exp() of their difference could overflow to inf there.
            log_ratio = torch.where(mask != 0, logprobs - prev, 0.0)
            if cfg.sequence_level_importance_ratios:  # GSPO: geometric mean over the sequence
                log_ratio = masked_mean(log_ratio, mask, dim=-1)[:, None].expand_as(logprobs)
            ratio = log_ratio.exp()
            ratio_clamped = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)

        raw_weights, weights, is_metrics = self._importance_weights(prev, gen, mask, sample_mask, seqs, toks)
        weights_reported = weights  # without correction, the weights that would be used
        if not cfg.use_importance_sampling_correction:
            weights = torch.ones_like(weights)

        if cfg.use_cispo:
            # CISPO: the clipped ratio is a constant weight on -A * logp, so a token whose ratio left
            # the range still pulls (with the bound as its weight) instead of dropping out.
            pg_loss = -advantages * ratio_clamped.detach() * logprobs
            clipped = (ratio != ratio_clamped).float()
        elif cfg.ratio_gate == "sapo":
            pg_loss = pg_terms.sapo_gated_loss(ratio, advantages, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
            clipped = (ratio != ratio_clamped).float()  # where PPO's clip would bind (the gate only fades)
        elif cfg.ratio_gate == "vespo":
            # The importance weights enter VESPO's sequence weight (in log space), not the loss.
            phi = pg_terms.vespo_weights(
                torch.where(mask != 0, logprobs - prev, 0.0), torch.log(weights.clamp(min=1e-30)), advantages, mask,
                cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg,
            )
            pg_loss = -phi * advantages * logprobs
            weights = torch.ones_like(weights)
            clipped = (ratio != ratio_clamped).float()
        else:
            loss_unclipped = -advantages * ratio
            loss_clipped = -advantages * ratio_clamped
            pg_loss = torch.maximum(loss_unclipped, loss_clipped)  # pessimistic bound
            if cfg.ratio_clip_c is not None:
                pg_loss = torch.where(advantages < 0, torch.minimum(pg_loss, -advantages * cfg.ratio_clip_c), pg_loss)
            # The clipped branch binds (no gradient flows through the token).
            clipped = (loss_clipped > loss_unclipped).float()

        if cfg.off_policy_mask_threshold is not None:
            kept = pg_terms.off_policy_sequence_mask(logprobs, gen, advantages, mask, cfg.off_policy_mask_threshold)
            pg_loss = pg_loss * kept
            is_metrics["off_policy_masked_fraction"] = masked_mean(
                1 - kept[:, 0], sample_mask, global_normalization_factor=seqs).item()
        actor_loss = self._reduce(weights * pg_loss, mask, sample_mask, seqs, toks)

        if cfg.reference_policy_kl_penalty > 0:
            reference = shifted(batch, "reference_policy_logprobs", logprobs, who)
            kl_term = self._reduce(self._kl_penalty(logprobs, reference, gen, mask), mask, sample_mask, seqs, toks)
        else:
            kl_term = torch.zeros((), device=logprobs.device)
        loss = actor_loss + cfg.reference_policy_kl_penalty * kl_term
        if self.entropy_coef > 0:
            # The mean per-token entropy over the step's tokens, whatever the actor loss's aggregation
            # (TRL's convention), so the coefficient means the same for every preset.
            entropy = masked_mean(pg_terms.entropy_surrogate(logprobs, gen), mask, global_normalization_factor=toks)
            loss = loss - self.entropy_coef * entropy

        with torch.no_grad():
            metrics = self._metrics(
                logprobs, prev, gen, ratio, ratio_clamped, clipped, raw_weights,
                weights_reported, mask, sample_mask, seqs, toks,
            )
        metrics.update(loss=loss.item(), actor_loss=actor_loss.item(), kl_penalty=kl_term.item(), **is_metrics)
        return loss, metrics

    def _kl_penalty(
        self, logprobs: torch.Tensor, reference: torch.Tensor, gen: torch.Tensor, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Per-token KL penalty, differentiated as `loss_fn.reference_policy_kl_gradient` says.

        The estimators are estimates of KL(pi || ref) from samples of pi. Differentiating the
        estimate alone ("estimator", DeepSeek-GRPO and TRL's default) drops the score-function
        term d/dtheta of the sampling distribution: for k3 the result is the gradient of
        KL(ref || pi). "score_function" (NeMo-RL, TRL's `use_bias_correction_kl`) weights the
        estimate by exp(logp - sg(logp)), which is 1 in value and adds `kl * dlogp`, giving the
        gradient of KL(pi || ref); the output clamp then applies after weighting, as in NeMo-RL.
        With `use_on_policy_kl_approximation` the weight also carries pi / pi_gen (the tokens
        came from the generator, not from pi). Under GSPO (`sequence_level_importance_ratios`) the
        weight is the sequence's (the geometric mean over its tokens in `mask`), as TRL weights the
        KL by the sequence ratio with `use_bias_correction_kl`: the same value (1), and each token's
        KL then pulls on every token of its sequence, 1/|y| each.
        """
        cfg = self.cfg
        if cfg.use_on_policy_kl_approximation:
            # Value pi / pi_gen; its gradient (score-function form only) is that of logp.
            log_weight = logprobs - gen
        else:
            log_weight = logprobs - logprobs.detach()
        if cfg.reference_policy_kl_gradient == "estimator":
            kl = per_token_kl(
                logprobs, reference, cfg.reference_policy_kl_type, cfg.kl_input_clamp_value, cfg.kl_output_clamp_value
            )
            return kl * _finite_or_zero(log_weight.detach().exp())
        if cfg.kl_input_clamp_value is not None:
            # Where the input clamp binds the estimate is a constant, and NeMo-RL detaches the
            # weight there too: no gradient at all from those tokens (its case: k3, clamp 2, logp
            # [-3, -1], reference 0 gives the gradient [0, -1], not [4.389, -1]).
            bound = (reference - logprobs).abs() > cfg.kl_input_clamp_value
            log_weight = torch.where(bound, log_weight.detach(), log_weight)
        if cfg.sequence_level_importance_ratios and mask is not None:
            log_weight = masked_mean(log_weight, mask, dim=-1)[..., None].expand_as(logprobs)
        kl = per_token_kl(logprobs, reference, cfg.reference_policy_kl_type, cfg.kl_input_clamp_value)
        kl = kl * _finite_or_zero(log_weight.exp())
        if cfg.kl_output_clamp_value is not None:
            kl = kl.clamp(-cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
        return kl

    def check_train_batch(self, batch: Mapping[str, Any], num_optimizer_steps: int) -> None:
        """Called by `Policy.train` before training: `prev_logprobs` may be absent only when the
        batch is one optimizer step (or the ratio is forced to 1)."""
        if num_optimizer_steps > 1 and "prev_logprobs" not in batch and not self.cfg.force_on_policy_ratio:
            raise ValueError(
                f"clipped_pg loss: the batch spans {num_optimizer_steps} optimizer steps but has no "
                "'prev_logprobs'; after the first step the current policy is no longer the one that "
                "generated the batch, so compute them with Policy.get_logprobs first"
            )

    def _metrics(
        self,
        logprobs: torch.Tensor,
        prev: torch.Tensor,
        gen: torch.Tensor,
        ratio: torch.Tensor,
        ratio_clamped: torch.Tensor,
        clipped: torch.Tensor,
        raw_weights: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        sample_mask: torch.Tensor,
        seqs: Count,
        toks: Count,
    ) -> Metrics:
        def token_mean(values: torch.Tensor) -> float:
            return masked_mean(values, mask, global_normalization_factor=toks).item()

        ratio_min, ratio_max = _masked_min_max(ratio, mask)
        clamped_min, clamped_max = _masked_min_max(ratio_clamped, mask)
        def weight_mean(w: torch.Tensor) -> float:
            if self.cfg.sequence_level_importance_ratios:  # one weight per sequence
                return masked_mean(w[:, 0], sample_mask, global_normalization_factor=seqs).item()
            return token_mean(w.expand_as(mask))
        return {
            "probs_ratio": token_mean(ratio),
            "probs_ratio_clamped": token_mean(ratio_clamped),
            "probs_ratio_min": ratio_min,
            "probs_ratio_max": ratio_max,
            "probs_ratio_clamped_min": clamped_min,
            "probs_ratio_clamped_max": clamped_max,
            # Fraction of tokens where the clip binds: PPO's clipped branch (no gradient flows), or
            # under CISPO a ratio outside the range (its weight is the bound).
            "clip_fraction": token_mean(clipped),
            # Token-weighted mean of exp(|gen - prev|); 1.0 = trainer and generator agree exactly.
            # The mask goes inside exp so padding never produces inf * 0.
            "token_mult_prob_error": token_mean(((gen - prev).abs() * mask).exp()),
            # KL(P_gen || P_train) with the generator as the sampling distribution, estimated with
            # the configured estimator (loss_fn.reference_policy_kl_type; k3 by default, as NeMo-RL).
            "gen_kl_error": token_mean(per_token_kl(gen, prev, self.cfg.reference_policy_kl_type)),
            # Mean of the importance weights the loss uses (after truncation), and before truncation.
            "sampling_importance_ratio": weight_mean(weights),
            "sampling_importance_ratio_untruncated": weight_mean(raw_weights),
            # Entropy of pi estimated from tokens sampled by pi_gen: -E_gen[(pi / pi_gen) log pi].
            "approx_entropy": token_mean(pg_terms.entropy_surrogate(logprobs, gen)),
            "num_valid_samples": sample_mask.sum().item(),
        }
