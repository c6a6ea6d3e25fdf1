"""GRPO's run on the on-policy runtime (`on_policy.py`), shared by the synchronous loop (`grpo.py`)
and the asynchronous one (`async_grpo.py`): set-up (with partial rollouts' carry-over when
`grpo.partial_rollouts.enabled`), validation, and the run with its optional SFT warm start.
This module imports neither loop, so neither loop imports the other (tests/unit/test_import_graph.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from posttrain.algorithms.loss import build_loss
from posttrain.algorithms.on_policy import (
    OnPolicyContext,
    apply_warm_starts,
    build_on_policy_run,
    run_on_policy,
    validate,
)
from posttrain.algorithms.partial_rollouts import PartialRollouts, environment_problem


def setup_grpo(cfg: Any) -> OnPolicyContext:
    """A GRPO run (either loop), started: the on-policy set-up with GRPO's clipped policy-gradient
    loss and, for a KL penalty (`loss_fn.reference_policy_kl_penalty` > 0), a reference model."""
    ctx = build_on_policy_run(cfg, section="grpo", name="GRPO", make_loss=lambda c: build_loss(c.loss_fn),
                              reference=cfg.loss_fn.reference_policy_kl_penalty > 0, env_problem=environment_problem)
    if cfg.grpo.partial_rollouts.enabled:  # after the resume: restores its carry-over, checkpoints it from now on
        ctx.partial_rollouts = PartialRollouts.attach(ctx)
    return ctx


def validate_grpo(ctx: OnPolicyContext) -> dict[str, float]:
    """Accuracy, and pass@k for `grpo.val_num_generations_per_prompt` = k > 1, on the held-out
    prompts with the current weights (`on_policy.validate`)."""
    return validate(ctx, k=ctx.cfg.grpo.val_num_generations_per_prompt)


def run_grpo(cfg: Any, train: Callable[[OnPolicyContext], Any],
             setup: Optional[Callable[[Any], OnPolicyContext]] = None) -> dict[str, Optional[float]]:
    """Optional SFT warm start, then GRPO trained by `train(ctx)` (the synchronous or the
    asynchronous loop; PPO's, with `setup` its set-up; default None: `setup_grpo`); prints before/after
    accuracy and returns them (`before`, `after`: the first and the last validation accuracy, or
    None; both None for a run resumed past its last step)."""
    ctx = (setup or setup_grpo)(apply_warm_starts(cfg))
    if not run_on_policy(ctx, train):
        return {"before": None, "after": None}
    before, after = ctx.loop.headline_change()
    return {"before": before, "after": after}
