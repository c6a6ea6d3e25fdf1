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
With `teachers` (a teacher per task of a blend, `distill_teachers`), each row is scored by its
task's teacher and the KL is also logged per task (`train/distill_loss/<task>`).
A teacher whose tokenizer differs from the student's reads the student's answers as text, aligned
by character offsets (`distill_xtok`; `distillation.tokenizer_alignment`), and its rows train on
`CrossTokenizerDistillationLoss`; same-tokenizer runs keep the path above unchanged.
The embedded default (`examples/configs/distill_tiny.yaml`) warm-starts both models with SFT
(cached) and distils the larger `small` preset into the `tiny` one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from posttrain.algorithms.loop import prefixed
from posttrain.algorithms.on_policy import (
    OnPolicyContext,
    apply_warm_starts,
    build_on_policy_run,
    evaluate_engine,
    refit_if_stale,
    run_on_policy,
    validate,
)
from posttrain.algorithms.distill_teachers import (
    assign_teachers, per_task_kl, route_rows, teacher_task_index, teachers_topk,
)
from posttrain.config.schema import DistillMasterConfig, teacher_sections
from posttrain.data.message_log import flatten_message_logs
from posttrain.distributed.batch import Batch
from posttrain.errors import UserError
from posttrain.job import make_generation
from posttrain.rollouts import run_multi_turn_rollout, sample_seeds
from posttrain.utils.metric_names import find_accuracy
from posttrain.utils.metrics import per_task_means
from posttrain.utils.timer import Timer


@dataclass
class DistillContext(OnPolicyContext):
    """The on-policy run (`OnPolicyContext`: `policy` is the student, `generation` its engine)
    with the teacher, built once by `setup`."""

    section: str = "distillation"
    teacher: Any = None  # forward-only Policy (with `teachers`, the first of them)
    teacher_cluster: Any = None  # the teachers' bundles (they also host their accuracy's generation engine)
    teachers: dict = field(default_factory=dict)  # {teacher key: forward-only Policy}; {} -> {"teacher": teacher}
    teacher_of: dict = field(default_factory=dict)  # {training task: teacher key}; {} -> `teacher` for every task
    cross: dict = field(default_factory=dict)  # {teacher key: CrossTokenizerTeacher} of the teachers of another tokenizer

    # Resume state of the run besides the loop's own (saved in every checkpoint).
    @property
    def kl_history(self) -> list:
        """(step, training KL) of every step."""
        return self.loop.state.setdefault("kl_history", [])

    @property
    def teacher_accuracy(self) -> Optional[float]:
        return self.loop.state.get("teacher_accuracy")

    def teacher_groups(self) -> dict[str, Any]:
        """The teachers by key (`teacher`, `teachers.<task>`)."""
        return self.teachers or {"teacher": self.teacher}

    def workers(self) -> tuple[Any, ...]:
        return (self.generation, *self.teacher_groups().values(), self.policy)


# ------------------------------------------------------------------------------------- set-up
def check_vocabularies(cfg: DistillMasterConfig) -> Optional[int]:
    """The student's vocabulary size as it will be loaded (after warm starts, hub downloads); with
    `distillation.tokenizer_alignment=never`, raises `UserError` naming both keys and sizes when a
    teacher's differs, before any worker starts (otherwise such a teacher is aligned by text). Also
    refuses `distillation.topk_logits_k` above the smallest vocabulary."""
    from posttrain.models.hf import resolve_model_path
    from posttrain.models.paths import model_vocab_size, vocabulary_problem

    sizes = []
    models = [("policy", cfg.policy), *teacher_sections(cfg).items()]
    for key, policy in ((f"{key}.model_name", policy) for key, policy in models):
        path = resolve_model_path(policy.model_name, policy.tiny_arch)
        size = model_vocab_size(path)
        if size is None and not Path(path).exists():  # a hub id not cached yet: transformers fetches its config
            from transformers import AutoConfig

            size = int(AutoConfig.from_pretrained(path).vocab_size)
        sizes.append((key, policy.model_name, size))
    for teacher in sizes[1:] if cfg.distillation.tokenizer_alignment == "never" else []:
        problem = vocabulary_problem(sizes[0], teacher)
        if problem:
            raise UserError(problem)
    known = [size for _, _, size in sizes if size is not None]
    if known and cfg.distillation.topk_logits_k > min(known):
        raise UserError(f"distillation.topk_logits_k={cfg.distillation.topk_logits_k} exceeds the vocabulary size {min(known)}")
    return sizes[0][2]


def cross_tokenizer_keys(cfg: DistillMasterConfig) -> dict[str, Any]:
    """`{teacher key: its tokenizer}` of the teachers that read the student's answers as text
    (`distill_xtok.needs_alignment`: by `distillation.tokenizer_alignment` and their vocabularies);
    raises `UserError` in one line for a teacher that cannot be aligned with this config. Loads
    tokenizers only (no weights), before any worker starts."""
    from posttrain.algorithms.distill_xtok import alignment_problem, needs_alignment
    from posttrain.models.hf import load_tokenizer

    student = load_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name, cfg.policy.tiny_arch)
    cross = {}
    for key, section in teacher_sections(cfg).items():
        tokenizer = load_tokenizer(section.tokenizer_name or section.model_name, section.tiny_arch)
        if needs_alignment(cfg.distillation.tokenizer_alignment, key, student, tokenizer):
            problem = alignment_problem(cfg, key, tokenizer)
            if problem:
                raise UserError(problem)
            cross[key] = tokenizer
    return cross


def setup(cfg: DistillMasterConfig) -> DistillContext:
    """Start the distillation run (`on_policy.build_on_policy_run`) with the teacher beside the
    student and the top-k KL loss (with a teacher of another tokenizer, `CrossTokenizerDistillationLoss`)."""
    from posttrain.algorithms.distill_loss import DistillationLoss

    cross_tokenizers = cross_tokenizer_keys(cfg)
    assignment: dict[str, str] = {}

    def teachers_for(tasks: list[str]) -> dict[str, Any]:
        """The teachers the training tasks need (`teacher` only where a task has no `teachers.<task>`)."""
        assignment.update(assign_teachers(cfg, tasks))
        sections = teacher_sections(cfg)
        return {key: sections[key] for key in dict.fromkeys(assignment.values())}

    ctx = build_on_policy_run(
        cfg, section="distillation", name="distillation", context=DistillContext,
        teacher=teachers_for if cfg.teachers else cfg.teacher,
        make_loss=lambda c: DistillationLoss(**c.loss_fn.model_dump(include={"kl_type", "mixed_kl_weight",
                                                                             "zero_outside_topk"})),
    )
    ctx.teacher_of = assignment
    if cross_tokenizers:
        from posttrain.algorithms.distill_xtok import make_cross_teacher
        from posttrain.algorithms.distill_xtok_loss import CrossTokenizerDistillationLoss

        sections = teacher_sections(ctx.cfg)
        ctx.cross = {key: make_cross_teacher(ctx.cfg, sections[key], ctx.tokenizer, tokenizer)
                     for key, tokenizer in cross_tokenizers.items() if key in ctx.teacher_groups()}
        lf = ctx.cfg.loss_fn
        ctx.loss_fn = CrossTokenizerDistillationLoss(lf.kl_type, lf.mixed_kl_weight, lf.zero_outside_topk,
                                                     lf.xtok_span_weight, lf.xtok_match_weight)
    return ctx


# --------------------------------------------------------------------------------- the loop
def distill_train(ctx: DistillContext) -> dict[str, float]:
    """Distil from the context's step to its last step (`TrainingLoop` runs the schedule)."""
    return ctx.loop.run(lambda step, timer: distill_step(ctx, step, timer), lambda: validate_student(ctx),
                        recovery=ctx.recovery)


def distill_step(ctx: DistillContext, step: int, timer: Timer) -> dict[str, float]:
    """One step: student rollouts, the teacher's top-k logits, a student update on the KL."""
    cfg, d = ctx.cfg, ctx.cfg.distillation
    temperature = cfg.policy.generation.temperature  # student and teacher see the sampling distribution
    train_data, metrics, samples = _student_rollouts(ctx, step, timer)
    task_names = [s.task_name for s in samples]
    teacher_of = ctx.teacher_of or dict.fromkeys(task_names, "teacher")
    with timer.time("logprobs"):  # the teachers' forward passes (logprob-like passes), each on its tasks' rows
        if ctx.cross:  # a teacher of another tokenizer: its rows re-tokenised and aligned by text
            from posttrain.algorithms.distill_xtok import all_teachers_targets

            targets, counts = all_teachers_targets(train_data, samples, route_rows(task_names, teacher_of),
                                                   ctx.teacher_groups(), ctx.cross, ctx.tokenizer, d.topk_logits_k,
                                                   temperature)
            train_data.update(targets)
            metrics.update(prefixed(counts, "train"))
        else:
            top = teachers_topk(train_data, task_names, teacher_of, ctx.teacher_groups(), d.topk_logits_k, temperature)
            train_data["teacher_topk_logits"] = top["topk_logits"]
            train_data["teacher_topk_indices"] = top["topk_indices"]
    tasks = sorted(set(task_names))
    if len(teacher_of) > 1:  # several tasks: the loss also sums the KL per task
        train_data["task_index"] = teacher_task_index(task_names, tasks)
    with timer.time("policy_training"):
        train_metrics = ctx.policy.train(train_data, ctx.loss_fn, global_batch_size=cfg.policy.train_global_batch_size,
                                         temperature=temperature)
    ctx.generation_stale = True
    ctx.kl_history.append((step, train_metrics["loss"]))
    by_task = per_task_kl(train_metrics, tasks)
    train_metrics = {k: v for k, v in train_metrics.items() if not k.startswith(("kl_sum_task", "kl_tokens_task"))}
    return {**metrics, **prefixed({**train_metrics, **by_task}, "train")}


def _student_rollouts(ctx: DistillContext, step: int, timer: Timer) -> tuple[Batch, dict[str, float], list]:
    """The student answers the next prompts `num_generations_per_prompt` times; the environments
    score the answers (logged, not trained on). Returns the flattened training rows, the metrics
    and the rows' samples."""
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
    return train_data, metrics, samples


# ------------------------------------------------------------------------------- validation
def validate_student(ctx: DistillContext) -> dict[str, float]:
    """The student's validation accuracy (`on_policy.validate`); at step 0 also the teacher's
    (measured once), with a warning when it is below the student's."""
    metrics = validate(ctx)
    if metrics and ctx.step == 0 and ctx.teacher_accuracy is not None:
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
    started on the teacher's bundles for this once (then shut down). With several teachers, each
    answers its own tasks' validation prompts (one engine at a time); the accuracy is over all of
    them (validation prompts of a task no teacher trains are left out)."""
    if not ctx.val_samples:
        return None
    sections = teacher_sections(ctx.cfg)
    if not ctx.teachers:
        return _engine_accuracy(ctx, "teacher", sections["teacher"], None)[0]
    correct = total = 0
    for key in ctx.teachers:
        samples = [s for s in ctx.val_samples if ctx.teacher_of.get(s.task_name) == key]
        if samples:
            accuracy, n = _engine_accuracy(ctx, key, sections[key], samples)
            correct, total = correct + accuracy * n, total + n
    return correct / total if total else None


def _engine_accuracy(ctx: DistillContext, key: str, model: Any, samples: Optional[list]) -> tuple[float, int]:
    """(accuracy, number of prompts) of the teacher `key` (`model`, its section) on `samples` (default the
    validation split); a teacher of another tokenizer answers the same rows rendered by its tokenizer."""
    engine = make_generation(ctx.cfg, ctx.teacher_cluster, model=model, name="teacher_generation")
    samples = ctx.val_samples if samples is None else samples
    tokenizer = None
    if key in ctx.cross:
        xt = ctx.cross[key]
        samples, tokenizer = [xt.val_prompts[s.idx] for s in samples], xt.tokenizer
    try:
        metrics = evaluate_engine(ctx, engine, 0, show_samples=False, samples=samples, tokenizer=tokenizer)
        return metrics[find_accuracy(metrics)], len(samples)
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
    run_on_policy(ctx, train_with_teacher, lambda ctx: details(ctx, summarize(ctx)))
    return summarize(ctx)


def train_with_teacher(ctx: DistillContext) -> None:
    """Measure the teacher's accuracy once (unless a resumed run has it, or
    `distillation.val_at_start` is false), then distil."""
    if ctx.teacher_accuracy is None and ctx.cfg.distillation.val_at_start:
        ctx.loop.state["teacher_accuracy"] = measure_teacher_accuracy(ctx)
    distill_train(ctx)


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
    what = f"{ctx.cfg.loss_fn.kl_type} KL over the teacher's top-{ctx.cfg.distillation.topk_logits_k}"
    if ctx.cross:
        what = f"loss (span log-ratio + exact-match {ctx.cfg.loss_fn.kl_type} KL, teachers of another tokenizer)"
    return f"; {what} {kl} (mean of the first / last steps); teacher validation accuracy {teacher}"
