"""The on-policy runtime that GRPO, async GRPO and on-policy distillation share (issue 27).

Each of them trains a policy on samples its own generation workers draw, so the run around the
step is the same: warm starts, the run's start (`start_run`), the prompt loader (a `data.blend` is
sampled by its components' weights), the policy (and a reference model or a teacher), the
generation engine and the weight transfer to it, the environments, the training loop and its
resume, the lazy refit before a rollout or a validation, the validation itself, and the shutdown
that also releases the run-directory locks. All of that lives here; each algorithm keeps its step
and what only it needs (GRPO's loss and experience in `experience.py`, distillation's teacher
accuracy and KL summary in `distill.py`).

    ctx = build_on_policy_run(cfg, section="grpo", name="GRPO", make_loss=..., reference=...)
    if run_on_policy(ctx, train):   # train(ctx) runs the steps; False: resumed past the last step
        ...summary from ctx.loop...
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, TypeVar

from posttrain.algorithms.loop import TrainingLoop
from posttrain.algorithms.run_recovery import RunRecovery
from posttrain.data.dataloader import make_loader, routes
from posttrain.data.sample import Sample
from posttrain.config.schema import GRPOMasterConfig, generation_precision_note, length_penalty_note
from posttrain.errors import UserError
from posttrain.evals.eval import evaluate, validation_sampling
from posttrain.job import (
    build_splits,
    build_validation_sets,
    make_cluster,
    make_envs,
    make_generation,
    make_policy,
    start_concurrently,
    start_run,
    workers_description,
)
from posttrain.models.refit import build_refit_metadata, refit_policy_generation
from posttrain.run_config import (
    warm_start_export_dir,
    warm_start_job,
    warm_start_ready,
    warm_start_stamp,
    with_warm_starts,
)
from posttrain.utils import startup
from posttrain.utils.metric_names import in_validation_set
from posttrain.utils.phase_memory import as_one_phase, merge_peaks
from posttrain.utils.timer import Timer

log = logging.getLogger(__name__)


@dataclass
class OnPolicyContext:
    """Everything an on-policy loop needs, built once by `build_on_policy_run`.

    `section` is the algorithm's config section (`grpo`, `distillation`): its `seed`, sizes,
    `max_rollout_turns` and validation keys are read through `settings`."""

    cfg: Any
    policy: Any  # the trained policy (distillation's student)
    generation: Any  # its generation engine
    envs: dict[str, Any]
    tokenizer: Any
    train_loader: Any  # ResumableLoader, or BlendedLoader for a blend
    val_samples: list[Sample]
    loop: TrainingLoop  # resume, validation schedule, logging, checkpoints, report
    loss_fn: Any
    refit_metadata: Any
    section: str
    val_sets: dict[str, list[Sample]] = field(default_factory=dict)  # data.validation_sets, by name
    clusters: list[Any] = field(default_factory=list)
    generation_stale: bool = False  # generation weights lag the policy's (both start from model_name)
    partial_rollouts: Any = None  # GRPO with grpo.partial_rollouts: the carried-over groups (PartialRollouts)
    recovery: Any = None  # rebuilds dead workers for the loop (`run_recovery.RunRecovery`); None: the local backend
    critic: Any = None  # PPO's value model (a `Policy` of model_type "value"), trained beside the policy

    @property
    def settings(self) -> Any:
        """The algorithm's section of the config (`cfg.grpo`, `cfg.distillation`)."""
        return getattr(self.cfg, self.section)

    @property
    def step(self) -> int:
        """Completed training steps (the version of the policy's weights)."""
        return self.loop.step

    @property
    def last_step(self) -> int:
        """`<section>.max_num_steps`, or fewer when `<section>.max_num_epochs` passes over the
        prompts end first (epochs count prompt batches; with dynamic sampling a step may draw several)."""
        return self.loop.last_step

    def workers(self) -> tuple[Any, ...]:
        """The worker groups, in the order they shut down (before the clusters)."""
        return (self.generation, *self.trained())

    def trained(self) -> tuple[Any, ...]:
        """The groups that train: the policy, and PPO's critic. Each leaves the device while the
        engine generates (`start_generation_phase`) and reports its phases' memory."""
        return (self.policy,) if self.critic is None else (self.policy, self.critic)

    def shutdown(self) -> None:
        shutdown_run(self.cfg, self.loop, self.envs, (*self.workers(), *self.clusters))


Context = TypeVar("Context", bound=OnPolicyContext)


# ------------------------------------------------------------------------------------- set-up
def apply_warm_starts(cfg: Any) -> Any:
    """Run (or reuse from the cache) the run's SFT warm starts (`sft_warmup` for the policy,
    `teacher_warmup` for a teacher) and point the models at their exports; a teacher given as a
    training checkpoint (`step_N`) becomes its cached Hugging Face copy. A config without warm
    starts is returned as it is."""
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

    from posttrain.utils.cache import publish_entry

    warm_dir = warm_start_export_dir(warm)
    if warm_start_ready(warm):
        print(f"[posttrain] reusing SFT warm start {warm_dir}", flush=True)
    else:
        print(f"[posttrain] SFT warm start -> {warm_dir}", flush=True)
        with startup.CLOCK.nested():
            publish_entry(warm_dir, lambda tmp: sft.run(warm_start_job(warm, log_dir, checkpoint_dir), export_dir=tmp),
                          warm_start_stamp(warm_dir), describe="SFT warm start")
    startup.mark("warm_start")
    return warm_dir


def train_loader(train_samples, num_prompts_per_step: int, *, shuffle: bool, seed: int):
    """The prompt loader of an on-policy run: a blend (or several reasoning-gym tasks) is sampled
    by its components' weights (`make_loader`), a single source in (shuffled) order."""
    return make_loader(train_samples, num_prompts_per_step, shuffle=shuffle, seed=seed)


def build_on_policy_run(
    cfg: Any, *, section: str, name: str, make_loss: Callable[[Any], Any], reference: bool = False,
    teacher: Any = None, critic: Any = None, critic_colocated: bool = True, context: type[Context] = OnPolicyContext,
    env_problem: Optional[Callable[[Any, list[str]], Optional[str]]] = None, **extra: Any,
) -> Context:
    """Start an on-policy run of the config `cfg` (after its warm starts): the run's directories,
    seed and tokenizer, the prompts, the policy (with a reference model when `reference`), its
    generation engine and the weight transfer to it, the environments of every task, and the
    training loop, resumed from the latest checkpoint.

    `section` is the algorithm's config section and `name` how the run is called;
    `make_loss(cfg)` builds the loss from the started config. `teacher` (a `PolicyConfig`, default
    None) also starts a forward-only teacher policy on a cluster of its own whose bundles can host
    a second generation engine; it and its cluster reach `context` as `teacher` and
    `teacher_cluster`. A dict `{key: PolicyConfig}` starts several teachers on that cluster (the same
    `num_workers`); they reach `context` as `teachers` (`{key: Policy}`), the first also as `teacher`;
    a callable `teacher(training task names)` returns that dict. `critic(started cfg)` (default None), a value model's `PolicyConfig`, also
    starts that model (PPO's critic, `model_type="value"`), on the policy's bundles when
    `critic_colocated` (as the reference model shares the policy's workers) or on a cluster of its
    own; it reaches `context` as `critic`, and the loop checkpoints and resumes it under
    `step_N/critic`. `context` is the class built (a subclass of `OnPolicyContext` with the
    algorithm's own fields, which `extra` fills). `env_problem(cfg, env_names)`, when given, says
    why the training prompts' environments cannot run with this config (or None); it is asked
    before any worker starts and its answer raised as a `UserError`."""
    from posttrain.data.processors import build_prompt_message_log

    start = getattr(cfg, section)
    cfg, tokenizer = start_run(cfg, seed=start.seed, max_num_steps=start.max_num_steps)
    if isinstance(cfg, GRPOMasterConfig):
        for note in (generation_precision_note(cfg), length_penalty_note(cfg)):
            if note:
                print(note, flush=True)
    s = getattr(cfg, section)  # the started config's section (the loop reads its schedule)
    train_samples, val_samples = build_splits(cfg, build_prompt_message_log, tokenizer, s.max_val_samples)
    val_sets = build_validation_sets(cfg, build_prompt_message_log, tokenizer, s.max_val_samples)
    problem = env_problem(cfg, [env for _, env in routes(train_samples)]) if env_problem else None
    if problem:
        raise UserError(problem)
    if callable(teacher):  # the teachers the training tasks need (refused here, before any worker starts)
        teacher = teacher(sorted({sample.task_name for sample in train_samples}))
    loader = train_loader(train_samples, s.num_prompts_per_step, shuffle=cfg.data.shuffle, seed=s.seed)

    colocated = cfg.policy.generation.colocated.enabled
    critic_cfg = critic(cfg) if critic is not None else None
    critic_beside = critic_cfg is not None and critic_colocated  # one more group on the policy's bundles
    policy_cluster = make_cluster(cfg, cfg.policy.num_workers, colocated_groups=(2 if colocated else 1) + critic_beside)
    gen_cluster = policy_cluster if colocated else make_cluster(
        cfg, cfg.policy.generation.colocated.num_workers or 1, name="generation")
    make_the_policy = lambda: make_policy(cfg, policy_cluster, init_reference_model=reference)  # noqa: E731
    makers = [make_the_policy, lambda: make_generation(cfg, gen_cluster)]
    if colocated and cfg.cluster.gpus_per_node > 0:
        # Generation first, alone: vLLM sizes its KV cache from the GPU memory it finds free, as if
        # the GPU were its own; a policy loading beside it would be counted as free (or take it).
        generation_first = start_concurrently(makers[1], description=workers_description(cfg, generation=True,
                                                                                         policy=False))[0]
        makers[1] = lambda: generation_first
    clusters = [policy_cluster]
    teacher_cfgs = teacher if isinstance(teacher, dict) else {"teacher": teacher} if teacher is not None else {}
    if teacher_cfgs:
        # The teachers share one set of bundles (each a colocated group, as the reference model shares
        # the policy's), which also hosts, once, the generation engine that measures a teacher's accuracy.
        first = next(iter(teacher_cfgs.values()))
        teacher_cluster = make_cluster(cfg, first.num_workers, colocated_groups=len(teacher_cfgs) + 1, name="teacher")
        for key, teacher_cfg in teacher_cfgs.items():
            makers.append(lambda t=teacher_cfg, key=key: make_policy(
                cfg, teacher_cluster, t, init_optimizer=False, name=key.replace(".", "_")))
        clusters.append(teacher_cluster)
    if critic_cfg is not None:
        critic_cluster = policy_cluster if critic_beside else make_cluster(cfg, critic_cfg.num_workers, name="critic")
        makers.append(lambda: make_policy(cfg, critic_cluster, critic_cfg, model_type="value", name="critic"))
        clusters += [] if critic_beside else [critic_cluster]
    workers = start_concurrently(
        *makers, description=workers_description(cfg, reference=reference, generation=True, teacher=teacher),
    )
    policy, generation = workers[:2]
    if teacher_cfgs:
        started = dict(zip(teacher_cfgs, workers[2:2 + len(teacher_cfgs)]))
        extra.update(teacher=next(iter(started.values())), teacher_cluster=teacher_cluster)
        if isinstance(teacher, dict):
            extra.update(teachers=started)
    if critic_cfg is not None:
        extra.update(critic=workers[-1])
    with startup.doing("preparing the weight transfer to generation"):
        refit_metadata = build_refit_metadata(
            policy.refit_info(), policy.refit_bucket_bytes(), dtypes=generation.weight_dtypes()
        )
        generation.prepare_refit_info(refit_metadata)

    envs = make_envs(cfg, routes(train_samples) + routes(val_samples) + [r for v in val_sets.values() for r in routes(v)])

    loop = TrainingLoop(cfg, s, name=name, section=section, policy=policy, loader=loader)
    ctx = context(
        cfg=cfg, policy=policy, generation=generation, envs=envs, tokenizer=tokenizer, train_loader=loader,
        val_samples=val_samples, loop=loop, loss_fn=make_loss(cfg), refit_metadata=refit_metadata,
        section=section, val_sets=val_sets, clusters=clusters + ([] if colocated else [gen_cluster]), **extra,
    )
    if critic_cfg is not None:
        loop.trained_beside["critic"] = ctx.critic
    ctx.generation_stale = loop.resume()  # resumed weights are newer than the generation's
    ctx.recovery = RunRecovery.for_run(ctx)
    return ctx


# --------------------------------------------------------------------------------------- refit
def refit_if_stale(ctx: OnPolicyContext, timer: Optional[Timer] = None) -> None:
    """Copy policy weights into the generation workers, lazily (only when they are stale)."""
    if not ctx.generation_stale:
        if timer is not None:
            timer.add("refit", 0.0)  # always reported, so step-time breakdowns line up
        return
    t0 = time.perf_counter()
    refit_generation(ctx, ctx.step)
    if timer is not None:
        timer.add("refit", time.perf_counter() - t0)


def start_generation_phase(ctx: OnPolicyContext, timer: Optional[Timer] = None) -> None:
    """Before a rollout: the lazy refit, then, with `policy.offload_during_generation`, the
    policy's (and critic's) training state leaves the device for the engine (each brings it back
    itself before its next forward, training, checkpoint or refit)."""
    refit_if_stale(ctx, timer)
    for group in ctx.trained():
        group.offload_to_host()


def phase_memory_metrics(ctx: OnPolicyContext) -> dict[str, float]:
    """`memory/<phase>/...` of the policy's (and critic's) and the engine's workers since the last
    call, the highest over workers (`utils/phase_memory.py`)."""
    take = getattr(ctx.generation, "take_phase_memory", dict)  # an engine of the user's may measure nothing
    return merge_peaks([*(group.take_phase_memory() for group in ctx.trained()), take()])


def refit_generation(ctx: OnPolicyContext, version: int) -> None:
    """Copy the policy's weights (policy step `version`) into the generation workers, verified
    when `policy.generation.verify_refit` asks."""
    refit_policy_generation(ctx.policy, ctx.generation, ctx.refit_metadata, version=version,
                            verify=ctx.cfg.policy.generation.verify_refit_enabled)
    ctx.generation_stale = False


# ---------------------------------------------------------------------------------- validation
def validate(ctx: OnPolicyContext, k: int = 1) -> dict[str, float]:
    """Accuracy (and pass@k for `k` > 1 samples per prompt) on the held-out prompts, with the
    current weights, and the same as `validation_<name>/...` on each of `data.validation_sets`;
    empty without validation data (the run said so at set-up)."""
    if not ctx.val_samples and not ctx.val_sets:
        return {}
    start_generation_phase(ctx)
    metrics = evaluate_engine(ctx, ctx.generation, ctx.step, k=k) if ctx.val_samples else {}
    for name, samples in ctx.val_sets.items():
        metrics.update(in_validation_set(
            evaluate_engine(ctx, ctx.generation, ctx.step, k=k, show_samples=False, samples=samples), name))
    # Validation's phases are not the next step's: taken here and logged as one peak of their own
    # (its batch is `val_batch_size` prompts, not a step's; the memory plan's validation phase).
    metrics.update(as_one_phase(phase_memory_metrics(ctx), "validation"))
    return metrics


def evaluate_engine(ctx: OnPolicyContext, generation: Any, weight_version: int, *, k: int = 1,
                    show_samples: bool = True, samples: Optional[list[Sample]] = None,
                    tokenizer: Any = None) -> dict[str, float]:
    """The validation protocol on the engine `generation` (`weight_version` tags its samples) with
    the section's sizes, on `samples` (default the validation split); `show_samples` logs a few
    completions (`logger.num_val_samples_to_print`). `tokenizer` (default the run's) decodes the
    engine's tokens: a distillation teacher of another tokenizer's."""
    cfg, s = ctx.cfg, ctx.settings
    greedy, temperature = validation_sampling(cfg.policy.generation, k)
    return evaluate(
        generation, ctx.val_samples if samples is None else samples, tokenizer or ctx.tokenizer, ctx.envs, k=k,
        greedy=greedy,
        temperature=temperature, batch_size=s.val_batch_size, max_seq_len=cfg.policy.max_total_sequence_length,
        max_rollout_turns=s.max_rollout_turns, seed=s.seed + 7919, weight_version=weight_version,
        num_samples_to_print=cfg.logger.num_val_samples_to_print if show_samples else 0,
        log_samples=ctx.loop.log_samples,
    )


# ------------------------------------------------------------------------------- run and end
def run_on_policy(ctx: OnPolicyContext, train: Callable[[Any], Any],
                  details: Optional[Callable[[Any], str]] = None) -> bool:
    """Train `ctx` to its last step (`train(ctx)` runs the steps), print the summary line (with
    `details(ctx)`, the algorithm's own results) and shut the run down, whatever happens. False
    when the run was resumed at or past its last step: it says so rather than reprint old results."""
    try:
        done = ctx.loop.done_message()
        if done:
            print(done, flush=True)
            return False
        train(ctx)
        ctx.loop.finish(details(ctx) if details else "")
    finally:
        ctx.shutdown()
    return True


def shutdown_run(cfg: Any, loop: Any, envs: dict[str, Any], parts: Iterable[Any]) -> None:
    """End a run: shut down the environments and `parts` (generation engines, policies, clusters,
    in that order), close the loop's logger and release the run-directory locks `start_run` took,
    so a later run in the same directories can start. A part that fails to shut down is logged,
    not raised: shutting down must not mask the error that ended the run."""
    from posttrain.environments.registry import EnvRouter
    from posttrain.utils.run_dirs import release_run_dirs

    routers = (EnvRouter(envs),) if envs else ()  # a run may have no environment to stop
    for part in (*routers, *parts):
        try:
            part.shutdown()
        except Exception as e:
            log.warning("shutdown failed: %s", e)
    loop.close()
    release_run_dirs(cfg)
