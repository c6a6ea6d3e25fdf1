"""The top-level config of each command (`posttrain grpo`, `sft`, `dpo`, `rm`, `eval`, `distill`)
and the checks that span several sections."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from posttrain.config.schema.algorithms import (
    DPOConfig, DistillationConfig, DistillationLossConfig, EvalConfig,
    GRPOConfig, RMConfig, RewardShapingConfig, SFTConfig,
)
from posttrain.config.schema.base import Section
from posttrain.config.schema.cluster import ClusterConfig
from posttrain.config.schema.critic import CriticConfig
from posttrain.config.schema.data import DataConfig, EnvConfig
from posttrain.config.schema.loss import LossConfig, loss_option_problem
from posttrain.config.schema.outputs import CheckpointingConfig, LoggerConfig
from posttrain.config.schema.policy import PolicyConfig
from posttrain.cpu_precision import auto_cpu_precision


# Jobs run inside a job (warm starts, a teacher's warm start), each a whole config of its own.
NESTED_JOBS = ("sft_warmup", "teacher_warmup")
# The sections whose `seed` drives a job's random choices (prompt order, sampling, data order).
SEEDED_SECTIONS = ("grpo", "sft", "dpo", "rm", "eval", "distillation")


class MasterConfig(Section):
    seed: Optional[int] = Field(
        None,
        description=(
            "One seed for every random choice of the run: when set, it replaces the seed of this job's algorithm "
            "section (grpo.seed, sft.seed, dpo.seed, rm.seed, eval.seed, distillation.seed) and of its nested jobs "
            "(sft_warmup, teacher_warmup): prompt and data order, sampling, the warm start's order. The problems "
            "(data.seed, validation included) and the model's initial weights stay, so runs with different seeds "
            "are scored on the same validation set (benchmarks/seeds.py). None (default): each section's own seed."
        ),
    )
    policy: PolicyConfig = PolicyConfig()
    data: DataConfig = DataConfig()
    logger: LoggerConfig = LoggerConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _run_seed_reaches_every_section(self):
        if self.seed is None:
            return self
        for name in SEEDED_SECTIONS:
            section = getattr(self, name, None)
            if section is not None and section.seed != self.seed:
                section.seed = self.seed
        for key in NESTED_JOBS:
            nested = getattr(self, key, None)
            if nested is not None and nested.seed != self.seed:
                nested.seed = self.seed  # validated on assignment: reaches the nested job's own sections
        return self

    @model_validator(mode="after")
    def _cluster_reaches_nested_jobs(self):
        """The top level's `cluster.*` keys apply to every nested job (`sft_warmup`, `teacher_warmup`)
        under the keys that job's own `cluster` section sets: `cluster.cpus_per_worker=1` on the
        command line must also reach the warm start that runs first."""
        for key in NESTED_JOBS:
            nested = getattr(self, key, None)
            if nested is None:
                continue
            inherited = self.cluster.model_fields_set - nested.cluster.model_fields_set
            if inherited:
                nested.cluster = nested.cluster.model_copy(
                    update={name: getattr(self.cluster, name) for name in inherited})
        return self

    @model_validator(mode="after")
    def _check_backend(self):
        if self.cluster.backend == "local":
            problem = local_backend_problem(self)
            if problem:
                raise ValueError(f"cluster.backend=local: {problem}; use cluster.backend=ray (or auto)")
        return self

    @model_validator(mode="after")
    def _check_generation_placement(self):
        gen, gpus = self.policy.generation, self.cluster.gpus_per_node
        tp = gen.vllm_cfg.tensor_parallel_size
        if gen.backend == "vllm" and tp > 1:
            if gpus == 0:
                raise ValueError(
                    f"policy.generation.vllm_cfg.tensor_parallel_size={tp} needs GPUs: set cluster.gpus_per_node "
                    "(on CPU each vLLM engine has one worker)"
                )
            engines_of = gen.colocated.num_workers or 1 if not gen.colocated.enabled else self.policy.num_workers
            if gpus % tp or engines_of % tp:
                raise ValueError(
                    f"policy.generation.vllm_cfg.tensor_parallel_size={tp} must divide cluster.gpus_per_node={gpus} "
                    f"and the generation workers ({engines_of})"
                )
        return self

    @model_validator(mode="after")
    def _check_generation_precision(self):
        problem = generation_precision_problem(self)
        if problem:
            raise ValueError(problem)
        return self


def training_precision(cfg: MasterConfig) -> str:
    """`policy.precision` as the trainer resolves it (`models/hf.py` `pick_dtype`): `auto` is
    bfloat16 on GPUs (every GPU posttrain targets supports it) and on CPUs with bfloat16 matmul
    instructions, float32 on other CPUs (`cpu_precision.py`)."""
    precision = cfg.policy.precision
    if precision != "auto":
        return precision
    return "bfloat16" if cfg.cluster.gpus_per_node > 0 else auto_cpu_precision()[0]


def generation_precision(cfg: MasterConfig) -> str:
    """`policy.generation.precision` resolved: `auto` is the training precision."""
    precision = cfg.policy.generation.precision
    return training_precision(cfg) if precision == "auto" else precision


def generation_precision_problem(cfg: MasterConfig) -> Optional[str]:
    """Why `policy.generation.precision` cannot run with this config, or None (one line)."""
    gen, gpus = cfg.policy.generation, cfg.cluster.gpus_per_node
    key = f"policy.generation.precision={gen.precision}"
    if gen.precision == "fp8" and gpus == 0:
        return (f"{key} needs GPUs with FP8 matmuls (compute capability >= 9.0) and this run has none "
                "(cluster.gpus_per_node=0); on CPU use int8 (native engine), bfloat16 or float32")
    if gen.precision == "int8" and gen.backend == "vllm":
        return (f"{key} is the native engine's (torch's W8A16 CPU kernel); vLLM takes int8 only from a "
                "pre-quantized checkpoint: use fp8 (GPUs), bfloat16 or float32 with policy.generation.backend=vllm")
    if gen.precision == "int8" and gpus > 0:
        return (f"{key} is the native engine's CPU path (torch's W8A16 kernel); with cluster.gpus_per_node={gpus} "
                "use fp8 or bfloat16")
    return None


def generation_precision_note(cfg: "GRPOMasterConfig") -> Optional[str]:
    """The start-up line for a generation precision other than the trainer's: whether the
    importance-sampling correction weighs out the gap. None when the precisions agree."""
    train, gen = training_precision(cfg), generation_precision(cfg)
    if gen == train:
        return None
    what = f"policy.generation.precision={gen} differs from the training precision {train}"
    if cfg.loss_fn.use_importance_sampling_correction:
        return (f"[posttrain] {what}: loss_fn.use_importance_sampling_correction is on (the default then), weighting "
                "each token by pi_train / pi_generation; train/gen_kl_error shows the gap")
    return (f"[posttrain] warning: {what} but loss_fn.use_importance_sampling_correction=false: the loss trains on "
            "the generator's tokens as if they were the trainer's; train/gen_kl_error shows the gap")


def length_penalty_note(cfg: "GRPOMasterConfig") -> Optional[str]:
    """The start-up line for Kimi's length penalty under GRPO's division by the group std. In a
    group whose answers are all wrong (or all right) the penalty is the only reward difference, and
    the division makes it as large an advantage as a right answer's, whatever its weight: on the
    embedded default (where only wrong answers are shorter) 3 of 5 seeds learnt to answer with the
    end token alone; without the division (Dr.GRPO's advantages) none did. None otherwise."""
    if not (cfg.reward_shaping.length_penalty.enabled and cfg.grpo.normalize_rewards
            and cfg.grpo.adv_estimator.name == "grpo"):
        return None
    return ("[posttrain] warning: reward_shaping.length_penalty with grpo.normalize_rewards=true: in a group whose "
            "answers are all wrong or all right the penalty is the only reward difference, and the std division "
            "makes it a full-sized advantage whatever its weight (docs/algorithms.md); "
            "grpo.normalize_rewards=false keeps it in proportion")


def resolve_importance_sampling_correction(cfg: "GRPOMasterConfig") -> None:
    """`loss_fn.use_importance_sampling_correction` defaults to true when generation runs in
    another precision than training (the low-precision engine's logprobs are not the trainer's:
    Yao et al. 2025, 'Your efficient RL framework secretly brings you off-policy RL training');
    a value the config sets is kept (`generation_precision_note` warns when it is false)."""
    loss = cfg.loss_fn
    if "use_importance_sampling_correction" in loss.model_fields_set:
        return
    if generation_precision(cfg) != training_precision(cfg):
        loss.use_importance_sampling_correction = True


class GRPOMasterConfig(MasterConfig):
    """`posttrain grpo`: GRPO and its variants (DAPO, GSPO, Dr.GRPO) on verifiable environments."""

    grpo: GRPOConfig = GRPOConfig()
    loss_fn: LossConfig = LossConfig()
    reward_shaping: RewardShapingConfig = RewardShapingConfig()
    env: EnvConfig = EnvConfig()
    sft_warmup: Optional["SFTMasterConfig"] = Field(
        None,
        description=(
            "Optional SFT warm start run before GRPO (the embedded default uses it); cached by its config, "
            "it logs under <logger.log_dir>/sft_warmup and checkpoints under <checkpointing.checkpoint_dir>/sft_warmup "
            "(its own logger.log_dir and checkpointing.checkpoint_dir are not used), so an interrupted warm start resumes."
        ),
    )

    @model_validator(mode="after")
    def _check(self):
        resolve_importance_sampling_correction(self)  # first: the checks below read it
        problem = loss_option_problem(self.loss_fn)  # again, now that the correction is decided
        if problem:
            raise ValueError(problem)
        warm = self.sft_warmup
        if warm is not None and self.policy.model_name != warm.policy.model_name:
            # The warm start trains sft_warmup.policy.model_name and GRPO continues from its
            # export, so policy.model_name would be silently ignored.
            raise ValueError(
                f"policy.model_name={self.policy.model_name!r} would be replaced by the SFT warm start of "
                f"sft_warmup.policy.model_name={warm.policy.model_name!r}: set sft_warmup=null to train "
                f"{self.policy.model_name!r} directly, or sft_warmup.policy.model_name to warm-start it"
            )
        gen = self.policy.generation
        if gen.top_p < 1.0 or gen.top_k is not None:
            # The engine reports logprobs of the filtered distribution; the trainer computes them
            # over the full vocabulary, so ratios, importance weights and the mismatch metrics
            # would compare two different distributions.
            raise ValueError(
                f"policy.generation.top_p={gen.top_p} / policy.generation.top_k={gen.top_k}: GRPO trains "
                "on the full distribution (top_p=1.0, top_k=null); filtered sampling is for posttrain eval"
            )
        if self.grpo.async_grpo.enabled:
            problem = async_grpo_problem(self)
            if problem:
                raise ValueError(problem)
        if self.grpo.partial_rollouts.enabled:
            problem = partial_rollouts_problem(self)
            if problem:
                raise ValueError(problem)
        # Each GRPO step trains on prompts x generations rows in optimizer steps of
        # policy.train_global_batch_size rows (NeMo-RL's meaning of the key).
        rows = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        gbs = self.policy.train_global_batch_size
        if rows % gbs:
            raise ValueError(
                f"policy.train_global_batch_size={gbs} must divide the rows of one GRPO step, "
                f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {rows} "
                f"(set it to {rows} for one optimizer step per GRPO step)"
            )
        return self


class PPOMasterConfig(GRPOMasterConfig):
    """`posttrain ppo`: PPO with a critic (GAE advantages from a value model) on GRPO's runtime and
    sections; `grpo.adv_estimator.name` defaults to `gae` here. `grpo.async_grpo` makes it async
    PPO (async GRPO's collector and staleness bound; `algorithms/ppo.py`)."""

    critic: CriticConfig = CriticConfig()

    @model_validator(mode="after")
    def _check_ppo(self):
        if "name" not in self.grpo.adv_estimator.model_fields_set:
            self.grpo.adv_estimator.name = "gae"  # PPO's estimator unless the config names another
        if self.grpo.partial_rollouts.enabled:
            raise ValueError("grpo.partial_rollouts.enabled=true: posttrain ppo does not carry unfinished rollouts "
                             "over; set it to false (grpo.async_grpo.enabled=true hides generation's long tail instead)")
        if self.critic.kl_in_reward and self.loss_fn.reference_policy_kl_penalty <= 0:
            raise ValueError("critic.kl_in_reward=true needs the KL's weight: set loss_fn.reference_policy_kl_penalty > 0")
        if self.critic.colocated and self.critic.num_workers not in (None, self.policy.num_workers):
            raise ValueError(f"critic.num_workers={self.critic.num_workers}: a colocated critic has the policy's "
                             f"{self.policy.num_workers} workers; set critic.colocated=false for workers of its own")
        return self


def local_backend_problem(cfg: MasterConfig) -> Optional[str]:
    """Why this job cannot run in one process (`cluster.backend: local`), or None."""
    c, policy = cfg.cluster, cfg.policy
    gen = policy.generation
    async_grpo = getattr(getattr(cfg, "grpo", None), "async_grpo", None)
    teachers = teacher_sections(cfg)
    critic = getattr(cfg, "critic", None)
    checks = [
        (c.ray_address is not None, f"cluster.ray_address={c.ray_address!r} joins a Ray cluster"),
        (c.num_nodes > 1, f"cluster.num_nodes={c.num_nodes}: one process runs on one node"),
        (c.gpus_per_node > 1, f"cluster.gpus_per_node={c.gpus_per_node}: one process drives one GPU"),
        (c.autoscaling, "cluster.autoscaling=true needs a Ray cluster"),
        (bool(c.bundle_resources), "cluster.bundle_resources places workers by Ray custom resources"),
        (policy.num_workers > 1, f"policy.num_workers={policy.num_workers}: a local worker group has one worker"),
        (not gen.colocated.enabled and (gen.colocated.num_workers or 1) > 1,
         f"policy.generation.colocated.num_workers={gen.colocated.num_workers}: a local worker group has one worker"),
        (gen.backend == "vllm", "policy.generation.backend='vllm' runs in its own Python environment"),
        # Generation and training would share (and fight over) this process's one pool of math threads.
        (async_grpo is not None and async_grpo.enabled, "grpo.async_grpo.enabled overlaps generation and training"),
        *((section.num_workers > 1, f"{key}.num_workers={section.num_workers}: a local worker group has one worker")
          for key, section in teachers.items()),
        (critic is not None and (critic.num_workers or 1) > 1,
         f"critic.num_workers={getattr(critic, 'num_workers', 1)}: a local worker group has one worker"),
    ]
    return next((problem for failed, problem in checks if failed), None)


def teacher_sections(cfg: MasterConfig) -> dict[str, PolicyConfig]:
    """A distillation's teacher sections by key (`teacher`, `teachers.<task>`); {} for other jobs."""
    teacher, teachers = getattr(cfg, "teacher", None), getattr(cfg, "teachers", {})
    return {**({"teacher": teacher} if teacher is not None else {}),
            **{f"teachers.{task}": section for task, section in teachers.items()}}


def resolve_backend(cfg: MasterConfig) -> Literal["ray", "local"]:
    """The backend `cluster.backend` means for this job: `auto` is local when the job fits one
    process (`local_backend_problem` is None) and has no GPU (GPU jobs go to Ray unless asked)."""
    backend = cfg.cluster.backend
    if backend == "auto":
        fits = local_backend_problem(cfg) is None and cfg.cluster.gpus_per_node == 0
        return "local" if fits else "ray"
    return backend


def async_grpo_problem(cfg: "GRPOMasterConfig") -> Optional[str]:
    """Why `grpo.async_grpo.enabled` cannot run with this config, or None."""
    if cfg.policy.generation.colocated.enabled:
        # Colocated, generation and training take turns on the same workers: nothing to overlap.
        return ("grpo.async_grpo.enabled needs generation on workers of its own: set "
                "policy.generation.colocated.enabled=false (and policy.generation.colocated.num_workers)")
    if not cfg.loss_fn.use_importance_sampling_correction:
        # Groups come from weights up to max_trajectory_age_steps old: without the correction the
        # gradient is that of the old policy (NeMo-RL asserts the same).
        return ("grpo.async_grpo.enabled trains on trajectories from older weights: set "
                "loss_fn.use_importance_sampling_correction=true (optionally with "
                "loss_fn.truncated_importance_sampling_type tis / icepop / seq-mask-tis)")
    if cfg.loss_fn.force_on_policy_ratio:
        return "grpo.async_grpo.enabled: loss_fn.force_on_policy_ratio=true would ignore the trajectories' staleness"
    return None


def partial_rollouts_problem(cfg: "GRPOMasterConfig") -> Optional[str]:
    """Why `grpo.partial_rollouts.enabled` cannot be exact with this config, or None."""
    key = "grpo.partial_rollouts.enabled"
    g, loss = cfg.grpo, cfg.loss_fn
    if g.async_grpo.enabled:
        return f"{key} and grpo.async_grpo.enabled are exclusive: use one way of hiding the long tail of generation"
    if g.use_dynamic_sampling:
        return (f"{key} with grpo.use_dynamic_sampling=true: dynamic sampling regenerates prompts within a step, "
                "which partial rollouts cut short; set one of them to false")
    if not loss.use_importance_sampling_correction:
        # Carried-over tokens come from older weights: without the correction the gradient is
        # that of the generating policies, not the current one.
        return (f"{key} trains on tokens generated by older weights: set "
                "loss_fn.use_importance_sampling_correction=true")
    if loss.force_on_policy_ratio:
        return f"{key}: loss_fn.force_on_policy_ratio=true would ignore the carried-over tokens' older weights"
    if cfg.policy.generation.backend != "native":
        return (f"{key} needs policy.generation.backend=native (got {cfg.policy.generation.backend!r}): "
                "continuing a sequence exactly needs the native engine's counter-based sampling (start_steps)")
    return None


class SFTMasterConfig(MasterConfig):
    """`posttrain sft`: supervised fine-tuning on prompt / answer data."""

    sft: SFTConfig = SFTConfig()


def pair_batching_problems(policy: PolicyConfig) -> list[str]:
    """Why the policy's batching would split or reorder the rows of chosen/rejected pairs.

    Preference losses see one micro-batch at a time and pair its rows `(0,1), (2,3), ...`, so
    every micro-batch (and every worker's share of a step) must hold whole pairs in order: even
    `train_global_batch_size / dp_size` and `train_micro_batch_size`, and neither sequence
    packing nor dynamic batching (both regroup rows by length).
    """
    p, problems = policy, []
    if p.sequence_packing.enabled:
        problems.append("policy.sequence_packing.enabled must be false (packing regroups the rows of a pair)")
    if p.dynamic_batching.enabled:
        problems.append("policy.dynamic_batching.enabled must be false (it regroups the rows of a pair)")
    if p.train_global_batch_size % (2 * p.dp_size):
        problems.append(
            f"policy.train_global_batch_size={p.train_global_batch_size} must be a multiple of 2 x the data-parallel "
            f"ranks (policy.num_workers / policy.tensor_parallel_size) = {2 * p.dp_size} (rows per step; each "
            "data-parallel rank takes whole chosen/rejected pairs)"
        )
    if p.train_micro_batch_size % 2:
        problems.append(f"policy.train_micro_batch_size={p.train_micro_batch_size} must be even (whole pairs)")
    return problems


class _PairTraining(MasterConfig):
    @model_validator(mode="after")
    def _check_pairs(self):
        problems = pair_batching_problems(self.policy)
        if problems:
            raise ValueError("preference training: " + "; ".join(problems))
        return self


class DPOMasterConfig(_PairTraining):
    """`posttrain dpo`: Direct Preference Optimization on preference pairs."""

    dpo: DPOConfig = DPOConfig()


class RMMasterConfig(_PairTraining):
    """`posttrain rm`: a Bradley-Terry reward model on preference pairs."""

    rm: RMConfig = RMConfig()

    @model_validator(mode="after")
    def _check_lora(self):
        if self.policy.lora.enabled:
            raise ValueError("policy.lora.enabled: LoRA is supported for language models, not reward models (yet)")
        return self


class EvalMasterConfig(MasterConfig):
    """`posttrain eval`: accuracy, pass@k and cons@k of a model or checkpoint on a prompt set."""

    eval: EvalConfig = EvalConfig()
    env: EnvConfig = EnvConfig()


def warm_start_problem(model_key: str, model_name: str, warm_key: str, warm: Optional["SFTMasterConfig"]) -> Optional[str]:
    """Why `model_name` would be silently replaced by the export of the SFT warm start `warm`, or None."""
    if warm is None or model_name == warm.policy.model_name:
        return None
    return (
        f"{model_key}={model_name!r} would be replaced by the SFT warm start of {warm_key}.policy.model_name="
        f"{warm.policy.model_name!r}: set {warm_key}=null to use {model_name!r} directly, or "
        f"{warm_key}.policy.model_name to warm-start it"
    )


def teacher_problem(teacher: Optional[PolicyConfig], teachers: dict[str, PolicyConfig],
                    warm: Optional["SFTMasterConfig"]) -> Optional[str]:
    """Why a distillation's teachers (`teacher`, `teachers`, `teacher_warmup`) cannot run, or None."""
    if teacher is None:
        if not teachers:
            return "teacher=null leaves no teacher: set teacher, or teachers: {<task>: {model_name: ...}}"
        if warm is not None:
            return "teacher_warmup warm-starts teacher, which is null: set teacher_warmup=null"
    else:
        problem = warm_start_problem("teacher.model_name", teacher.model_name, "teacher_warmup", warm)
        if problem:
            return problem
    sections = ([("teacher", teacher)] if teacher is not None else []) + [(f"teachers.{t}", c) for t, c in teachers.items()]
    (key0, first), *others = sections
    for key, section in others:  # one cluster of bundles hosts them all
        if section.num_workers != first.num_workers:
            return (f"{key}.num_workers={section.num_workers} differs from {key0}.num_workers={first.num_workers}: "
                    "the teachers share one set of bundles; give them the same num_workers")
    return None


class DistillMasterConfig(MasterConfig):
    """`posttrain distill`: the student (`policy`) generates, the teacher scores its tokens, the
    student learns the teacher's top-k distribution."""

    distillation: DistillationConfig = DistillationConfig()
    loss_fn: DistillationLossConfig = DistillationLossConfig()
    teacher: Optional[PolicyConfig] = Field(
        PolicyConfig(model_name="small"),
        description="The teacher model (forward only, its own workers: teacher.num_workers); it must share the "
        "student's vocabulary. Its optimizer keys are unused. With `teachers`, it teaches the tasks `teachers` "
        "does not name; null when `teachers` names every task.",
    )
    teachers: dict[str, PolicyConfig] = Field(
        {},
        description="A teacher per task of the blend (multi-teacher distillation, as NeMo-RL's): "
        "{<task name>: <a teacher section>}; each training row is scored by its task's teacher, or by `teacher` "
        "when the task has none. Each must share the student's vocabulary; all share the teacher's bundles and "
        "have the same num_workers. Default {}: `teacher` teaches every task.",
    )
    env: EnvConfig = EnvConfig()
    sft_warmup: Optional["SFTMasterConfig"] = Field(
        None, description="Optional SFT warm start of the student (cached and checkpointed like GRPO's; logs under "
        "<logger.log_dir>/sft_warmup).",
    )
    teacher_warmup: Optional["SFTMasterConfig"] = Field(
        None,
        description="Optional SFT warm start of the teacher, cached by its config (logs under "
        "<logger.log_dir>/teacher_warmup, checkpoints under <checkpointing.checkpoint_dir>/teacher_warmup); the "
        "embedded default trains a larger tiny model this way.",
    )

    @model_validator(mode="after")
    def _check(self):
        for problem in (
            warm_start_problem("policy.model_name", self.policy.model_name, "sft_warmup", self.sft_warmup),
            teacher_problem(self.teacher, self.teachers, self.teacher_warmup),
        ):
            if problem:
                raise ValueError(problem)
        d = self.distillation
        rows, gbs = d.num_prompts_per_step * d.num_generations_per_prompt, self.policy.train_global_batch_size
        if rows % gbs:
            raise ValueError(
                f"policy.train_global_batch_size={gbs} must divide the rows of one distillation step, "
                f"distillation.num_prompts_per_step x distillation.num_generations_per_prompt = {rows} "
                f"(set it to {rows} for one optimizer step per distillation step)"
            )
        return self


GRPOMasterConfig.model_rebuild()
PPOMasterConfig.model_rebuild()
DistillMasterConfig.model_rebuild()

SCHEMAS: dict[str, type[MasterConfig]] = {
    "grpo": GRPOMasterConfig,
    "ppo": PPOMasterConfig,
    "sft": SFTMasterConfig,
    "dpo": DPOMasterConfig,
    "rm": RMMasterConfig,
    "eval": EvalMasterConfig,
    "distill": DistillMasterConfig,
}
