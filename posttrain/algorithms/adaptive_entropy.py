"""The entropy bonus's coefficient from step to step (`loss_fn.entropy_coef`, `loss_fn.adaptive_entropy`).

Fixed: the coefficient is `loss_fn.entropy_coef` throughout. Adaptive (Skywork-OR1 technical report,
arXiv:2505.22312, as TRL's ``use_adaptive_entropy``): after each training step the measured mean
per-token entropy H moves the coefficient c by ``entropy_coef_delta``, up when ``H <=
entropy_target`` and down otherwise, within ``[entropy_coef_min, entropy_coef_max]``; the next step
applies c only when that H was at or below the target (0 otherwise, and 0 before any measurement).

The state is a JSON-able dict kept in the training loop's ``state`` (``TrainingLoop.state``), which
every checkpoint saves and a resumed (or replayed) run restores, so a resumed run continues with
the coefficient it had.
"""

from __future__ import annotations

from typing import Any, Optional

from posttrain.config.schema import LossConfig

STATE_KEY = "adaptive_entropy"
ENTROPY_METRIC = "approx_entropy"  # the loss's mean per-token entropy of the step (a sampled estimate)


def entropy_bonus_enabled(cfg: LossConfig) -> bool:
    return cfg.entropy_coef > 0 or cfg.adaptive_entropy


def applied_coefficient(cfg: LossConfig, loop_state: dict[str, Any]) -> float:
    """The coefficient the next training step applies."""
    if not cfg.adaptive_entropy:
        return cfg.entropy_coef
    state = loop_state.get(STATE_KEY, {})
    last: Optional[float] = state.get("last_entropy")
    if last is None or last > cfg.entropy_target:
        return 0.0
    return state.get("coef", cfg.entropy_coef)


def update(cfg: LossConfig, loop_state: dict[str, Any], entropy: float) -> None:
    """Move the adaptive coefficient after a step whose mean per-token entropy was `entropy`."""
    if not cfg.adaptive_entropy:
        return
    state = loop_state.setdefault(STATE_KEY, {"coef": cfg.entropy_coef, "last_entropy": None})
    step = cfg.entropy_coef_delta if entropy <= cfg.entropy_target else -cfg.entropy_coef_delta
    state["coef"] = min(max(state["coef"] + step, cfg.entropy_coef_min), cfg.entropy_coef_max)
    state["last_entropy"] = float(entropy)


def train_with_entropy_bonus(cfg: LossConfig, loop_state: dict[str, Any], loss_fn: Any, train: Any) -> dict[str, float]:
    """Run `train()` (one training step's update, returning its metrics) with the entropy bonus's
    coefficient set on `loss_fn`, then move the adaptive coefficient by the step's entropy. Adds
    `entropy_coef` (the coefficient the step applied) to the metrics when the bonus is on."""
    if not entropy_bonus_enabled(cfg):
        return train()
    loss_fn.entropy_coef = applied_coefficient(cfg, loop_state)
    metrics = train()
    metrics["entropy_coef"] = loss_fn.entropy_coef
    if ENTROPY_METRIC in metrics:
        update(cfg, loop_state, metrics[ENTROPY_METRIC])
    return metrics
