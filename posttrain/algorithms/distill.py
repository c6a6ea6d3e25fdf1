"""On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning
from Self-Generated Mistakes"; NeMo-RL's `algorithms/distillation.py`).

The student learns the teacher's token distribution on the student's *own* samples, so it is
taught exactly where it goes wrong, with a dense per-token signal instead of one reward per answer.

One step, top to bottom:
    prompts -> repeat per generation -> (lazy) refit -> student rollout (generate + environments,
    whose rewards are logged as the student's training accuracy) -> teacher top-k logits of every
    token (the teacher's own worker group, forward only) -> train on the top-k KL
    (`DistillationLoss`, normalised by the step's global valid tokens) -> metrics, validation, checkpoint

The teacher is a `Policy` built without optimizer: its workers are ordinary policy workers, and
`get_topk_logits` uses the same micro-batching (fixed, dynamic or packed) as every other forward.
The embedded default (`examples/configs/distill_tiny.yaml`) warm-starts both models with SFT
(cached) and distils the larger `small` preset into the `tiny` one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from posttrain.algorithms.experience import refit_if_stale
from posttrain.algorithms.grpo import sft_warm_start_dir
from posttrain.algorithms.loop import TrainingLoop, prefixed
from posttrain.algorithms.on_policy import shutdown_run, train_loader
from posttrain.config.schema import DistillMasterConfig
from posttrain.data.dataloader import routes
from posttrain.data.message_log import flatten_message_logs
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
from posttrain.rollouts import run_multi_turn_rollout, sample_seeds
from posttrain.run_config import with_warm_starts
from posttrain.utils import startup
from posttrain.utils.metric_names import find_accuracy
from posttrain.utils.metrics import per_task_means
from posttrain.utils.timer import Timer


@dataclass
class DistillContext:
    """Everything the loop needs, built once by `setup` (field names shared with GRPO's context,
    so the lazy refit of `experience.refit_if_stale` serves both)."""

    cfg: DistillMasterConfig
    policy: Any  # the student
    generation: Any  # the student's generation engine
    teacher: Any  # forward-only Policy
    envs: dict[str, Any]
    tokenizer: Any
    train_loader: Any  # ResumableLoader, or BlendedLoader for a blend
    val_samples: list[Sample]
    loop: TrainingLoop  # resume, validation schedule, logging, checkpoints, report
    loss_fn: Any
    refit_metadata: Any
    teacher_cluster: Any
    clusters: list[Any] = field(default_factory=list)
    generation_stale: bool = False

    @property
    def step(self) -> int:
        return self.loop.step

    @property
    def last_step(self) -> int:
        return self.loop.last_step

    # Resume state of the run besides the loop's own (saved in every checkpoint).
    @property
    def kl_history(self) -> list:
        """(step, training KL) of every step."""
        return self.loop.state.setdefault("kl_history", [])

    @property
    def teacher_accuracy(self) -> Optional[float]:
        return self.loop.state.get("teacher_accuracy")

    def shutdown(self) -> None:
        shutdown_run(self.cfg, self.loop, self.envs, (self.generation, self.teacher, self.policy, *self.clusters))


# ------------------------------------------------------------------------------------- set-up
def apply_warm_starts(cfg: DistillMasterConfig) -> DistillMasterConfig:
    """Run (or reuse from the cache) the student's and the teacher's SFT warm starts and point
    `policy` / `teacher` at their exports. A teacher given as a training checkpoint (`step_N`, e.g.
    of a GRPO run) becomes its cached Hugging Face copy, as `policy.model_name` does in every job."""
    return with_warm_starts(cfg, sft_warm_start_dir)


def check_vocabularies(cfg: DistillMasterConfig) -> Optional[int]:
    """The shared vocabulary size of student and teacher as they will be loaded (after warm starts,
    hub downloads); raises `UserError` naming both keys and sizes when they differ, before any
    worker starts. Also refuses `distillation.topk_logits_k` above the vocabulary size."""
    from posttrain.models.hf import resolve_model_path
    from posttrain.models.paths import model_vocab_size, vocabulary_problem

    sizes = []
    for key, policy in (("policy.model_name", cfg.policy), ("teacher.model_name", cfg.teacher)):
        path = resolve_model_path(policy.model_name, policy.tiny_arch)
        size = model_vocab_size(path)
        if size is None and not Path(path).exists():  # a hub id not cached yet: transformers fetches its config
            from transformers import AutoConfig

            size = int(AutoConfig.from_pretrained(path).vocab_size)
        sizes.append((key, policy.model_name, size))
    problem = vocabulary_problem(*sizes)
    if problem:
        raise UserError(problem)
    vocab = sizes[0][2] or sizes[1][2]
    if vocab is not None and cfg.distillation.topk_logits_k > vocab:
        raise UserError(f"distillation.topk_logits_k={cfg.distillation.topk_logits_k} exceeds the vocabulary size {vocab}")
    return vocab


def setup(cfg: DistillMasterConfig) -> DistillContext:
    from posttrain.algorithms.distill_loss import DistillationLoss
    from posttrain.data.processors import build_prompt_message_log

    d = cfg.distillation
    cfg, tokenizer = start_run(cfg, seed=d.seed, max_num_steps=d.max_num_steps)
    train_samples, val_samples = build_splits(cfg, build_prompt_message_log, tokenizer, d.max_val_samples)
    # A blend (or several reasoning-gym tasks) is sampled by its components' weights, as in GRPO.
    loader = train_loader(train_samples, d.num_prompts_per_step, shuffle=cfg.data.shuffle, seed=d.seed)

    colocated = cfg.policy.generation.colocated.enabled
    policy_cluster = make_cluster(cfg, cfg.policy.num_workers, colocated_groups=2 if colocated else 1)
    gen_cluster = policy_cluster if colocated else make_cluster(
        cfg, cfg.policy.generation.colocated.num_workers or 1, name="generation")
    # The teacher's bundles also host, once, the generation engine that measures its accuracy.
    teacher_cluster = make_cluster(cfg, cfg.teacher.num_workers, colocated_groups=2, name="teacher")
    policy, generation, teacher = start_concurrently(
        lambda: make_policy(cfg, policy_cluster),
        lambda: make_generation(cfg, gen_cluster),
        lambda: make_policy(cfg, teacher_cluster, cfg.teacher, init_optimizer=False, name="teacher"),
        description=workers_description(cfg, generation=True, teacher=cfg.teacher),
    )
    with startup.doing("preparing the weight transfer to generation"):
        refit_metadata = build_refit_metadata(
            policy.refit_info(), policy.refit_bucket_bytes(), dtypes=generation.weight_dtypes()
        )
        generation.prepare_refit_info(refit_metadata)
    envs = make_envs(cfg, routes(train_samples) + routes(val_samples))

    ctx = DistillContext(
        cfg=cfg, policy=policy, generation=generation, teacher=teacher, envs=envs, tokenizer=tokenizer,
        train_loader=loader, val_samples=val_samples,
        loop=TrainingLoop(cfg, d, name="distillation", section="distillation", policy=policy, loader=loader),
        loss_fn=DistillationLoss(**cfg.loss_fn.model_dump()),
        refit_metadata=refit_metadata, teacher_cluster=teacher_cluster,
        clusters=[policy_cluster, teacher_cluster] + ([] if colocated else [gen_cluster]),
    )
    ctx.generation_stale = ctx.loop.resume()  # resumed weights are newer than the generation's
    return ctx


# --------------------------------------------------------------------------------- the loop
def distill_train(ctx: DistillContext) -> dict[str, float]:
    """Distil from the context's step to its last step (`TrainingLoop` runs the schedule)."""
    return ctx.loop.run(lambda step, timer: distill_step(ctx, step, timer), lambda: _validate(ctx))


def distill_step(ctx: DistillContext, step: int, timer: Timer) -> dict[str, float]:
    """One step: student rollouts, the teacher's top-k logits, a student update on the KL."""
    cfg, d = ctx.cfg, ctx.cfg.distillation
    temperature = cfg.policy.generation.temperature  # student and teacher see the sampling distribution
    train_data, metrics = _student_rollouts(ctx, step, timer)
    with timer.time("logprobs"):  # the teacher's forward pass (a logprob-like pass)
        top = ctx.teacher.get_topk_logits(train_data, d.topk_logits_k, temperature)
        train_data["teacher_topk_logits"] = top["topk_logits"]
        train_data["teacher_topk_indices"] = top["topk_indices"]
    with timer.time("policy_training"):
        train_metrics = ctx.policy.train(train_data, ctx.loss_fn, global_batch_size=cfg.policy.train_global_batch_size,
                                         temperature=temperature)
    ctx.generation_stale = True
    ctx.kl_history.append((step, train_metrics["loss"]))
    return {**metrics, **prefixed(train_metrics, "train")}


def _student_rollouts(ctx: DistillContext, step: int, timer: Timer) -> tuple[Batch, dict[str, float]]:
    """The student answers the next prompts `num_generations_per_prompt` times; the environments
    score the answers (logged, not trained on). Returns the flattened training rows."""
    cfg, d = ctx.cfg, ctx.cfg.distillation
    prompts = ctx.train_loader.next_batch()
    samples = [prompt.fresh_copy() for prompt in prompts for _ in range(d.num_generations_per_prompt)]
    refit_if_stale(ctx, timer)
    t0 = time.perf_counter()
    result = run_multi_turn_rollout(
        ctx.generation, samples, ctx.tokenizer, ctx.envs, max_seq_len=cfg.policy.max_total_sequence_length,
        max_rollout_turns=d.max_rollout_turns, seeds=sample_seeds(d.seed, step, len(samples)), weight_version=ctx.step,
        group_size=d.num_generations_per_prompt,
    )
    result.add_timings(timer, time.perf_counter() - t0)
    train_data = flatten_message_logs([s.message_log for s in samples], pad_token_id=ctx.tokenizer.pad_token_id)
    train_data["sample_mask"] = torch.tensor([s.loss_multiplier for s in samples])
    metrics = {
        "train/reward": result.rewards.mean().item(),
        **per_task_means(result.rewards, [s.task_name for s in samples], "train/reward",
                         list(ctx.envs)),
        "train/num_samples": float(train_data.size),
        "train/mean_prompt_length": sum(p.prompt_length for p in prompts) / len(prompts),
        **prefixed(result.metrics, "train"),
    }
    return train_data, metrics


# ------------------------------------------------------------------------------- validation
def _evaluate(ctx: DistillContext, generation, weight_version: int, show_samples: bool = True) -> dict[str, float]:
    """GRPO's validation protocol (`grpo.validate`) with the `distillation.*` sizes; `show_samples`
    logs a few completions (`logger.num_val_samples_to_print`; the student's, not the teacher's)."""
    cfg, d = ctx.cfg, ctx.cfg.distillation
    greedy, temperature = validation_sampling(cfg.policy.generation, 1)
    return evaluate(
        generation, ctx.val_samples, ctx.tokenizer, ctx.envs, k=1, greedy=greedy, temperature=temperature,
        batch_size=d.val_batch_size, max_seq_len=cfg.policy.max_total_sequence_length,
        max_rollout_turns=d.max_rollout_turns, seed=d.seed + 7919, weight_version=weight_version,
        num_samples_to_print=cfg.logger.num_val_samples_to_print if show_samples else 0,
        log_samples=ctx.loop.log_samples,
    )


def _validate(ctx: DistillContext) -> dict[str, float]:
    """The student's validation accuracy; at step 0 also the teacher's (measured once)."""
    if not ctx.val_samples:
        return {}
    refit_if_stale(ctx)
    metrics = _evaluate(ctx, ctx.generation, ctx.step)
    if ctx.step == 0 and ctx.teacher_accuracy is not None:
        metrics["validation/teacher_accuracy"] = ctx.teacher_accuracy
        warning = weak_teacher_warning(ctx.teacher_accuracy, metrics[find_accuracy(metrics)])
        if warning:
            print(warning, flush=True)
    return metrics


def weak_teacher_warning(teacher: float, student: float) -> Optional[str]:
    """The warning for a teacher that scores below its student before distillation (the student
    would learn to be worse), or None."""
    if teacher >= student:
        return None
    return (f"[posttrain] WARNING: the teacher's validation accuracy {teacher:.1%} is below the student's "
            f"{student:.1%}: distilling would pull the student towards a worse model; check teacher.model_name "
            f"and its warm start (teacher_warmup)")


def measure_teacher_accuracy(ctx: DistillContext) -> Optional[float]:
    """The teacher's validation accuracy, with the students' protocol, by a generation engine
    started on the teacher's bundles for this once (then shut down)."""
    if not ctx.val_samples:
        return None
    engine = make_generation(ctx.cfg, ctx.teacher_cluster, model=ctx.cfg.teacher, name="teacher_generation")
    try:
        metrics = _evaluate(ctx, engine, 0, show_samples=False)
        return metrics[find_accuracy(metrics)]
    finally:
        engine.shutdown()


# ------------------------------------------------------------------------------ entry point
def run(cfg: DistillMasterConfig) -> dict[str, Optional[float]]:
    """`posttrain distill`: warm starts (cached), teacher accuracy, distillation, a final summary.

    Returns `teacher_accuracy`, `student_before`, `student_after` (validation accuracies) and
    `kl_first`, `kl_last` (the training KL, averaged over the first and the last few steps).
    """
    cfg = apply_warm_starts(cfg)
    check_vocabularies(cfg)
    ctx = setup(cfg)
    try:
        done = ctx.loop.done_message()
        if done:  # resumed at or past the last step: say so rather than reprint the old results
            print(done, flush=True)
            return summarize(ctx)
        if ctx.teacher_accuracy is None and ctx.cfg.distillation.val_at_start:
            ctx.loop.state["teacher_accuracy"] = measure_teacher_accuracy(ctx)
        distill_train(ctx)
        summary = summarize(ctx)
        ctx.loop.finish(details(ctx, summary))
    finally:
        ctx.shutdown()
    return summary


def summarize(ctx: DistillContext, window: int = 5) -> dict[str, Optional[float]]:
    """Teacher and student accuracies and the training KL at the start and the end of the run
    (each KL averaged over `window` steps: one step's KL depends on which prompts it drew)."""
    kls = [kl for _, kl in ctx.kl_history]
    n = max(1, min(window, len(kls) // 2))
    before, after = ctx.loop.headline_change()
    return {
        "teacher_accuracy": ctx.teacher_accuracy,
        "student_before": before,
        "student_after": after,
        "kl_first": sum(kls[:n]) / n if kls else None,
        "kl_last": sum(kls[-n:]) / n if kls else None,
    }


def details(ctx: DistillContext, summary: dict[str, Optional[float]]) -> str:
    """The distillation's own part of the summary line: the KL and the teacher's accuracy."""
    s = summary
    kl = "n/a" if s["kl_first"] is None else f"{s['kl_first']:.4f} -> {s['kl_last']:.4f}"
    teacher = "n/a" if s["teacher_accuracy"] is None else f"{s['teacher_accuracy']:.1%}"
    return (f"; {ctx.cfg.loss_fn.kl_type} KL over the teacher's top-{ctx.cfg.distillation.topk_logits_k} "
            f"{kl} (mean of the first / last steps); teacher validation accuracy {teacher}")
