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

A generation engine's rows are `engine.py`'s, a distillation's teachers' `teachers.py`'s. Under
pipeline parallelism the policy's ranks hold different things, so each is planned (`pipeline_plan`).
"""

from __future__ import annotations

from typing import Any, Optional

from posttrain.plan.devices import DevicePlan, Plan
from posttrain.plan.engine import add_engine, engine_dtype_bytes, engine_shares_dtype, has_quantized_copy
from posttrain.plan.formulas import (
    CPU_RUNTIME_BYTES, GiB, autocast_copy_bytes, compute_dtype_bytes, fused_head_weight_bytes, fused_optimizer, logprob_activation_bytes,
    longest_row_tokens, optimizer_step_bytes, tokenizer_bytes,
    micro_batch_tokens, optimizer_state_bytes, per_rank_params, pipeline_rank, ring_attention_block_bytes,
    training_activation_bytes,
)
from posttrain.plan.shape import ModelShape
from posttrain.plan.teachers import add_teachers, read_teacher_shapes

# The sections of the jobs whose validation decodes with the engine (on-policy RL) and of the
# offline ones, whose validation is a forward pass: the job's name and its loop's settings.
ON_POLICY_SECTIONS = {"grpo": "grpo", "distillation": "distill"}
OFFLINE_SECTIONS = {"sft": "sft", "dpo": "dpo", "rm": "rm"}


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


def logprob_passes(cfg: Any) -> int:
    """Forward passes an on-policy step's logprobs phase makes: GRPO computes the previous
    logprobs only when the generating weights are older (async) or the batch spans several
    optimizer steps, and the reference's under a KL penalty (`experience.update_policy`);
    distillation one (its teachers' top-k forwards)."""
    g = getattr(cfg, "grpo", None)
    if g is None:
        return 1
    rows = g.num_prompts_per_step * g.num_generations_per_prompt
    previous = g.async_grpo.enabled or rows > cfg.policy.train_global_batch_size
    return int(previous) + int(cfg.loss_fn.reference_policy_kl_penalty > 0)


def computes_logprobs(cfg: Any) -> bool:
    """Whether an on-policy step has a logprobs phase (`logprob_passes`)."""
    return logprob_passes(cfg) > 0


def job_phases(cfg: Any) -> tuple[str, ...]:
    """The phases `cfg`'s job runs (module doc), in `devices.PHASES` order."""
    if hasattr(cfg, "eval"):
        return ("evaluation",)
    validation = ("validation",) if validates(cfg) else ()
    if any(hasattr(cfg, s) for s in ON_POLICY_SECTIONS):
        teacher_eval = ("teacher eval",) if hasattr(cfg, "distillation") and cfg.distillation.val_at_start else ()
        return ("generation", "refit", *(("logprobs",) if computes_logprobs(cfg) else ()), "training", *validation,
                *teacher_eval)
    return ("logprobs", "training", *validation) if hasattr(cfg, "dpo") else ("training", *validation)


def memory_plan(cfg: Any, shape: ModelShape, device_bytes: Optional[int] = None,
                longest_prompt: Optional[int] = None, teacher_shapes: Optional[dict[str, ModelShape]] = None,
                pp_rank: Optional[int] = None) -> Plan:
    """What each device holds in each phase of `cfg`'s job (a validated master config) for `shape`;
    `longest_prompt` (tokens, default None: unknown) bounds RL rows (`longest_row_tokens`).
    `teacher_shapes` (distillation; default: read from each teacher section's model, `model_shape`)
    are the teachers' shapes by key (`teacher`, `teachers.<task>`). Warm starts are jobs of their
    own (`run_plan`). Under pipeline parallelism the policy's devices are its pipeline ranks'
    (`pipeline_plan`); `pp_rank` plans that one rank's policy device only."""
    if cfg.policy.pipeline_parallel_size > 1 and pp_rank is None and not hasattr(cfg, "eval"):
        return pipeline_plan(cfg, shape, device_bytes, longest_prompt, teacher_shapes)
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
            add_tokenizers(engine, shape, 2 if local else 1)  # the local backend's controller loads one too
        e = cfg.eval
        add_engine(engine, cfg, shape, engine_dtype_bytes(cfg), device_bytes, weights=True,
                   calls={"evaluation": (e.batch_size * e.num_generations_per_prompt, e.num_generations_per_prompt)},
                   engines=1, row_tokens=row_tokens, longest_prompt=longest_prompt,
                   quantized_copy=has_quantized_copy(cfg))
        return Plan([engine], device_bytes, on_gpu, [1], cfg.cluster.num_nodes, row_tokens, longest_prompt, bound,
                    job, phases)

    shards, tp, sp = policy.num_workers, policy.tensor_parallel_size, policy.sequence_parallel
    cp = policy.context_parallel_size  # CP ranks hold 1/cp of every row's tokens
    pp = policy.pipeline_parallel_size  # with pp > 1 this plans pipeline rank `pp_rank` (formulas.pipeline_rank)
    dp = shards // (tp * pp)
    trainable = shape.lora_params if policy.lora.enabled else shape.num_params  # LoRA is refused under TP
    colocated = gen.colocated.enabled
    has_generation = job in ON_POLICY_SECTIONS.values()
    kl = getattr(getattr(cfg, "loss_fn", None), "reference_policy_kl_penalty", 0) > 0

    # Offloaded while the engine generates (models/policy/offload.py): the training state is not on
    # the device in the generation and validation phases, except weights lent in place to a native
    # engine in the policy's own process (the local backend with one worker), which are the engine's.
    offloaded = has_generation and offloads_during_generation(policy, on_gpu)
    # One unsharded policy worker lends its weights to a native engine in its process (no copy, no
    # refit) when the engine computes in the trainer's dtype.
    # One in another dtype (a bfloat16 engine beside float32 master weights) keeps its own copy,
    # which refit fills tensor by tensor in place (`share_weights`), no bucket either.
    engine_in_process = local and colocated and gen.backend == "native" and shards == 1
    engine_in_place = engine_in_process and engine_shares_dtype(cfg)
    lends_weights = engine_in_place and not policy.lora.enabled
    resident = tuple(p for p in phases if p not in ("generation", "validation")) if offloaded else phases
    trainer = DevicePlan("policy worker" + (" (+ generation)" if colocated and has_generation else ""), phases)
    if not on_gpu:
        trainer.add("runtime (python, torch)", CPU_RUNTIME_BYTES)
    # Master weights are float32 (autocast computes in policy.precision), sharded by FSDP2 over the
    # data-parallel ranks; tensor parallelism also splits the decoder layers over its `tp` ranks,
    # not the embeddings and LM head. FSDP2 all-gathers one layer ahead while it computes one (2
    # layers' TP shards in float32). Context parallel ranks are FSDP shards too (over dp x cp).
    ep = policy.expert_parallel_size  # routed experts split over EP groups, outside FSDP (expert_parallel.py)
    per_rank = per_rank_params(shape, shards, tp, ep)
    stage = pipeline_rank(policy, shape, dp, tp, c, micro_batch_tokens(policy, True, row_tokens), pp_rank or 0) \
        if pp > 1 else None
    if stage is not None:
        per_rank = stage["params"]
    trainer.add("policy parameters (fp32)", 4 * per_rank, phases if lends_weights else resident)
    # Forward passes without gradients: RL's logprobs, DPO's reference logprobs, the offline jobs'
    # validation; none in distillation, whose logprobs phase is its teachers' (`add_teachers`).
    no_grad = () if job == "distill" else ("logprobs",) if has_generation else ("logprobs", "validation")
    if dp > 1 and stage is not None:  # stages keep their layers gathered from forward to backward (pipeline.py)
        trainer.add("FSDP gathered stage (layers" + (", embeddings" if stage["first"] else "")
                    + (", head" if stage["last"] else "") + ")", stage["gathered"], ("training",) + no_grad)
    elif dp > 1:
        trainer.add("FSDP all-gathered layers", 2 * 4 * (shape.num_params - shape.embedding_params * (tp > 1)
                                                          - shape.expert_params * (ep > 1))
                    / shape.num_layers / tp, ("refit", "training") + no_grad)
    trainable_per_rank = trainable / shards if policy.lora.enabled else per_rank
    # Distillation's loss reads the student's full logits (`input_type="logits"`): no fused head.
    fused_head = policy.fused_logprobs and job != "distill"
    trainer.add("gradients (fp32)", 4 * trainable_per_rank, ("training",))
    trainer.add(f"optimizer state ({policy.optimizer.name})",
                optimizer_state_bytes(trainable_per_rank, policy.optimizer.name, 1), resident)
    if shards == 1 and c < 4:
        # autocast's compute-dtype copy of each float32 weight it multiplies by, saved for
        # backward (the input embeddings are looked up in float32; the fused head's copy is its
        # own row); under FSDP2 the layers are all-gathered in the compute dtype instead.
        trainer.add("autocast weight copies", autocast_copy_bytes(shape, c, fused_head and job != "rm"), ("training",))
    if stage is None and fused_head and job != "rm":
        trainer.add("LM head: fused logprobs' weight gradient", fused_head_weight_bytes(
            shape, c, trains_head=not policy.lora.enabled, gathered_in_compute_dtype=shards > 1), ("training",))
    if not on_gpu and not fused_optimizer(cfg):
        trainer.add("optimizer step temporaries (unfused)", optimizer_step_bytes(
            shape, policy.optimizer.name, shards, tp, trainable_per_rank, policy.lora.enabled), ("training",))
    if stage is not None:
        trainer.add(f"activations ({stage['in_flight']} stage forwards in flight"
                    + (", checkpointed)" if policy.activation_checkpointing else ")"), stage["activations"], ("training",))
        if stage["last"]:
            trainer.add("LM head: fused logprobs + fp32 weight gradient", stage["head"], ("training",))
    else:
        trainer.add("activations" + (" (checkpointed)" if policy.activation_checkpointing else ""),
                    training_activation_bytes(shape, micro_batch_tokens(policy, True, row_tokens) // cp, c,
                                          policy.activation_checkpointing, fused_head, tp, sp), ("training",))
    # Pipeline stages always compute logprobs with the fused head (`pipeline.StageChunk`).
    trainer.add("logprob forward", logprob_activation_bytes(shape, micro_batch_tokens(policy, False, row_tokens) // cp, c,
                                                             policy.fused_logprobs or pp > 1, tp, sp), no_grad)
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
        # The engine's own dtype (policy.generation.precision), which may not be the trainer's.
        add_engine(engine, cfg, shape, engine_dtype_bytes(cfg), device_bytes, weights=not engine_in_place,
                   calls={"generation": (s.num_prompts_per_step * groups, groups),
                          "validation": (s.val_batch_size * val_k, val_k)},
                   engines=engines, row_tokens=row_tokens, longest_prompt=longest_prompt,
                   # A native engine on CPU keeps its weights while the policy trains (its
                   # `finish_generation` offloads only from a GPU).
                   phases=("generation", "refit", "validation") if colocated and (on_gpu or gen.backend == "vllm")
                   else phases,
                   quantized_copy=has_quantized_copy(cfg))
        if not engine_in_process:
            # Unset, the bucket is a share of free memory at run time, at most MAX_BUCKET_BYTES: plan for that most.
            bucket = policy.refit_buffer_size_gb * GiB if policy.refit_buffer_size_gb else MAX_BUCKET_BYTES
            refit_bucket = min(bucket, c * shape.num_params) + c * shape.largest_tensor
            trainer.add("refit bucket (send)", refit_bucket, ("refit",))
            engine.add("refit bucket (receive)", refit_bucket, ("refit",))
    if not on_gpu:
        # Host memory on CPU: the policy worker's, a colocated engine's and the local backend's
        # controller's tokenizers (a separate engine's process plans its own below).
        add_tokenizers(trainer, shape, 1 + int(has_generation and colocated) + int(local))
        if has_generation and not colocated:
            add_tokenizers(engine, shape, 1)
    shapes: dict[str, ModelShape] = {}
    if job == "distill":
        shapes = read_teacher_shapes(cfg, teacher_shapes)
        add_teachers(cfg, shapes, trainer, devices, counts, device_bytes=device_bytes, row_tokens=row_tokens,
                     longest_prompt=longest_prompt, in_process=local)
    return Plan(devices, device_bytes, on_gpu, counts, cfg.cluster.num_nodes, row_tokens, longest_prompt, bound, job,
                phases, teacher_shapes=shapes)


def add_tokenizers(device: DevicePlan, shape: ModelShape, count: int) -> None:
    """`count` loaded tokenizers of `shape`'s model in `device`'s process (none when its size is unknown)."""
    if tokenizer_bytes(shape):
        device.add(f"tokenizers ({count} loaded)", count * tokenizer_bytes(shape))


def pipeline_plan(cfg: Any, shape: ModelShape, device_bytes: Optional[int], longest_prompt: Optional[int],
                  teacher_shapes: Optional[dict[str, ModelShape]]) -> Plan:
    """`memory_plan` under pipeline parallelism: every pipeline rank is planned (`formulas.pipeline_rank`)
    and the policy's devices are the first rank's, the last rank's and, with more than 2 ranks, the
    largest of the ranks between them standing for all of those (on CPU, where a node's processes
    add up, an upper bound for them); the rest of the plan (engines, teachers) is the first rank's.
    Fit (`Plan.node_peak`) and the fixes that would make it fit are decided by the largest."""
    pp = cfg.policy.pipeline_parallel_size
    plans = [memory_plan(cfg, shape, device_bytes, longest_prompt, teacher_shapes, pp_rank=r) for r in range(pp)]
    peaks = [p.devices[0].peak()[1] for p in plans]
    middle = max(range(1, pp - 1), key=lambda r: peaks[r], default=None)  # the first of equals
    plan, per_rank = plans[0], plans[0].process_counts[0] // pp
    ranks = [0] + ([middle] if middle is not None else []) + [pp - 1]
    for r in ranks:
        place = ("first pipeline stage" if r == 0 else "last pipeline stage" if r == pp - 1 else
                 f"pipeline rank {r}, the largest of ranks 1-{pp - 2}")
        plans[r].devices[0].name = plans[r].devices[0].name.replace("policy worker", f"policy worker ({place})", 1)
    plan.devices[:1] = [plans[r].devices[0] for r in ranks]
    plan.process_counts[:1] = [per_rank * (pp - 2 if r == middle else 1) for r in ranks]
    return plan


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
