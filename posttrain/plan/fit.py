"""Whether a run's memory plan fits its devices (`check_memory`), the single config changes that
would make it fit (`fit_problem`), and the plan as a table (`format_plan`)."""

from __future__ import annotations

import json
from typing import Any, Optional

from posttrain.plan.formulas import GiB, longest_prompt_tokens
from posttrain.plan.devices import Plan, WarmStart
from posttrain.plan.jobs import memory_plan, validates
from posttrain.plan.shape import ModelShape, hf_config_of, model_shape, shape_for

# A plan must leave this share of the device free (CUDA context, fragmentation, optimizer temporaries).
HEADROOM = 0.10


def detect_device_bytes(cfg: Any) -> Optional[int]:
    """Memory of one device: `cluster.gpu_memory_gb` / `cluster.host_memory_gb` when set, else
    torch.cuda's first device or the datasheet memory of `cluster.gpu_type` (GPU jobs) or this
    machine's RAM (CPU jobs); None when unknown."""
    if cfg.cluster.gpus_per_node > 0:
        if cfg.cluster.gpu_memory_gb is not None:
            return int(cfg.cluster.gpu_memory_gb * GiB)
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory
        if cfg.cluster.gpu_type != "auto":  # a named GPU type: its datasheet memory (gpus.GPU_SPECS, GB)
            from posttrain.plan.gpus import GPU_SPECS

            return int(GPU_SPECS[cfg.cluster.gpu_type].memory_gb * 1e9)
        return None
    if cfg.cluster.host_memory_gb is not None:
        return int(cfg.cluster.host_memory_gb * GiB)
    import psutil

    return psutil.virtual_memory().total



def run_plan(cfg: Any, shape: ModelShape, device_bytes: Optional[int] = None, longest_prompt: Optional[int] = None,
             warm_shapes: Optional[dict[str, ModelShape]] = None,
             teacher_shapes: Optional[dict[str, ModelShape]] = None) -> Plan:
    """`memory_plan` of `cfg`'s job with its SFT warm starts (`sft_warmup`, `teacher_warmup`), each
    planned as the job of its own it is, unless its export is cached (then it will not run).
    `warm_shapes` (default: read from each warm start's model) are their models' shapes;
    `teacher_shapes` (default: read from each teacher's model) a distillation's teachers', by key."""
    from posttrain.run_config import WARM_STARTS, warm_start_export_dir

    plan = memory_plan(cfg, shape, device_bytes, longest_prompt, teacher_shapes)
    for key in WARM_STARTS:
        warm = getattr(cfg, key, None)
        if warm is None:
            continue
        export = warm_start_export_dir(warm)
        if (export / "config.json").exists():
            plan.warm_starts.append(WarmStart(key, warm, None, None, export))
            continue
        warm_shape = (warm_shapes or {}).get(key) or model_shape(warm.policy)
        warm_plan = memory_plan(warm, warm_shape, device_bytes)
        warm_plan.job = key
        plan.warm_starts.append(WarmStart(key, warm, warm_shape, warm_plan, export))
    return plan


def usable_bytes(plan: Plan) -> float:
    return (1 - HEADROOM) * plan.device_bytes


def fits(plan: Plan) -> bool:
    """True when the peak of every job of the run (`Plan.run_peak`) stays under (1 - HEADROOM) of
    the device memory (or it is unknown)."""
    return plan.device_bytes is None or plan.run_peak()[2] <= usable_bytes(plan)


def candidate_fixes(cfg: Any, shape: Optional[ModelShape] = None,
                    teacher_shapes: Optional[dict[str, ModelShape]] = None) -> list[tuple[str, Any]]:
    """(key=value, changed config) pairs worth trying, one change each; tensor parallel sizes
    only where they divide `shape`'s heads, key/value heads and MLP width (and the workers);
    a distillation's teachers' too (`teacher_shapes` by key)."""
    from posttrain.config.schema import teacher_sections

    policy, gen = cfg.policy, cfg.policy.generation
    fixes: list[tuple[str, Any]] = []

    def variant(key: str, value: Any) -> None:
        changed = cfg.model_copy(deep=True)
        *path, leaf = key.split(".")
        node = changed
        for part in path:  # `teachers.<task>` is a dict's entry
            node = node[part] if isinstance(node, dict) else getattr(node, part)
        try:
            setattr(node, leaf, value)
        except ValueError:  # pydantic's ValidationError: not a valid value for this config
            return
        fixes.append((f"{key}={json.dumps(value)}", changed))

    if not policy.activation_checkpointing:
        variant("policy.activation_checkpointing", True)
    budget = next((f"policy.{name}" for name in ("dynamic_batching", "sequence_packing")
                   if getattr(policy, name).enabled), None)
    for key, value in ([(f"{budget}.train_mb_tokens", getattr(policy, budget.split(".")[1]).train_mb_tokens),
                        (f"{budget}.logprob_mb_tokens", getattr(policy, budget.split(".")[1]).logprob_mb_tokens)]
                       if budget else [("policy.train_micro_batch_size", policy.train_micro_batch_size),
                                       ("policy.logprob_batch_size", policy.logprob_batch_size)]):
        smaller = value // 2
        while smaller >= 1:
            variant(key, smaller)
            smaller //= 2
    if cfg.cluster.gpus_per_node > 0:
        for workers in (2 * policy.num_workers, 4 * policy.num_workers):
            variant("policy.num_workers", workers)
        if policy.precision == "float32":
            variant("policy.precision", "bfloat16")
        if policy.tensor_parallel_size > 1 and not policy.sequence_parallel and not (shape and shape.num_experts):
            variant("policy.sequence_parallel", True)
        dims = (shape.num_heads, shape.num_kv_heads, shape.intermediate_size) if shape else ()
        for tp in (2, 4, 8):
            if tp > policy.tensor_parallel_size and not policy.lora.enabled and policy.num_workers % tp == 0 \
                    and all(d % tp == 0 for d in dims) and shape is not None:
                variant("policy.tensor_parallel_size", tp)
        for ep in (2, 4, 8):  # mixtures of experts: experts split over EP ranks, not all-gathered per layer
            if shape is not None and shape.num_experts and shape.num_experts % ep == 0 and ep > policy.expert_parallel_size \
                    and policy.num_workers % ep == 0:
                variant("policy.expert_parallel_size", ep)
        for pp in (2, 4, 8):  # dense llama / qwen2 / qwen3, untied (`pipeline_problem`): layers split into stages
            if shape is not None and not shape.num_experts and pp > policy.pipeline_parallel_size \
                    and policy.num_workers % (pp * policy.tensor_parallel_size) == 0:
                before = len(fixes)
                variant("policy.pipeline_parallel_size", pp)
                if len(fixes) > before and not splits_into_stages(fixes[-1][1]):
                    fixes.pop()
        if gen.backend == "vllm" and gen.colocated.enabled:
            for util in (0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2):
                if util < gen.vllm_cfg.gpu_memory_utilization:
                    variant("policy.generation.vllm_cfg.gpu_memory_utilization", util)
    if not policy.lora.enabled:
        variant("policy.lora.enabled", True)
    halvings = [("policy.generation.batch_size", gen.batch_size)] if gen.backend == "native" else []
    section = next((s for s in ("grpo", "distillation") if hasattr(cfg, s)), None)
    if section and validates(cfg) and gen.backend == "native":  # prompts per validation call
        halvings.append((f"{section}.val_batch_size", getattr(cfg, section).val_batch_size))
    if hasattr(cfg, "eval") and gen.backend == "native":
        halvings.append(("eval.batch_size", cfg.eval.batch_size))
    sections = teacher_sections(cfg)
    for key, section in sections.items():
        budget = next((name for name in ("dynamic_batching", "sequence_packing") if getattr(section, name).enabled), None)
        halvings.append((f"{key}.{budget}.logprob_mb_tokens", getattr(section, budget).logprob_mb_tokens) if budget
                        else (f"{key}.logprob_batch_size", section.logprob_batch_size))
        if cfg.cluster.gpus_per_node > 0:
            if len(sections) == 1:  # teachers share their bundles: one num_workers for all (`teacher_problem`)
                for workers in (2 * section.num_workers, 4 * section.num_workers):
                    variant(f"{key}.num_workers", workers)
            t = (teacher_shapes or {}).get(key)
            for tp in (2, 4, 8):
                if t is not None and tp > section.tensor_parallel_size and section.num_workers % tp == 0 \
                        and all(dim % tp == 0 for dim in (t.num_heads, t.num_kv_heads, t.intermediate_size)):
                    variant(f"{key}.tensor_parallel_size", tp)
    for key, value in halvings:
        smaller = value // 2
        while smaller >= 1:
            variant(key, smaller)
            smaller //= 2
    return fixes



def splits_into_stages(cfg: Any) -> bool:
    """Whether `cfg`'s model can be cut into its pipeline stages (`parallel_sizes.pipeline_problem`
    on its config: model type, untied embeddings, full attention, enough layers)."""
    from posttrain.models.parallel_sizes import pipeline_problem

    policy = cfg.policy
    return pipeline_problem(hf_config_of(policy).to_dict(), policy.pipeline_parallel_size
                            * policy.pipeline_stages_per_worker, policy.pipeline_layer_split) is None


def fit_problem(cfg: Any, shape: ModelShape, plan: Plan) -> Optional[str]:
    """None when `plan` fits; else one line: the job and phase, the need, the memory, and the single
    changes that fit (for each key, the first value tried that fits: the mildest change). A warm
    start that does not fit is named by its key (`sft_warmup`), its changes by theirs (`sft_warmup.policy...`)."""
    if fits(plan):
        return None
    jobs = [("", cfg, shape, plan)] + [(f"{w.key}.", w.cfg, w.shape, w.plan) for w in plan.warm_starts if w.plan]
    prefix, cfg, shape, plan = next(job for job in jobs if job[3].node_peak() > usable_bytes(job[3]))
    where = "per GPU" if plan.on_gpu else "on this node"
    teachers = ", ".join(f"{key} {teacher_model(cfg, key)!r} {nbytes / GiB:.2f} GiB"
                         for key, nbytes in teacher_peak_bytes(plan).items() if nbytes)
    need = f"needs {plan.node_peak() / GiB:.2f} GiB {where}{f' ({teachers} of it)' if teachers else ''} but " \
           f"{usable_bytes(plan) / GiB:.2f} GiB is usable ({1 - HEADROOM:.0%} of {plan.device_bytes / GiB:.2f} GiB)"
    found: dict[str, str] = {}
    for change, changed in candidate_fixes(cfg, shape, plan.teacher_shapes):
        key = change.split("=", 1)[0]
        if key not in found and memory_plan(changed, shape_for(changed, shape), plan.device_bytes, plan.longest_prompt,
                                            plan.teacher_shapes).node_peak() <= usable_bytes(plan):
            found[key] = prefix + change
    advice = ("it would fit with any one of: " + ", ".join(found.values())) if found else \
        "no single change of policy.activation_checkpointing, micro-batch sizes, policy.num_workers, " \
        "policy.tensor_parallel_size, policy.pipeline_parallel_size, policy.precision, policy.lora.enabled or " \
        "generation settings" + \
        (" (or the teachers' logprob batches, num_workers and tensor_parallel_size)" if plan.teacher_shapes else "") + \
        " makes it fit"
    job = f"{prefix[:-1]} (SFT warm start), " if prefix else ""
    return f"memory plan: {job}{plan.peak_phase()} {need}; {advice}"


def teacher_model(cfg: Any, key: str) -> str:
    """The model name of the teacher `key` (`teacher`, `teachers.<task>`)."""
    from posttrain.config.schema import teacher_sections

    return teacher_sections(cfg)[key].model_name


def teacher_peak_bytes(plan: Plan) -> dict[str, int]:
    """Each teacher's bytes (its rows, `<key> ...`) in what sets the job's peak (`Plan.node_peak`):
    the GPU that needs the most in its peak phase, or on CPU one node's processes each in its own."""
    devices = [(max(plan.devices, key=lambda d: d.peak()[1]), 1)] if plan.on_gpu else \
        [(d, plan._per_node(n)) for d, n in zip(plan.devices, plan.process_counts)]
    return {key: sum(n * row.get(d.peak()[0], 0) for d, n in devices for item, row in d.rows.items()
                     if item.startswith(key + " ")) for key in plan.teacher_shapes}


def format_job(plan: Plan) -> list[str]:
    """One job's table: a block per device kind, a row per item, a column per phase of the job
    (GiB); rows marked * take turns (`DevicePlan.turns`)."""
    lines = []
    width = max([36] + [len(item) + 3 for device in plan.devices for item in device.rows])
    for device, count in zip(plan.devices, plan.process_counts):
        kind = "GPU" if plan.on_gpu else "process"
        turns = device.taking_turns()
        lines.append(f"{device.name} (x{count}), GiB per {kind}:")
        lines.append(f"  {'':{width}s}" + "".join(f"{p:>13s}" for p in plan.phases))
        for item, phases in device.rows.items():
            label = item + (" *" if item in turns else "")
            lines.append(f"  {label:{width}s}" + "".join(f"{phases.get(p, 0) / GiB:13.3f}" for p in plan.phases))
        lines.append(f"  {'total':{width}s}" + "".join(f"{device.phase_total(p) / GiB:13.3f}" for p in plan.phases))
        if turns:
            lines.append("  * the teachers take turns (their forwards, their accuracy engines): a total counts "
                         "the largest one's")
    if plan.row_tokens:
        lines.append(f"rows of at most {plan.row_tokens} tokens ({plan.row_bound})")
    return lines


def format_plan(plan: Plan) -> str:
    """The run's plan: its warm starts' tables (the jobs that run first), the job's, and the peak
    with the job and phase that set it."""
    lines = []
    for warm in plan.warm_starts:
        if warm.plan is None:
            lines.append(f"{warm.key} (SFT warm start): cached in {warm.export_dir}, will not run")
        else:
            lines.append(f"{warm.key} (SFT warm start, runs first as a job of its own):")
            lines += ["  " + line for line in format_job(warm.plan)]
    if plan.warm_starts:
        lines.append(f"{plan.job}:")
        lines += ["  " + line for line in format_job(plan)]
    else:
        lines += format_job(plan)
    memory = "unknown (set cluster.gpu_memory_gb)" if plan.device_bytes is None else f"{plan.device_bytes / GiB:.2f} GiB"
    scope = "per GPU" if plan.on_gpu else "on the node (all processes)"
    job, phase, peak = plan.run_peak()
    where = f"{phase} of {job}" if plan.warm_starts else phase
    lines.append(f"peak {scope}: {peak / GiB:.3f} GiB ({where}); memory: {memory}; "
                 f"{'fits' if fits(plan) else 'does not fit'} (keeping {HEADROOM:.0%} free)")
    return "\n".join(lines)


def check_memory(cfg: Any, shape: Optional[ModelShape] = None,
                 records: Optional[list[dict]] = None) -> tuple[Plan, Optional[str]]:
    """The plan of `cfg`'s run (its warm starts included) on the devices it will get, and why it
    cannot fit (None if it can); `records`: the prompts when the caller has read them (default:
    the training and validation records, read here)."""
    shape = shape or model_shape(cfg.policy)
    plan = run_plan(cfg, shape, detect_device_bytes(cfg), longest_prompt_tokens(cfg, records))
    return plan, fit_problem(cfg, shape, plan)
