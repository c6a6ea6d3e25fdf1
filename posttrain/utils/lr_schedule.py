"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay to `min_lr`.

The policy worker steps its scheduler once per `train` call (one RL / SFT / DPO step), as
NeMo-RL does, so `step` below counts training steps, not micro-batches.

Warm-up follows NeMo-RL's `LinearLR(start_factor=0.1, end_factor=1.0, total_iters=warmup_steps)`:
the learning rate rises linearly from 10% of `lr` at step 0 to the full `lr` at `warmup_steps`.
Decay runs from the end of warm-up to `total_steps`, after which the rate stays at `min_lr`:
- `constant`: `lr` forever (`min_lr` is ignored).
- `linear`: `lr -> min_lr` in a straight line.
- `cosine`: half a cosine from `lr` to `min_lr` (Loshchilov & Hutter 2017, "SGDR").
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from posttrain.config.schema import OptimizerConfig, SchedulerConfig
from posttrain.utils.registry import registrar, resolve

WARMUP_START_FACTOR = 0.1  # NeMo-RL's LinearLR start factor.

DecayFn = Callable[[float], float]  # progress in [0, 1] -> fraction of the way from lr to min_lr
DECAYS: dict[str, DecayFn] = {}


# `@register_decay("name")`: a decay shape `fn(progress)` returning how far (0..1) the rate has
# moved to `min_lr`; `policy.scheduler.name` picks one.
register_decay = registrar(DECAYS, "LR decay")


@register_decay("constant")
def _constant(progress: float) -> float:
    return 0.0


@register_decay("linear")
def _linear(progress: float) -> float:
    return progress


@register_decay("cosine")
def _cosine(progress: float) -> float:
    return 0.5 * (1.0 - math.cos(math.pi * progress))


def lr_at_step(
    step: int,
    *,
    lr: float,
    min_lr: float = 0.0,
    name: str = "constant",
    warmup_steps: int = 0,
    total_steps: int | None = None,
) -> float:
    """The learning rate used by optimizer step `step` (0-based).

    Args:
        step: training steps already taken (0 for the first step).
        lr: peak learning rate (`policy.optimizer.lr`).
        min_lr: floor reached at `total_steps` by `linear`/`cosine` (`policy.optimizer.min_lr`, default 0).
        name: decay shape, a name in `DECAYS` or an import path (`policy.scheduler.name`, default "constant").
        warmup_steps: linear warm-up length from 10% of `lr` (`policy.scheduler.warmup_steps`, default 0).
        total_steps: decay horizon including warm-up (`policy.scheduler.total_steps`); required by
            every schedule but "constant".
    """
    try:
        decay = resolve(DECAYS, name, "LR decay")
    except KeyError as e:
        raise ValueError(f"policy.scheduler.name: {e.args[0]}") from None
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return lr * (WARMUP_START_FACTOR + (1.0 - WARMUP_START_FACTOR) * step / warmup_steps)
    if name == "constant":
        return lr
    if total_steps is None:
        raise ValueError(
            f"policy.scheduler.total_steps is required for the {name!r} schedule "
            "(set it, or let the algorithm fill it from its max_num_steps)"
        )
    if total_steps <= warmup_steps:
        raise ValueError(
            f"policy.scheduler.total_steps={total_steps} must exceed policy.scheduler.warmup_steps={warmup_steps}"
        )
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return lr + (min_lr - lr) * decay(progress)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, optimizer_cfg: OptimizerConfig, scheduler_cfg: SchedulerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` following `lr_at_step`; its `state_dict` round-trips through checkpoints."""
    if optimizer_cfg.min_lr > optimizer_cfg.lr:
        raise ValueError(f"policy.optimizer.min_lr={optimizer_cfg.min_lr} exceeds policy.optimizer.lr={optimizer_cfg.lr}")
    # Fail now, not at the first decaying step, when the horizon is missing.
    lr_at_step(
        scheduler_cfg.warmup_steps,
        lr=optimizer_cfg.lr,
        min_lr=optimizer_cfg.min_lr,
        name=scheduler_cfg.name,
        warmup_steps=scheduler_cfg.warmup_steps,
        total_steps=scheduler_cfg.total_steps,
    )

    def factor(step: int) -> float:
        return (
            lr_at_step(
                step,
                lr=optimizer_cfg.lr,
                min_lr=optimizer_cfg.min_lr,
                name=scheduler_cfg.name,
                warmup_steps=scheduler_cfg.warmup_steps,
                total_steps=scheduler_cfg.total_steps,
            )
            / optimizer_cfg.lr
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
