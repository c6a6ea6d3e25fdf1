"""GRPO (Shao et al. 2024, "DeepSeekMath") and its variants in one loop.

DAPO (Yu et al. 2025: clip-higher, token-level loss, dynamic sampling, overlong shaping),
GSPO (Zheng et al. 2025: sequence-level ratios) and Dr.GRPO (Liu et al. 2025: no std
normalisation, token-level sum) are config presets of the same loop and loss; see
`examples/configs/grpo_*_tiny.yaml`.

One step, top to bottom:
    prompts -> repeat per generation -> (lazy) refit -> [colocated on GPUs: policy state to host memory]
    -> rollout (generate + environments)
    -> reward shaping -> group advantages -> [dynamic sampling] -> masks
    -> previous logprobs (only if the batch spans several optimizer steps) and reference logprobs
    -> train (optimizer steps of `policy.train_global_batch_size` rows) -> metrics, validation, checkpoint
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from posttrain.algorithms.experience import PromptGroup, roll_out_groups, training_batch, update_policy
from posttrain.algorithms.grpo_run import run_grpo, setup_grpo, validate_grpo
from posttrain.algorithms.loop import prefixed
from posttrain.algorithms.on_policy import OnPolicyContext, phase_memory_metrics, start_generation_phase
from posttrain.config.schema import GRPOMasterConfig
from posttrain.distributed.batch import Batch
from posttrain.utils.timer import Timer

log = logging.getLogger("posttrain.grpo")

GRPOContext = OnPolicyContext  # GRPO's run is the on-policy runtime's (`on_policy.py`), which async GRPO shares


def setup(cfg: GRPOMasterConfig) -> GRPOContext:
    """Start a GRPO run (`grpo_run.setup_grpo`): what `grpo_train` or `async_grpo_train` trains."""
    return setup_grpo(cfg)


# --------------------------------------------------------------------------------- the loop
def grpo_train(ctx: GRPOContext) -> dict[str, float]:
    """Train synchronously from the context's step to its last step (`TrainingLoop` runs the
    schedule). A config with `grpo.async_grpo.enabled` trains with `async_grpo.async_grpo_train`
    (`posttrain grpo` picks it; both run as `grpo_run.run_grpo`)."""
    if ctx.cfg.grpo.async_grpo.enabled:
        raise ValueError("grpo.async_grpo.enabled=true: train with posttrain.algorithms.async_grpo "
                         "(async_grpo.run or async_grpo_train); grpo.grpo_train is the synchronous loop")
    return ctx.loop.run(lambda step, timer: grpo_step(ctx, step, timer), lambda: validate_grpo(ctx),
                        recovery=ctx.recovery)


def grpo_step(ctx: GRPOContext, step: int, timer: Timer) -> dict[str, float]:
    """One GRPO step: experience, previous and reference logprobs, policy update."""
    train_data, metrics = collect_experience(ctx, step, timer)
    train_metrics = update_policy(ctx, train_data, timer, off_policy=False)
    ctx.generation_stale = True
    return {**metrics, **prefixed(train_metrics, "train"), **phase_memory_metrics(ctx)}


def collect_experience(ctx: GRPOContext, step: int, timer: Timer) -> tuple[Batch, dict[str, float]]:
    """Generate rollouts and turn them into a training batch with advantages.

    With DAPO dynamic sampling, groups without reward variance are dropped and more prompts are
    generated until `num_prompts_per_step` groups remain (at most
    `dynamic_sampling_max_gen_batches` generation batches). With `grpo.partial_rollouts`, the
    complete groups of the carried-over and new prompts (`posttrain.algorithms.partial_rollouts`).
    """
    g = ctx.cfg.grpo
    if ctx.partial_rollouts is not None:
        start_generation_phase(ctx, timer)
        groups, metrics = ctx.partial_rollouts.roll_out(ctx, ctx.train_loader.next_batch(), step * 1000 + 1, timer)
        return training_batch(ctx, groups, groups, [metrics])
    kept: list[PromptGroup] = []
    generated: list[PromptGroup] = []
    rollout_metrics: list[dict[str, float]] = []
    while True:
        start_generation_phase(ctx, timer)
        groups, metrics = roll_out_groups(ctx, ctx.train_loader.next_batch(), step * 1000 + len(rollout_metrics) + 1,
                                          timer)
        generated += groups
        rollout_metrics.append(metrics)
        kept += [group for group in groups if group.has_signal or not g.use_dynamic_sampling]
        if not g.use_dynamic_sampling or len(kept) >= g.num_prompts_per_step:
            break
        if len(rollout_metrics) >= g.dynamic_sampling_max_gen_batches:
            log.warning(
                "dynamic sampling: only %d of %d prompt groups had reward variance after %d generation "
                "batches (grpo.dynamic_sampling_max_gen_batches); training on those", len(kept),
                g.num_prompts_per_step, len(rollout_metrics),
            )
            break
    train_data, metrics = training_batch(ctx, kept[: g.num_prompts_per_step], generated, rollout_metrics)
    if g.use_dynamic_sampling:
        metrics["train/dynamic_sampling_num_gen_batches"] = float(len(rollout_metrics))
    return train_data, metrics


# ------------------------------------------------------------------------------ entry point
def run(cfg: GRPOMasterConfig, train: Optional[Callable[[GRPOContext], Any]] = None) -> dict[str, Optional[float]]:
    """`posttrain grpo`: optional SFT warm start, then GRPO; prints before/after accuracy and
    returns them (`before`, `after`: the first and the last validation accuracy, or None).

    `train(ctx)` runs the steps (default None: `grpo_train`, the synchronous loop; `async_grpo.run`
    is the same run with the asynchronous one)."""
    return run_grpo(cfg, train or grpo_train)
