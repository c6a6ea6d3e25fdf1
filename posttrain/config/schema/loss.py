"""`loss_fn`: the policy-gradient loss (GRPO, DAPO, GSPO, Dr.GRPO variants)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from posttrain.config.schema.base import Section, check_component_name


class LossConfig(Section):
    """Clipped policy-gradient loss; presets for GRPO, DAPO, GSPO, Dr.GRPO are example configs."""

    name: str = Field(
        "clipped_pg",
        description=(
            "Loss: 'clipped_pg' (default; configured by the keys below) or a user's loss class as an import "
            "path 'module:Class' / 'file.py:Class', built as Class(**loss_fn.kwargs)."
        ),
    )
    kwargs: dict[str, Any] = Field({}, description="Keyword arguments of a custom loss (loss_fn.name='module:Class').")
    reference_policy_kl_penalty: float = Field(0.0, ge=0, description="beta; 0 skips the reference model.")
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description=(
            "KL estimator against the reference policy (Schulman 2020): 'k1' log-ratio, 'k2' half squared, 'k3' "
            "(default) unbiased and positive."
        ),
    )
    reference_policy_kl_gradient: Literal["score_function", "estimator"] = Field(
        "score_function",
        description=(
            "How the KL penalty is differentiated. 'score_function' (default; NeMo-RL's loss, TRL's "
            "use_bias_correction_kl): the estimate is weighted by exp(logp - sg(logp)) so the gradient "
            "is that of KL(pi||ref), and kl_output_clamp_value applies after weighting. 'estimator' "
            "(DeepSeek-GRPO, TRL's default): the estimate alone is differentiated (for k3 its gradient "
            "is that of KL(ref||pi))."
        ),
    )
    kl_input_clamp_value: Optional[float] = Field(
        20.0, gt=0,
        description="Clamp the log-ratio fed to the KL estimator to +-this; None disables.",
    )
    kl_output_clamp_value: Optional[float] = Field(
        10.0, gt=0,
        description="Clamp each token's KL estimate to +-this (after importance weighting); None disables.",
    )
    ratio_clip_min: float = Field(
        0.2, ge=0,
        description="PPO clip epsilon below 1: ratios under 1 - ratio_clip_min are clipped.",
    )
    ratio_clip_max: float = Field(
        0.2, ge=0,
        description="PPO clip epsilon above 1 (DAPO's clip-higher raises it, e.g. 0.28).",
    )
    ratio_clip_c: Optional[float] = Field(None, gt=1, description="Dual-clip constant (Ye et al. 2020).")
    use_on_policy_kl_approximation: bool = Field(
        False,
        description=(
            "Weight the KL term by the importance ratio of current to generating policy (NeMo-RL's on-policy KL "
            "approximation)."
        ),
    )
    use_importance_sampling_correction: bool = Field(
        False,
        description=(
            "Weight the loss by exp(logp_train_old - logp_generation), correcting generation/training mismatch and "
            "staleness. Default false, but true when policy.generation.precision differs from the training "
            "precision (a value set in the config is kept, with a warning line when false)."
        ),
    )
    truncated_importance_sampling_ratio: Optional[float] = Field(
        None, gt=0,
        description=(
            "Upper bound of the importance weights (None: untruncated); see truncated_importance_sampling_type."
        ),
    )
    truncated_importance_sampling_ratio_min: Optional[float] = Field(
        None, ge=0,
        description=(
            "Lower bound for 'icepop' and 'seq-mask-tis' (and the clamp floor of 'tis'); must not exceed the upper "
            "bound."
        ),
    )
    truncated_importance_sampling_type: Optional[Literal["tis", "icepop", "seq-mask-tis"]] = Field(
        None,
        description=(
            "'tis' clamps weights into the bounds, 'icepop' zeroes tokens outside them, 'seq-mask-tis' zeroes whole "
            "sequences whose geometric-mean weight is outside."
        ),
    )
    sequence_level_importance_ratios: bool = Field(False, description="GSPO (Zheng et al. 2025).")
    token_level_loss: bool = Field(True, description="Token-mean over the batch (DAPO); False: per-sequence mean.")
    force_on_policy_ratio: bool = Field(
        False,
        description="Use ratio exp(logp - sg(logp)) = 1 with a live gradient: strictly on-policy, no clipping effect.",
    )
    disable_ppo_ratio: bool = Field(
        False,
        description="No ratio and no clipping: the loss is -A * logp (REINFORCE / RLOO style).",
    )
    use_cispo: bool = Field(
        False,
        description=(
            "CISPO (MiniMax-M1, MiniMax 2025, arXiv:2506.13585): the loss is -sg(clip(r, 1 - ratio_clip_min, 1 + ratio_clip_max)) "
            "* A * logp, so every token keeps a gradient (PPO's clip zeroes it outside the range); needs "
            "token_level_loss, and neither GSPO ratios, dual clip, force_on_policy_ratio nor disable_ppo_ratio. "
            "Preset: grpo_cispo_tiny.yaml."
        ),
    )

    @model_validator(mode="after")
    def _check(self):
        # Left unset, the correction may still default to true (a generation precision other than
        # the trainer's): the job's config decides it, then checks the section again.
        problem = loss_option_problem(self, correction_known="use_importance_sampling_correction" in self.model_fields_set)
        if problem:
            raise ValueError(problem)
        return self


def loss_option_problem(cfg: LossConfig, correction_known: bool = True) -> Optional[str]:
    """Why these `loss_fn.*` options cannot be combined, or None. Checked when the config loads
    (before any worker starts) and again by `ClippedPGLoss` for losses built in code.
    `correction_known=False` skips what depends on `use_importance_sampling_correction` (not yet
    resolved: `jobs.resolve_importance_sampling_correction`)."""
    try:
        check_component_name(cfg.name, "loss_fn.name")
    except ValueError as e:
        return str(e)
    if cfg.kwargs and cfg.name == "clipped_pg":
        return "loss_fn.kwargs is for a custom loss (loss_fn.name='module:Class'); clipped_pg takes the loss_fn.* keys"
    if cfg.sequence_level_importance_ratios and cfg.token_level_loss:
        return "loss_fn.sequence_level_importance_ratios (GSPO) needs loss_fn.token_level_loss=false"
    truncation = cfg.truncated_importance_sampling_type
    upper, lower = cfg.truncated_importance_sampling_ratio, cfg.truncated_importance_sampling_ratio_min
    if truncation is None:
        if upper is not None or lower is not None:
            key = "truncated_importance_sampling_ratio" if upper is not None else "truncated_importance_sampling_ratio_min"
            return (
                f"loss_fn.{key} is set but loss_fn.truncated_importance_sampling_type is not; "
                "choose 'tis', 'icepop' or 'seq-mask-tis'"
            )
    else:
        if upper is None:
            return (
                f"loss_fn.truncated_importance_sampling_type={truncation!r} needs "
                "loss_fn.truncated_importance_sampling_ratio (the upper bound)"
            )
        if correction_known and not cfg.use_importance_sampling_correction:
            return "loss_fn.truncated_importance_sampling_type is set but loss_fn.use_importance_sampling_correction is false"
        if lower is not None and lower > upper:
            # With icepop / seq-mask-tis every weight would be dropped (loss and gradient exactly 0);
            # with tis every weight would be clamped to the maximum.
            return (
                f"loss_fn.truncated_importance_sampling_ratio_min={lower} is greater than "
                f"loss_fn.truncated_importance_sampling_ratio={upper}: the truncation interval [min, max] is empty"
            )
        if truncation == "seq-mask-tis" and cfg.sequence_level_importance_ratios:
            return (
                "loss_fn.truncated_importance_sampling_type='seq-mask-tis' masks sequences of token-level "
                "weights and cannot be combined with loss_fn.sequence_level_importance_ratios"
            )
    if cfg.force_on_policy_ratio and cfg.disable_ppo_ratio:
        return "loss_fn.force_on_policy_ratio and loss_fn.disable_ppo_ratio are exclusive"
    if cfg.use_cispo:
        # As NeMo-RL's setup: CISPO weighs each token's logp by its own clipped ratio.
        clashes = [key for key, on in (
            ("token_level_loss=false", not cfg.token_level_loss),
            ("sequence_level_importance_ratios", cfg.sequence_level_importance_ratios),
            ("ratio_clip_c", cfg.ratio_clip_c is not None),
            ("force_on_policy_ratio", cfg.force_on_policy_ratio),
            ("disable_ppo_ratio", cfg.disable_ppo_ratio),
        ) if on]
        if clashes:
            return f"loss_fn.use_cispo cannot be combined with loss_fn.{clashes[0]} (CISPO is a token-level loss on the clipped ratio)"
    return None
