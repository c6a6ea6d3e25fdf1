"""What each device holds in each phase of one job (`memory_plan`), and the jobs a run is made of
(`run_plan`: the job and the SFT warm starts that run before it, each its own job).

Phases, as the jobs run them:

- on-policy RL (GRPO, distillation), a colocated step as NeMo-RL's (reference notes "Refit" and
  "Inside policy.train"): generation (the engine decodes; colocated on GPUs the policy's weights and
  optimizer state are in host memory then, `policy.offload_during_generation`; weights lent in
  place to the engine stay), refit (the policy's weights go to the engine in
  `policy.refit_buffer_size_gb` buckets, one at a time), logprobs (forward passes without
  gradients), training (forward and backward, then the optimizer step), and validation: the
  engine decodes the held-out prompts greedily, `<section>.val_batch_size` prompts per call, as
  the generation phase holds the state; distillation's logprobs phase is its teachers' top-k
  forwards (the student computes no logprobs), and before the first step, with
  `distillation.val_at_start`, "teacher eval": an engine on the teachers' bundles measures each
  teacher's accuracy (`distill.measure_teacher_accuracy`, once);
- SFT, DPO, reward models: training, DPO's reference logprobs, and validation (forward passes
  without gradients over `val_batch_size` examples, in the logprob micro-batches);
- `posttrain eval`: evaluation, one generation worker decoding `eval.batch_size` prompts per call.

A native engine decodes a call's rows in pieces of `policy.generation.batch_size`
(`GenerationWorker.generate`): its KV cache is that of the piece (`engine_rows`), at most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from posttrain.plan.formulas import (
    CPU_RUNTIME_BYTES, GiB, compute_dtype_bytes, kv_cache_bytes, logprob_activation_bytes, longest_row_tokens,
    micro_batch_tokens, optimizer_state_bytes, per_rank_params, ring_attention_block_bytes, rollout_turns,
    training_activation_bytes, activation_bytes_per_token_layer,
)
from posttrain.plan.shape import ModelShape

# Every phase a job may have, in the order the tables print them (a job has some: `job_phases`).
PHASES = ("generation", "refit", "logprobs", "training", "validation", "teacher eval", "evaluation")
# The sections of the jobs whose validation decodes with the engine (on-policy RL) and of the
# offline ones, whose validation is a forward pass: the job's name and its loop's settings.
ON_POLICY_SECTIONS = {"grpo": "grpo", "distillation": "distill"}
OFFLINE_SECTIONS = {"sft": "sft", "dpo": "dpo", "rm": "rm"}


@dataclass
class DevicePlan:
    """Bytes one device (a GPU, or a CPU worker process) holds: `rows[item][phase]`, for the
    job's `phases`."""

    name: str
    phases: tuple[str, ...] = PHASES
    rows: dict[str, dict[str, int]] = field(default_factory=dict)
    # Rows of models that take turns on the device (distillation's teachers score one after the
    # other, their accuracy engines run one at a time): item -> (group, member). A phase counts
    # each group's largest member, not the sum of its members.
    turns: dict[str, tuple[str, str]] = field(default_factory=dict)

    def add(self, item: str, nbytes: float, phases: Optional[tuple[str, ...]] = None,
            turn: Optional[tuple[str, str]] = None) -> None:
        """Count `nbytes` of `item` in `phases` (default: all of the device's); a phase the job
        does not have is skipped. `turn` (group, member): the item is `member`'s in a group whose
        members take turns (`turns`)."""
        for phase in self.phases if phases is None else phases:
            if phase in self.phases:
                self.rows.setdefault(item, {})[phase] = self.rows.get(item, {}).get(phase, 0) + int(nbytes)
        if turn is not None and item in self.rows:
            self.turns[item] = turn

    def phase_total(self, phase: str) -> int:
        members: dict[str, dict[str, int]] = {}
        for item, (group, member) in self.turns.items():
            share = members.setdefault(group, {})
            share[member] = share.get(member, 0) + self.rows[item].get(phase, 0)
        alone = sum(row.get(phase, 0) for item, row in self.rows.items() if item not in self.turns)
        return alone + sum(max(share.values()) for share in members.values())

    def taking_turns(self) -> set[str]:
        """The rows of groups with more than one member (the table marks them)."""
        groups: dict[str, set[str]] = {}
        for group, member in self.turns.values():
            groups.setdefault(group, set()).add(member)
        return {item for item, (group, _) in self.turns.items() if len(groups[group]) > 1}

    def peak(self) -> tuple[str, int]:
        """(phase, bytes) of the phase that needs the most (the first of equals)."""
        return max(((p, self.phase_total(p)) for p in self.phases), key=lambda pair: pair[1])


@dataclass
class Plan:
    """The devices of one job (one of each kind: every policy device holds the same) and the
    memory each has (None: unknown); `warm_starts` are the jobs that run before it."""

    devices: list[DevicePlan]
    device_bytes: Optional[int]
    on_gpu: bool
    process_counts: list[int]  # how many of each device kind the job has
    num_nodes: int = 1
    row_tokens: Optional[int] = None  # the longest row planned for (`longest_row_tokens`)
    longest_prompt: Optional[int] = None  # tokens of the longest prompt, when known
    row_bound: str = "policy.max_total_sequence_length"  # what bounds `row_tokens`, in words
    job: str = "grpo"  # the job's name as the tables print it
    phases: tuple[str, ...] = PHASES
    warm_starts: list["WarmStart"] = field(default_factory=list)
    teacher_shapes: dict[str, ModelShape] = field(default_factory=dict)  # distillation's, by teacher key

    def node_peak(self) -> int:
        """This job's peak (not its warm starts'): GPU: the largest device peak; CPU: the sum of
        the peaks of one node's processes (a kind's processes spread evenly over `num_nodes`)."""
        if self.on_gpu:
            return max(d.peak()[1] for d in self.devices)
        return sum(d.peak()[1] * self._per_node(count) for d, count in zip(self.devices, self.process_counts))

    def phase_peak(self, phase: str) -> int:
        """What `phase` needs: per GPU the largest device's, on CPU one node's processes together."""
        if self.on_gpu:
            return max(d.phase_total(phase) for d in self.devices)
        return sum(d.phase_total(phase) * self._per_node(count) for d, count in zip(self.devices, self.process_counts))

    def peak_phase(self) -> str:
        """The phase that sets this job's peak (its largest device's; on CPU the first process kind's)."""
        return max(self.devices, key=lambda d: d.peak()[1]).peak()[0] if self.on_gpu else self.devices[0].peak()[0]

    def _per_node(self, count: int) -> int:
        return math.ceil(count / self.num_nodes)

    def phase_peaks(self) -> list[tuple[str, str, int]]:
        """(job, phase, bytes) of every phase of the warm starts, then of this job, in the order they run."""
        warm = [peak for w in self.warm_starts if w.plan is not None for peak in w.plan.phase_peaks()]
        return warm + [(self.job, phase, self.phase_peak(phase)) for phase in self.phases]

    def run_peak(self) -> tuple[str, str, int]:
        """(job, phase, bytes) of the job that needs the most of the run's jobs (this job or a warm
        start that will run), its phase that sets the peak, and that peak."""
        jobs = [self] + [w.plan for w in self.warm_starts if w.plan is not None]
        top = max(jobs, key=lambda plan: plan.node_peak())
        return top.job, top.peak_phase(), top.node_peak()


@dataclass
class WarmStart:
    """An SFT warm start of the run (`key`: `sft_warmup` or `teacher_warmup`), its own job before
    the run's: its config and shape, and its plan (None when its export is cached: it will not run)."""

    key: str
    cfg: Any
    shape: Optional[ModelShape]
    plan: Optional[Plan]
    export_dir: Any = None


def job_name(cfg: Any) -> str:
    """The job `cfg` configures: grpo, distill, sft, dpo, rm or eval."""
    for section, name in {**ON_POLICY_SECTIONS, **OFFLINE_SECTIONS, "eval": "eval"}.items():
        if hasattr(cfg, section):
            return name
    return "grpo"


def loop_section(cfg: Any) -> Any:
    """The job's loop settings (`grpo`, `distillation`, `sft`, ...), None for eval."""
    return next((getattr(cfg, s) for s in (*ON_POLICY_SECTIONS, *OFFLINE_SECTIONS) if hasattr(cfg, s)), None)


def validates(cfg: Any) -> bool:
    """Whether the job's schedule validates at all (before the first step, periodically or at the end)."""
    s = loop_section(cfg)
    return s is not None and (s.val_at_start or s.val_period > 0 or s.val_at_end)


def computes_logprobs(cfg: Any) -> bool:
    """Whether an on-policy step has a logprobs phase: GRPO computes the previous logprobs only
    when the generating weights are older (async) or the batch spans several optimizer steps, and
    the reference's under a KL penalty (`experience.update_policy`); distillation always."""
    g = getattr(cfg, "grpo", None)
    if g is None:
        return True
    rows = g.num_prompts_per_step * g.num_generations_per_prompt
    return g.async_grpo.enabled or rows > cfg.policy.train_global_batch_size or cfg.loss_fn.reference_policy_kl_penalty > 0


def job_phases(cfg: Any) -> tuple[str, ...]:
    """The phases `cfg`'s job runs (module doc), in `PHASES` order."""
    if hasattr(cfg, "eval"):
        return ("evaluation",)
    validation = ("validation",) if validates(cfg) else ()
    if any(hasattr(cfg, s) for s in ON_POLICY_SECTIONS):
        teacher_eval = ("teacher eval",) if hasattr(cfg, "distillation") and cfg.distillation.val_at_start else ()
        return ("generation", "refit", *(("logprobs",) if computes_logprobs(cfg) else ()), "training", *validation,
                *teacher_eval)
    return ("logprobs", "training", *validation) if hasattr(cfg, "dpo") else ("training", *validation)


def engine_rows(rows_per_call: int, engines: int, batch_size: int) -> int:
    """Rows one engine decodes at once: its share of a call's rows (`Batch.shard` over `engines`),
    in pieces of at most `batch_size` (`policy.generation.batch_size`)."""
    return max(1, min(batch_size, math.ceil(rows_per_call / engines)))


def native_engine_bytes(shape: ModelShape, rows: int, prompts: int, prompt_tokens: int, row_tokens: int,
                        dtype_bytes: int) -> dict[str, float]:
    """Working memory of one native-engine call (`NativeGenerationEngine.generate`) of `rows` rows
    of at most `row_tokens` tokens whose `prompts` distinct prompts are `prompt_tokens` long:

    - the decoder's KV cache, preallocated for every row's prompt and new tokens (`LlamaLikeDecoder.start`);
    - the prefill's own cache of the distinct prompts (a row shares its prompt's prefill,
      `share_prompts`), alive while the decoder's cache is filled from it;
    - the prefill's forward, one layer's activations at a time (nothing is kept for a backward).
    """
    return {
        "KV cache": kv_cache_bytes(shape, rows, row_tokens, dtype_bytes),
        "prefill KV cache (distinct prompts)": kv_cache_bytes(shape, prompts, prompt_tokens, dtype_bytes),
        "prefill forward": prompts * prompt_tokens * activation_bytes_per_token_layer(shape, dtype_bytes),
    }


def memory_plan(cfg: Any, shape: ModelShape, device_bytes: Optional[int] = None,
                longest_prompt: Optional[int] = None, teacher_shapes: Optional[dict[str, ModelShape]] = None) -> Plan:
    """What each device holds in each phase of `cfg`'s job (a validated master config) for `shape`;
    `longest_prompt` (tokens, default None: unknown) bounds RL rows (`longest_row_tokens`).
    `teacher_shapes` (distillation; default: read from each teacher section's model, `model_shape`)
    are the teachers' shapes by key (`teacher`, `teachers.<task>`). Warm starts are jobs of their
    own (`run_plan`)."""
    from posttrain.config.schema import resolve_backend
    from posttrain.models.policy.offload import offloads_during_generation
    from posttrain.models.refit import MAX_BUCKET_BYTES

    policy, gen = cfg.policy, cfg.policy.generation
    on_gpu = cfg.cluster.gpus_per_node > 0
    c = compute_dtype_bytes(policy.precision, on_gpu)
    phases, job = job_phases(cfg), job_name(cfg)
    row_tokens = longest_row_tokens(cfg, longest_prompt)
    bound = f"longest prompt {longest_prompt} + max_new_tokens" if row_tokens < policy.max_total_sequence_length \
        and longest_prompt is not None else "policy.max_total_sequence_length"
    local = resolve_backend(cfg) == "local"
    if job == "eval":  # one generation worker, nothing trained
        engine = DevicePlan("generation worker", phases)
        if not on_gpu:
            engine.add("runtime (python, torch)", CPU_RUNTIME_BYTES)
        e = cfg.eval
        add_engine(engine, cfg, shape, c, device_bytes, weights=True,
                   calls={"evaluation": (e.batch_size * e.num_generations_per_prompt, e.num_generations_per_prompt)},
                   engines=1, row_tokens=row_tokens, longest_prompt=longest_prompt)
        return Plan([engine], device_bytes, on_gpu, [1], cfg.cluster.num_nodes, row_tokens, longest_prompt, bound,
                    job, phases)

    shards, tp, sp = policy.num_workers, policy.tensor_parallel_size, policy.sequence_parallel
    cp = policy.context_parallel_size  # CP ranks hold 1/cp of every row's tokens
    dp = shards // tp
    trainable = shape.lora_params if policy.lora.enabled else shape.num_params  # LoRA is refused under TP
    colocated = gen.colocated.enabled
    has_generation = job in ON_POLICY_SECTIONS.values()
    kl = getattr(getattr(cfg, "loss_fn", None), "reference_policy_kl_penalty", 0) > 0

    # Offloaded while the engine generates (models/policy/offload.py): the training state is not on
    # the device in the generation and validation phases, except weights lent in place to a native
    # engine in the policy's own process (the local backend with one worker), which are the engine's.
    offloaded = has_generation and offloads_during_generation(policy, on_gpu)
    lends_weights = local and colocated and gen.backend == "native" and shards == 1 and not policy.lora.enabled
    resident = tuple(p for p in phases if p not in ("generation", "validation")) if offloaded else phases
    trainer = DevicePlan("policy worker" + (" (+ generation)" if colocated and has_generation else ""), phases)
    if not on_gpu:
        trainer.add("runtime (python, torch)", CPU_RUNTIME_BYTES)
    # Master weights are float32 (autocast computes in policy.precision), sharded by FSDP2 over the
    # data-parallel ranks; tensor parallelism also splits the decoder layers over its `tp` ranks,
    # not the embeddings and LM head. FSDP2 all-gathers one layer ahead while it computes one (2
    # layers' TP shards in float32). Context parallel ranks are FSDP shards too (over dp x cp).
    per_rank = per_rank_params(shape, shards, tp)
    trainer.add("policy parameters (fp32)", 4 * per_rank, phases if lends_weights else resident)
    # Forward passes without gradients: RL's logprobs, DPO's reference logprobs, the offline jobs'
    # validation; none in distillation, whose logprobs phase is its teachers' (`add_teachers`).
    no_grad = () if job == "distill" else ("logprobs",) if has_generation else ("logprobs", "validation")
    if dp > 1:
        trainer.add("FSDP all-gathered layers", 2 * 4 * (shape.num_params - shape.embedding_params * (tp > 1))
                    / shape.num_layers / tp, ("refit", "training") + no_grad)
    trainable_per_rank = trainable / shards if policy.lora.enabled else per_rank
    # Distillation's loss reads the student's full logits (`input_type="logits"`): no fused head.
    fused_head = policy.fused_logprobs and job != "distill"
    trainer.add("gradients (fp32)", 4 * trainable_per_rank, ("training",))
    trainer.add(f"optimizer state ({policy.optimizer.name})",
                optimizer_state_bytes(trainable_per_rank, policy.optimizer.name, 1), resident)
    trainer.add("activations" + (" (checkpointed)" if policy.activation_checkpointing else ""),
                training_activation_bytes(shape, micro_batch_tokens(policy, True, row_tokens) // cp, c,
                                          policy.activation_checkpointing, fused_head, tp, sp), ("training",))
    trainer.add("logprob forward", logprob_activation_bytes(shape, micro_batch_tokens(policy, False, row_tokens) // cp, c,
                                                             policy.fused_logprobs, tp, sp), no_grad)
    if cp > 1 and on_gpu and c == 4:  # no fused CUDA kernel for float32 blocks (attention_blocks.block_kernel)
        trainer.add("ring attention blocks (fp32)", ring_attention_block_bytes(
            shape, micro_batch_tokens(policy, True), policy.max_total_sequence_length, cp), ("training",))
    if (kl or job == "dpo") and not on_gpu:  # the reference copy is this rank's fp32 shard in host memory (policy worker)
        trainer.add("reference model (fp32, host)", 4 * per_rank)

    devices, counts = [trainer], [shards]
    critic = getattr(cfg, "critic", None)
    if critic is not None:  # PPO's value model
        add_critic(cfg, shape, trainer, devices, counts, c=c, row_tokens=row_tokens, resident=resident,
                   own_process=not critic.colocated or not (on_gpu or local))
    if has_generation:
        engine = trainer if colocated else DevicePlan("generation worker", phases)
        engines = shards if colocated else gen.colocated.num_workers or 1
        if not colocated:
            devices.append(engine)
            counts.append(engines)
            if not on_gpu:
                engine.add("runtime (python, torch)", CPU_RUNTIME_BYTES)
        s = loop_section(cfg)
        groups = s.num_generations_per_prompt
        val_k = getattr(s, "val_num_generations_per_prompt", 1)
        # One unsharded policy worker lends its weights to a native engine in its process: no copy, no refit.
        in_place = local and colocated and gen.backend == "native" and shards == 1
        add_engine(engine, cfg, shape, c, device_bytes, weights=not in_place,
                   calls={"generation": (s.num_prompts_per_step * groups, groups),
                          "validation": (s.val_batch_size * val_k, val_k)},
                   engines=engines, row_tokens=row_tokens, longest_prompt=longest_prompt,
                   phases=("generation", "refit", "validation") if colocated else phases)
        if not in_place:
            # Unset, the bucket is a share of free memory at run time, at most MAX_BUCKET_BYTES: plan for that most.
            bucket = policy.refit_buffer_size_gb * GiB if policy.refit_buffer_size_gb else MAX_BUCKET_BYTES
            refit_bucket = min(bucket, c * shape.num_params) + c * shape.largest_tensor
            trainer.add("refit bucket (send)", refit_bucket, ("refit",))
            engine.add("refit bucket (receive)", refit_bucket, ("refit",))
    shapes: dict[str, ModelShape] = {}
    if job == "distill":
        from posttrain.plan.teachers import add_teachers, read_teacher_shapes

        shapes = read_teacher_shapes(cfg, teacher_shapes)
        add_teachers(cfg, shapes, trainer, devices, counts, device_bytes=device_bytes, row_tokens=row_tokens,
                     longest_prompt=longest_prompt, in_process=local)
    return Plan(devices, device_bytes, on_gpu, counts, cfg.cluster.num_nodes, row_tokens, longest_prompt, bound, job,
                phases, teacher_shapes=shapes)


def add_critic(cfg: Any, shape: ModelShape, trainer: DevicePlan, devices: list[DevicePlan], counts: list[int], *,
               c: int, row_tokens: int, resident: tuple[str, ...], own_process: bool) -> None:
    """Add PPO's critic: the policy's shape (no LM head), FSDP2 over its own workers, on the policy's
    device (`trainer`) or, `own_process`, as a device of its own appended to `devices` / `counts`
    (a process of its own unless colocated on a GPU, where it shares the policy's, or in the local
    backend's one process)."""
    policy, critic = cfg.policy, cfg.critic
    workers = policy.num_workers if critic.colocated else critic.num_workers or policy.num_workers
    holder = DevicePlan("critic worker", trainer.phases) if own_process else trainer
    optimizer = (critic.optimizer or policy.optimizer).name
    holder.add("critic parameters (fp32)", 4 * shape.num_params / workers, resident)
    holder.add(f"critic optimizer state ({optimizer})", optimizer_state_bytes(shape.num_params, optimizer, workers),
               resident)
    if not own_process:
        # Sharing a device, its gradients and activations come and go while the policy's are freed
        # (one trains after the other), so the policy's rows bound them.
        return
    devices.append(holder)
    counts.append(workers)
    if cfg.cluster.gpus_per_node == 0:
        holder.add("runtime (python, torch)", CPU_RUNTIME_BYTES)
    holder.add("critic gradients (fp32)", 4 * shape.num_params / workers, ("training",))
    holder.add("critic activations", training_activation_bytes(
        shape, micro_batch_tokens(policy, True, row_tokens), c, policy.activation_checkpointing, True), ("training",))


def add_engine(engine: DevicePlan, cfg: Any, shape: ModelShape, c: int, device_bytes: Optional[int], *, weights: bool,
               calls: dict[str, tuple[int, int]], engines: int, row_tokens: int, longest_prompt: Optional[int],
               phases: Optional[tuple[str, ...]] = None) -> None:
    """Add a generation engine's rows to `engine`: its weights (unless lent in place, `weights`
    False), and per decoding phase in `calls` (`phase: (rows of one call, rows sharing a prompt)`)
    its working memory; `phases` the engine is resident in (default: all of the device's)."""
    policy, gen = cfg.policy, cfg.policy.generation
    on_gpu = cfg.cluster.gpus_per_node > 0
    if gen.backend == "vllm" and on_gpu:
        util = gen.vllm_cfg.gpu_memory_utilization
        share = util * device_bytes if device_bytes else 0
        # vLLM takes gpu_memory_utilization of the whole GPU for its weights and KV cache; asleep
        # (colocated, level 1) while the policy trains.
        engine.add(f"vLLM weights + KV cache ({util:g} of the GPU)", share, phases)
        return
    if weights:
        if not on_gpu and gen.backend == "vllm":
            engine.add("vLLM runtime", CPU_RUNTIME_BYTES, phases)
        engine.add("generation weights", c * shape.num_params, phases)
    if gen.backend == "vllm":
        engine.add("vLLM KV cache (cpu_kv_cache_gb)", gen.vllm_cfg.cpu_kv_cache_gb * GiB, phases)
        return
    # A single-turn prompt is at most the longest prompt; a later turn's holds the conversation so far.
    single_turn = rollout_turns(cfg) == 1
    prompt_tokens = min(longest_prompt, row_tokens) if single_turn and longest_prompt else row_tokens
    for phase, (rows_per_call, group) in calls.items():
        rows = engine_rows(rows_per_call, engines, gen.batch_size)
        # Rows share their prompt's prefill; later turns of a multi-turn rollout prefill each row's own conversation.
        prompts = math.ceil(rows / group) if single_turn else rows
        for item, nbytes in native_engine_bytes(shape, rows, prompts, prompt_tokens, row_tokens, c).items():
            engine.add(item, nbytes, (phase,))
    return weights
