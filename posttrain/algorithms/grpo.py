"""GRPO (Shao et al. 2024, "DeepSeekMath") and its variants in one loop.

DAPO (Yu et al. 2025: clip-higher, token-level loss, dynamic sampling, overlong shaping),
GSPO (Zheng et al. 2025: sequence-level ratios) and Dr.GRPO (Liu et al. 2025: no std
normalisation, token-level sum) are config presets of the same loop and loss; see
`examples/configs/grpo_*_tiny.yaml`.

One step, top to bottom:
    prompts -> repeat per generation -> (lazy) refit -> rollout (generate + environments)
    -> reward shaping -> group advantages -> [dynamic sampling] -> masks
    -> previous logprobs (only if the batch spans several optimizer steps) and reference logprobs
    -> train (optimizer steps of `policy.train_global_batch_size` rows) -> metrics, validation, checkpoint
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from posttrain.algorithms.experience import PromptGroup, refit_if_stale, roll_out_groups, training_batch
from posttrain.algorithms.on_policy import shutdown_run, train_loader
from posttrain.algorithms.loop import TrainingLoop, prefixed
from posttrain.algorithms.loss import LossFunction, build_loss
from posttrain.config.schema import GRPOMasterConfig
from posttrain.data.dataloader import ResumableLoader, routes
from posttrain.data.sample import Sample
from posttrain.distributed.batch import Batch
from posttrain.errors import UserError
from posttrain.evals.eval import evaluate, validation_sampling
from posttrain.job import (
    build_splits,
    make_cluster,
    make_envs,
    make_generation,
    make_policy,
    start_concurrently,
    start_run,
    workers_description,
)
from posttrain.models.refit import build_refit_metadata
from posttrain.algorithms.partial_rollouts import PartialRollouts, environment_problem
from posttrain.run_config import warm_start_export_dir, warm_start_job, with_warm_starts
from posttrain.utils import startup
from posttrain.utils.timer import Timer

log = logging.getLogger("posttrain.grpo")


@dataclass
class GRPOContext:
    """Everything the loop needs, built once by `setup`."""

    cfg: GRPOMasterConfig
    policy: Any
    generation: Any
    envs: dict[str, Any]
    tokenizer: Any
    train_loader: ResumableLoader
    val_samples: list[Sample]
    loop: TrainingLoop  # resume, validation schedule, logging, checkpoints, report
    loss_fn: LossFunction
    refit_metadata: Any
    clusters: list[Any] = field(default_factory=list)
    generation_stale: bool = False  # generation weights lag the policy's (both start from model_name)
    partial_rollouts: Optional[PartialRollouts] = None  # grpo.partial_rollouts: the carried-over groups

    @property
    def step(self) -> int:
        """Completed training steps (the version of the policy's weights)."""
        return self.loop.step

    @property
    def last_step(self) -> int:
        """`grpo.max_num_steps`, or fewer when `grpo.max_num_epochs` passes over the prompts end
        first (epochs count prompt batches; with dynamic sampling a step may draw several)."""
        return self.loop.last_step

    def shutdown(self) -> None:
        shutdown_run(self.cfg, self.loop, self.envs, (self.generation, self.policy, *self.clusters))


# ------------------------------------------------------------------------------------- set-up
def setup(cfg: GRPOMasterConfig) -> GRPOContext:
    from posttrain.data.processors import build_prompt_message_log

    cfg, tokenizer = start_run(cfg, seed=cfg.grpo.seed, max_num_steps=cfg.grpo.max_num_steps)
    train_samples, val_samples = build_splits(cfg, build_prompt_message_log, tokenizer, cfg.grpo.max_val_samples)
    problem = environment_problem(cfg, [env for _, env in routes(train_samples)])  # before any worker starts
    if problem:
        raise UserError(problem)
    # A blend (or several reasoning-gym tasks) is sampled by its components' weights.
    loader = train_loader(train_samples, cfg.grpo.num_prompts_per_step, shuffle=cfg.data.shuffle, seed=cfg.grpo.seed)

    colocated = cfg.policy.generation.colocated.enabled
    policy_cluster = make_cluster(cfg, cfg.policy.num_workers, colocated_groups=2 if colocated else 1)
    if colocated:
        gen_cluster = policy_cluster
    else:
        n_gen = cfg.policy.generation.colocated.num_workers or 1
        gen_cluster = make_cluster(cfg, n_gen, name="generation")
    reference = cfg.loss_fn.reference_policy_kl_penalty > 0
    policy, generation = start_concurrently(
        lambda: make_policy(cfg, policy_cluster, init_reference_model=reference),
        lambda: make_generation(cfg, gen_cluster),
        description=workers_description(cfg, reference=reference, generation=True),
    )
    with startup.doing("preparing the weight transfer to generation"):
        refit_metadata = build_refit_metadata(
            policy.refit_info(), policy.refit_bucket_bytes(), dtypes=generation.weight_dtypes()
        )
        generation.prepare_refit_info(refit_metadata)

    envs = make_envs(cfg, routes(train_samples) + routes(val_samples))

    loop = TrainingLoop(cfg, cfg.grpo, name="GRPO", section="grpo", policy=policy, loader=loader)
    ctx = GRPOContext(
        cfg=cfg, policy=policy, generation=generation, envs=envs, tokenizer=tokenizer, train_loader=loader,
        val_samples=val_samples, loop=loop, loss_fn=build_loss(cfg.loss_fn), refit_metadata=refit_metadata,
        clusters=[policy_cluster] + ([] if colocated else [gen_cluster]),
    )
    ctx.generation_stale = loop.resume()  # resumed weights are newer than the generation's
    if cfg.grpo.partial_rollouts.enabled:  # restores its carry-over and checkpoints it from now on
        ctx.partial_rollouts = PartialRollouts.attach(ctx)
    return ctx


# --------------------------------------------------------------------------------- the loop
def grpo_train(ctx: GRPOContext) -> dict[str, float]:
    """Train synchronously from the context's step to its last step (`TrainingLoop` runs the
    schedule). A config with `grpo.async_grpo.enabled` trains with `async_grpo.async_grpo_train`
    (`posttrain grpo` picks it; `async_grpo.run` is this module's `run` with that loop)."""
    if ctx.cfg.grpo.async_grpo.enabled:
        raise ValueError("grpo.async_grpo.enabled=true: train with posttrain.algorithms.async_grpo "
                         "(async_grpo.run or async_grpo_train); grpo.grpo_train is the synchronous loop")
    return ctx.loop.run(lambda step, timer: grpo_step(ctx, step, timer), lambda: validate(ctx))


def grpo_step(ctx: GRPOContext, step: int, timer: Timer) -> dict[str, float]:
    """One GRPO step: experience, previous and reference logprobs, policy update."""
    cfg = ctx.cfg
    # Logprobs are compared with the generation's processed logprobs: same temperature.
    temperature = cfg.policy.generation.temperature
    gbs = cfg.policy.train_global_batch_size
    train_data, metrics = _collect_experience(ctx, step, timer)

    with timer.time("logprobs"):
        if train_data.size > gbs:  # several optimizer steps: later ones need the old policy's logprobs
            train_data["prev_logprobs"] = ctx.policy.get_logprobs(train_data, temperature)["logprobs"]
        # else one step: the loss takes the training forward's own (detached) logprobs
        if cfg.loss_fn.reference_policy_kl_penalty > 0:
            ref = ctx.policy.get_reference_logprobs(train_data, temperature)
            train_data["reference_policy_logprobs"] = ref["logprobs"]

    with timer.time("policy_training"):
        train_metrics = ctx.policy.train(train_data, ctx.loss_fn, global_batch_size=gbs, temperature=temperature)
    ctx.generation_stale = True
    return {**metrics, **prefixed(train_metrics, "train")}


def _collect_experience(ctx: GRPOContext, step: int, timer: Timer) -> tuple[Batch, dict[str, float]]:
    """Generate rollouts and turn them into a training batch with advantages.

    With DAPO dynamic sampling, groups without reward variance are dropped and more prompts are
    generated until `num_prompts_per_step` groups remain (at most
    `dynamic_sampling_max_gen_batches` generation batches). With `grpo.partial_rollouts`, the
    complete groups of the carried-over and new prompts (`posttrain.algorithms.partial_rollouts`).
    """
    g = ctx.cfg.grpo
    if ctx.partial_rollouts is not None:
        refit_if_stale(ctx, timer)
        groups, metrics = ctx.partial_rollouts.roll_out(ctx, ctx.train_loader.next_batch(), step * 1000 + 1, timer)
        return training_batch(ctx, groups, groups, [metrics])
    kept: list[PromptGroup] = []
    generated: list[PromptGroup] = []
    rollout_metrics: list[dict[str, float]] = []
    while True:
        refit_if_stale(ctx, timer)
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


# ------------------------------------------------------------------------------- validation
def validate(ctx: GRPOContext) -> dict[str, float]:
    """Accuracy (and pass@k for k > 1) on the held-out prompts, with current weights; empty
    without validation data (the run said so at set-up)."""
    if not ctx.val_samples:
        return {}
    cfg, g = ctx.cfg, ctx.cfg.grpo
    k = g.val_num_generations_per_prompt
    greedy, temperature = validation_sampling(cfg.policy.generation, k)
    refit_if_stale(ctx)
    return evaluate(
        ctx.generation, ctx.val_samples, ctx.tokenizer, ctx.envs, k=k, greedy=greedy, temperature=temperature,
        batch_size=g.val_batch_size, max_seq_len=cfg.policy.max_total_sequence_length,
        max_rollout_turns=g.max_rollout_turns, seed=g.seed + 7919, weight_version=ctx.step,
        num_samples_to_print=cfg.logger.num_val_samples_to_print, log_samples=ctx.loop.log_samples,
    )


# ------------------------------------------------------------------------------ entry point
def run(cfg: GRPOMasterConfig, train: Optional[Callable[[GRPOContext], Any]] = None) -> dict[str, Optional[float]]:
    """`posttrain grpo`: optional SFT warm start, then GRPO; prints before/after accuracy and
    returns them (`before`, `after`: the first and the last validation accuracy, or None).

    `train(ctx)` runs the steps (default None: `grpo_train`, the synchronous loop; `async_grpo.run`
    passes the asynchronous one)."""
    if cfg.sft_warmup is not None:
        cfg = apply_sft_warm_start(cfg)
    ctx = setup(cfg)
    try:
        done = ctx.loop.done_message()
        if done:  # resumed at or past the last step: say so rather than reprint the old results
            print(done, flush=True)
            return {"before": None, "after": None}
        (train or grpo_train)(ctx)
        ctx.loop.finish()
    finally:
        ctx.shutdown()
    before, after = ctx.loop.headline_change()
    return {"before": before, "after": after}


def apply_sft_warm_start(cfg: GRPOMasterConfig) -> GRPOMasterConfig:
    """Run (or reuse) the SFT warm start and point the GRPO policy at its exported weights
    (`sft_warm_start_dir`; the warm start logs under `<logger.log_dir>/sft_warmup` and checkpoints
    under `<checkpointing.checkpoint_dir>/sft_warmup`)."""
    return with_warm_starts(cfg, sft_warm_start_dir)


def sft_warm_start_dir(warm: Any, log_dir: Path, checkpoint_dir: Optional[Path] = None) -> Path:
    """Run (or reuse) the SFT job `warm` (an `SFTMasterConfig`) and return its HF export.

    The export is cached by the config (`warm_start_export_dir`), so reruns, resumed runs and the
    presets that share a warm start share one export. The run logs under `log_dir` and, like any
    run, checkpoints under `checkpoint_dir` (its own `checkpointing.save_period`, ...; default None:
    no checkpoints, as when `warm.checkpointing.enabled` is false), so an interrupted warm start
    resumes from its last checkpoint on the next run instead of starting again.
    """
    from posttrain.algorithms import sft

    warm_dir = warm_start_export_dir(warm)
    if (warm_dir / "config.json").exists():
        print(f"[posttrain] reusing SFT warm start {warm_dir}", flush=True)
    else:
        print(f"[posttrain] SFT warm start -> {warm_dir}", flush=True)
        warm_dir.parent.mkdir(parents=True, exist_ok=True)
        with startup.CLOCK.nested():
            sft.run(warm_start_job(warm, log_dir, checkpoint_dir), export_dir=warm_dir)
    startup.mark("warm_start")
    return warm_dir
