"""`loss_fn`: the policy-gradient loss (GRPO, DAPO, GSPO, Dr.GRPO variants)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from posttrain.config.schema.base import Section, check_component_name


# TRL's GRPO `loss_type` names as presets of the one clipped policy-gradient loss: each sets the keys
# that make the variant, over the section's own values (the embedded default sets token_level_loss,
# and a preset must still mean the same loss there). Hyperparameters (clip bounds, temperatures)
# stay the config's. A new variant is one entry here.
LOSS_PRESETS: dict[str, dict[str, Any]] = {
    # Per-sequence token mean, then mean over sequences (Shao et al. 2024).
    "grpo": {"token_level_loss": False},
    # Token mean over the step's tokens (Yu et al. 2025); its clip-higher is ratio_clip_max (e.g. 0.28).
    "dapo": {"token_level_loss": True},
    # TRL's bnpo divides by the tokens of the local batch; posttrain always divides by the optimizer
    # step's global token count (exact normalisation), so BNPO is the token-level loss.
    "bnpo": {"token_level_loss": True},
    "gspo": {"token_level_loss": False, "sequence_level_importance_ratios": True},
    "cispo": {"use_cispo": True, "token_level_loss": True},
    # SAPO aggregates per sequence, as TRL's loss_type='sapo'.
    "sapo": {"ratio_gate": "sapo", "token_level_loss": False},
    # LUSPO: GSPO's sequence ratio, each sequence's loss times its length (token sum per sequence).
    "luspo": {"token_level_loss": False, "sequence_level_importance_ratios": True, "sequence_token_reduction": "sum"},
    "vespo": {"ratio_gate": "vespo", "token_level_loss": True},
}


class LossConfig(Section):
    """Clipped policy-gradient loss; presets for GRPO, DAPO, GSPO, Dr.GRPO are example configs, and
    TRL's loss types are `loss_fn.preset` names."""

    preset: Optional[str] = Field(
        None,
        description=(
            "A loss variant by TRL's GRPO loss_type name (default None: the keys as given). It sets the keys that "
            "make the variant, over the section's values; clip bounds, temperatures and the rest stay the config's: "
            "'grpo' (per-sequence mean), 'dapo' (token mean; Yu et al. 2025, arXiv:2503.14476, with e.g. "
            "ratio_clip_max=0.28), 'bnpo' (token mean; TRL divides by the local batch's tokens, posttrain always by "
            "the step's global count, so it is the token-level loss), 'gspo' (Zheng et al. 2025, arXiv:2507.18071), "
            "'cispo' (use_cispo; MiniMax 2025, arXiv:2506.13585), 'sapo' (ratio_gate=sapo, per-sequence "
            "mean; SAPO, arXiv:2511.20347), 'luspo' (GSPO ratios, sequence_token_reduction=sum; "
            "arXiv:2602.05261), 'vespo' (ratio_gate=vespo, token mean; arXiv:2602.10693)."
        ),
    )
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

    sequence_token_reduction: Literal["mean", "sum"] = Field(
        "mean",
        description=(
            "With token_level_loss=false, how a sequence's tokens are reduced before the mean over sequences: "
            "'mean' (default; GRPO, GSPO) or 'sum' (each sequence's loss times its length: LUSPO, "
            "'Length-Unbiased Sequence Policy Optimization', arXiv:2602.05261; preset 'luspo')."
        ),
    )
    ratio_gate: Literal["clip", "sapo", "vespo"] = Field(
        "clip",
        description=(
            "How the ratio r = pi / pi_old weighs the advantage. 'clip' (default): PPO's hard clip "
            "max(-A r, -A clip(r)) (or CISPO with use_cispo). 'sapo': a soft gate instead of the hard clip, "
            "-A * sigmoid(tau (r - 1)) * 4 / tau with tau = sapo_temperature_pos where A > 0, else "
            "sapo_temperature_neg (SAPO, 'Soft Adaptive Policy Optimization', arXiv:2511.20347; TRL's loss_type="
            "'sapo'). 'vespo': -sg(phi(w)) A log pi with w the sequence's ratio prod_t r_t (times the importance "
            "weights under use_importance_sampling_correction) and phi(w) = exp(lambda (1 - w)) w^k, k and lambda "
            "by the sign of A (VESPO, 'Variational Sequence-Level Soft Policy Optimization', arXiv:2602.10693; "
            "TRL's loss_type='vespo'); needs token-level ratios."
        ),
    )
    sapo_temperature_pos: float = Field(
        1.0, gt=0, description="SAPO's gate temperature where the advantage is positive (default 1.0, the paper's).",
    )
    sapo_temperature_neg: float = Field(
        1.05, gt=0,
        description="SAPO's gate temperature where the advantage is not positive (default 1.05, the paper's).",
    )
    vespo_k_pos: float = Field(2.0, ge=0, description="VESPO's power k where A >= 0 (default 2.0, TRL's).")
    vespo_lambda_pos: float = Field(3.0, gt=0, description="VESPO's decay lambda where A >= 0 (default 3.0, TRL's).")
    vespo_k_neg: float = Field(3.0, ge=0, description="VESPO's power k where A < 0 (default 3.0, TRL's).")
    vespo_lambda_neg: float = Field(2.0, gt=0, description="VESPO's decay lambda where A < 0 (default 2.0, TRL's).")
    off_policy_mask_threshold: Optional[float] = Field(
        None, gt=0,
        description=(
            "Off-policy sequence mask (DeepSeek-V3.2, arXiv:2512.02556, eq. 9; TRL's off_policy_mask_threshold): a "
            "sequence with a negative advantage whose mean per-token KL from the generating policy, mean_t(logp_gen "
            "- logp), exceeds this is left out of the policy-gradient term. Default None: off. E.g. 0.5."
        ),
    )
    entropy_coef: float = Field(
        0.0, ge=0,
        description=(
            "Entropy bonus: loss -= entropy_coef * H, with H the mean per-token entropy of the policy over the "
            "step's tokens (estimated from the sampled tokens, see docs/algorithms.md), whatever the loss's "
            "aggregation (TRL's entropy_coef). Default 0: off. With adaptive_entropy, the starting coefficient."
        ),
    )
    adaptive_entropy: bool = Field(
        False,
        description=(
            "Adapt entropy_coef each step toward entropy_target (Skywork-OR1, arXiv:2505.22312; TRL's "
            "use_adaptive_entropy): +entropy_coef_delta when the last step's entropy was at or below the target, "
            "-entropy_coef_delta above it, within [entropy_coef_min, entropy_coef_max]; the bonus applies only "
            "while the entropy is at or below the target. Saved in checkpoints. Default false."
        ),
    )
    entropy_target: float = Field(
        0.2, gt=0, description="Target mean per-token entropy in nats of adaptive_entropy (default 0.2, TRL's).",
    )
    entropy_coef_delta: float = Field(
        0.005, gt=0, description="Step of adaptive_entropy's coefficient per training step (default 0.005, TRL's).",
    )
    entropy_coef_min: float = Field(0.0, ge=0, description="Lower bound of adaptive_entropy's coefficient (default 0).")
    entropy_coef_max: float = Field(1.0, ge=0, description="Upper bound of adaptive_entropy's coefficient (default 1).")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            preset = data["preset"]
            if preset not in LOSS_PRESETS:
                from difflib import get_close_matches

                close = get_close_matches(str(preset), LOSS_PRESETS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"loss_fn.preset={preset!r} is not one of {sorted(LOSS_PRESETS)}{hint}")
            data = {**data, **LOSS_PRESETS[preset]}
        return data

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
    if cfg.name != "clipped_pg":
        set_here = [key for key in ("entropy_coef", "adaptive_entropy", "off_policy_mask_threshold", "ratio_gate")
                    if getattr(cfg, key) != LossConfig.model_fields[key].default]
        if set_here:
            return f"loss_fn.{set_here[0]} is a key of the clipped_pg loss, not of loss_fn.name={cfg.name!r}"
    if cfg.entropy_coef_min > cfg.entropy_coef_max:
        return (f"loss_fn.entropy_coef_min={cfg.entropy_coef_min} is greater than "
                f"loss_fn.entropy_coef_max={cfg.entropy_coef_max}")
    if cfg.sequence_token_reduction == "sum" and cfg.token_level_loss:
        return "loss_fn.sequence_token_reduction='sum' reduces per sequence and needs loss_fn.token_level_loss=false"
    if cfg.ratio_gate != "clip":
        clashes = [key for key, on in (
            ("use_cispo", cfg.use_cispo),
            ("ratio_clip_c", cfg.ratio_clip_c is not None),
            ("disable_ppo_ratio", cfg.disable_ppo_ratio),
            ("sequence_level_importance_ratios", cfg.ratio_gate == "vespo" and cfg.sequence_level_importance_ratios),
        ) if on]
        if clashes:
            return (f"loss_fn.ratio_gate={cfg.ratio_gate!r} cannot be combined with loss_fn.{clashes[0]} "
                    "(it replaces the hard clip" + (" and forms its own sequence ratio)" if cfg.ratio_gate == "vespo"
                                                    else ")"))
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
