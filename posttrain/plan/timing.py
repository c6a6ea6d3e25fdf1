"""A time plan from first principles: the seconds each phase of one on-policy step takes
(generation, refit, logprobs, training; validation apart) on a config's cluster, from the model's
shape, the mean prompt and response lengths, and the device's peaks (`gpus.py`).

Each phase is the larger of its compute time (FLOPs / (peak x an efficiency)) and its memory time
(bytes / (bandwidth x an efficiency)), plus the collectives that do not overlap it (bytes over the
link the group spans / (link bandwidth x an efficiency), plus a latency each). The efficiencies
are `EFFICIENCY`'s, one set for every GPU type and model, chosen against published runs
(`benchmarks/plan_vs_published.py`, docs/plan-time.md).

- generation: prefill of the distinct prompts (compute-bound) and decoding. One decode step of an
  engine reads the weights the step touches (a mixture of experts: the experts its rows route to,
  `experts_touched`) and every running row's KV cache, and computes 2 FLOPs per active parameter
  per row plus attention over the context: memory-bound at small batches, compute-bound at large.
  Steps: the rows' tokens / the rows decoding at once, plus the long tail: decoding ends with the
  longest response, `decode_tail` x the mean. Tensor-parallel engines all-reduce twice per layer
  and step.
- refit: the engine's share of the weights in its dtype, over NVLink (colocated, one domain) or
  the network, plus a copy in device memory.
- logprobs: one forward per logprob pass (previous and/or reference policy) over every token;
  training: forward and backward (3 forwards, 4 with activation checkpointing) and the optimizer
  step (memory-bound). Both pay the collectives of their mesh: FSDP's all-gathers and
  reduce-scatters (overlapped with compute: the larger counts), tensor parallelism's all-reduces,
  expert parallelism's all-to-alls, context parallelism's ring, and the pipeline bubble.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from posttrain.plan.engine import engine_rows
from posttrain.plan.formulas import kv_cache_bytes
from posttrain.plan.gpus import DeviceSpec
from posttrain.plan.shape import ModelShape

# The efficiency constants: what fraction of a peak each kind of work reaches. One set for all
# devices and models; benchmarks/plan_vs_published.py prints how well it predicts published runs.
EFFICIENCY = {
    "train_mfu": 0.4,  # training and logprob matmuls: fraction of dense peak (Megatron / FSDP2 report 0.3-0.5)
    "prefill_mfu": 0.5,  # prefill and compute-bound decode matmuls (vLLM)
    "decode_bandwidth": 0.7,  # decode's share of memory bandwidth (weights and KV cache reads)
    "link": 0.7,  # collectives' share of link bandwidth (NCCL bus bandwidth / link peak)
    "decode_tail": 2.5,  # decode steps run past the mean response: the longest rows end a call
    "moe": 0.35,  # routed experts' matmuls and weight reads against dense ones' (small grouped GEMMs, permutes)
    "vllm_step_s": 0.015,  # vLLM's host work per decode step (scheduling, sampling, outputs), not on the GPU
}
# The native engine on a GPU decodes without CUDA graphs: each layer's kernels are launched from
# Python every step, about 0.75 ms a layer whatever the bytes (docs/performance.md, "On one GPU":
# 9 ms a step for 12 layers on an H200). On CPU the same ops run in the caller's thread and their
# overhead is inside the measured rates.
NATIVE_GPU_LAYER_S = 0.75e-3
# Latency of one collective call (NCCL, small messages on NVLink: ~10-30 us); it bounds tensor-
# parallel decoding, whose all-reduces are a few KiB each.
COLLECTIVE_LATENCY_S = 20e-6
# Bytes the optimizer step moves per trained parameter: AdamW reads and writes the fp32 master
# weight (8) and two moments (16), and reads the fp32 gradient (4).
OPTIMIZER_BYTES_PER_PARAM = 28
PHASE_ORDER = ("generation", "refit", "logprobs", "training", "validation")


@dataclass(frozen=True)
class Layout:
    """How a config's job sits on the cluster, as the time plan needs it."""

    train_devices: int  # policy workers (GPUs or CPU processes)
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    gen_devices: int  # devices that generate (the policy's when colocated)
    gen_tp: int  # devices per engine
    colocated: bool
    gpus_per_node: int  # 0: CPU
    num_nodes: int

    @property
    def engines(self) -> int:
        return max(1, self.gen_devices // self.gen_tp)

    @property
    def devices(self) -> int:
        """Devices the job holds (tokens/s per GPU divides by these)."""
        return self.train_devices if self.colocated else self.train_devices + self.gen_devices

    def share(self, processes: int) -> float:
        """The part of one device's peaks each of `processes` busy processes gets: 1 on GPUs (a GPU
        each); on CPU a node's processes split its cores (the CPU is measured with all of them)."""
        if self.gpus_per_node:
            return 1.0
        return min(1.0, self.num_nodes / max(1, processes))


def layout_of(cfg: Any) -> Layout:
    policy, gen = cfg.policy, cfg.policy.generation
    colocated = gen.colocated.enabled
    gen_tp = gen.vllm_cfg.tensor_parallel_size if gen.backend == "vllm" else 1
    tp, pp, cp, ep = (policy.tensor_parallel_size, policy.pipeline_parallel_size, policy.context_parallel_size,
                      policy.expert_parallel_size)
    return Layout(policy.num_workers, max(1, policy.num_workers // (tp * pp * cp)), tp, pp, cp, ep,
                  policy.num_workers if colocated else (gen.colocated.num_workers or 1), gen_tp, colocated,
                  cfg.cluster.gpus_per_node, cfg.cluster.num_nodes)


@dataclass
class Lengths:
    """Mean tokens of a prompt and of a response, and where each number came from."""

    prompt: float
    response: float
    source: str = ""


@dataclass
class StepTime:
    """Seconds of each phase of one step (`phases`), validation's per validation run, and what
    bounded each (`bounds`: compute, memory, link, ...)."""

    phases: dict[str, float]
    bounds: dict[str, str]
    validation_s: float = 0.0
    validations_per_step: float = 0.0  # 1 / val_period
    tokens_per_step: float = 0.0  # prompt + response tokens of the step's rows
    devices: int = 1
    overlapped: bool = False  # async GRPO: generation runs beside refit, logprobs and training
    detail: dict[str, float] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        """A step as NeMo-RL's performance summary times it: generation, refit, logprobs, training;
        with async GRPO (`overlapped`) generation on its own GPUs hides behind the rest or the rest behind it."""
        if self.overlapped:
            rest = sum(v for k, v in self.phases.items() if k != "generation")
            return max(self.phases.get("generation", 0.0), rest)
        return sum(self.phases.values())

    @property
    def step_with_validation_s(self) -> float:
        return self.step_s + self.validation_s * self.validations_per_step

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_step / self.step_s / self.devices if self.step_s else 0.0


# --- the model's arithmetic -------------------------------------------------------------------------

def routed_experts_per_token(shape: ModelShape) -> int:
    return shape.experts_per_token - shape.shared_experts


def matmul_params(shape: ModelShape, experts_touched: Optional[float] = None) -> float:
    """Parameters a token's forward multiplies by: all but the input embeddings (the LM head always,
    tied or not) and, of a mixture of experts, only the routed experts it goes to (or
    `experts_touched` of them per layer, for the weights a batch reads)."""
    dense = shape.num_params - shape.embedding_params + shape.vocab_size * shape.hidden_size
    if not shape.num_experts:
        return dense
    per_expert = shape.expert_params / shape.num_experts
    used = routed_experts_per_token(shape) if experts_touched is None else experts_touched
    return dense - shape.expert_params + per_expert * used


def timed_matmul_params(shape: ModelShape, experts_touched: Optional[float] = None) -> float:
    """`matmul_params` as they cost time: the routed experts' at 1 / EFFICIENCY["moe"] the dense rate."""
    params = matmul_params(shape, experts_touched)
    if not shape.num_experts:
        return params
    used = routed_experts_per_token(shape) if experts_touched is None else experts_touched
    experts = shape.expert_params / shape.num_experts * used
    return params + experts * (1 / EFFICIENCY["moe"] - 1)


def experts_touched(shape: ModelShape, tokens: float) -> float:
    """Expected distinct routed experts `tokens` tokens route to, each to k of E uniformly:
    E x (1 - (1 - k/E)^tokens). One decoding row reads k experts' weights; 64 rows read most of them."""
    if not shape.num_experts:
        return 0.0
    e, k = shape.num_experts, routed_experts_per_token(shape)
    return e * (1 - (1 - k / e) ** max(tokens, 0.0))


def attention_flops_per_token(shape: ModelShape, context: float) -> float:
    """Forward FLOPs of attention scores and their weighted sum for one token attending over
    `context` tokens: 2 matmuls of 2 x heads x head_dim x context per layer."""
    return 4 * shape.num_layers * shape.num_heads * shape.head_dim * context


def forward_flops(shape: ModelShape, tokens: float, mean_context: float, timed: bool = False) -> float:
    """Forward FLOPs over `tokens` tokens whose mean attention context is `mean_context` (`timed`:
    the experts' counted at their slower rate, `timed_matmul_params`)."""
    params = timed_matmul_params(shape) if timed else matmul_params(shape)
    return tokens * (2 * params + attention_flops_per_token(shape, mean_context))


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> float:
    """KV-cache bytes of one token over all layers (`formulas.kv_cache_bytes`)."""
    return kv_cache_bytes(shape, 1, 1, dtype_bytes)


def link_bandwidth(spec: DeviceSpec, span: int, layout: Layout) -> float:
    """Bytes/s each way per device of a group spanning `span` consecutive devices: NVLink (or
    shared memory) inside one domain and one node, the network beyond."""
    per_node = layout.gpus_per_node or max(1, math.ceil(layout.devices / layout.num_nodes))
    domain = spec.nvlink_domain if spec.nvlink_spans_nodes else min(spec.nvlink_domain, per_node)
    if span <= domain and spec.nvlink_bw:
        return spec.nvlink_bw
    return spec.network_bw if span > 1 else spec.memory_bw


def collective_s(nbytes: float, group: int, spec: DeviceSpec, span: int, layout: Layout, kind: str,
                 calls: float = 1.0) -> float:
    """Seconds of `calls` collectives of `nbytes` each (the full tensor) over `group` devices
    spanning `span`: ring all-reduce moves 2 (g-1)/g of it per device, all-gather, reduce-scatter
    and all-to-all (g-1)/g, a pipeline `send` all of it."""
    if group <= 1 or calls <= 0:
        return 0.0
    # A pipeline stage's send to the next moves the whole tensor once.
    factor = 1.0 if kind == "send" else (2 if kind == "all_reduce" else 1) * (group - 1) / group
    bw = link_bandwidth(spec, span, layout) * EFFICIENCY["link"]
    return calls * (COLLECTIVE_LATENCY_S + factor * nbytes / bw)


# --- the phases -------------------------------------------------------------------------------------

def generation_s(shape: ModelShape, spec: DeviceSpec, layout: Layout, rows: int, prompts: int, lengths: Lengths,
                 dtype_bytes: int, max_new_tokens: int, max_running_rows: Optional[int],
                 kv_budget_bytes: Optional[float], vllm: bool = False) -> tuple[float, str, dict[str, float]]:
    """Seconds to generate `rows` responses to `prompts` distinct prompts on the layout's engines
    (each `gen_tp` devices, rows split evenly); `max_running_rows`: the engine's own cap on rows
    decoding at once (native engine's batch size), `kv_budget_bytes` its KV-cache memory (vLLM), either None."""
    engines, gtp = layout.engines, layout.gen_tp
    rows_per_engine = math.ceil(rows / engines)
    prompts_per_engine = math.ceil(prompts / engines)
    busy = layout.share(layout.gen_devices)
    flops = spec.flops(dtype_bytes) * EFFICIENCY["prefill_mfu"] * gtp * busy
    bandwidth = spec.memory_bw * EFFICIENCY["decode_bandwidth"] * gtp * busy
    prefill = forward_flops(shape, prompts_per_engine * lengths.prompt, lengths.prompt / 2, timed=True) / flops
    kv_row = kv_bytes_per_token(shape, dtype_bytes) * (lengths.prompt + lengths.response)
    running = engine_rows(rows, engines, max_running_rows) if max_running_rows else rows_per_engine
    if kv_budget_bytes is not None:
        running = max(1, min(running, int(kv_budget_bytes * gtp / kv_row)))
    tail = min(EFFICIENCY["decode_tail"] * lengths.response, max_new_tokens)
    # Steps: every row's tokens at `running` rows a step, and the tail the longest rows add at the end.
    waves = math.ceil(rows_per_engine / running)
    steps = min(rows_per_engine * lengths.response / running + max(0.0, tail - lengths.response),
                waves * max_new_tokens)
    batch = rows_per_engine * lengths.response / steps if steps else 0.0  # mean rows decoding per step
    context = lengths.prompt + lengths.response / 2
    weights = timed_matmul_params(shape, experts_touched(shape, batch) if shape.num_experts else None) * dtype_bytes
    step_bytes = weights + batch * context * kv_bytes_per_token(shape, dtype_bytes)
    step_flops = batch * (2 * timed_matmul_params(shape) + attention_flops_per_token(shape, context))
    memory_s, compute_s = step_bytes / bandwidth, step_flops / flops
    # Two all-reduces of the step's hidden states per layer inside a tensor-parallel engine.
    tp_s = collective_s(batch * shape.hidden_size * dtype_bytes, gtp, spec, gtp, layout, "all_reduce",
                        2 * shape.num_layers)
    host_s = EFFICIENCY["vllm_step_s"] if vllm else \
        NATIVE_GPU_LAYER_S * shape.num_layers if layout.gpus_per_node else 0.0
    decode = steps * (max(memory_s, compute_s) + tp_s + host_s)
    bound = "memory" if memory_s >= compute_s else "compute"
    if tp_s > max(memory_s, compute_s):
        bound = "TP all-reduce latency"
    if host_s > max(memory_s, compute_s, tp_s):
        bound = "vLLM host" if vllm else "kernel-launch"
    return prefill + decode, f"decode {bound}-bound, {batch:.0f} rows x {steps:.0f} steps", {
        "decode_steps": steps, "decode_rows": batch, "prefill_s": prefill, "decode_s": decode}


def mesh_collectives_s(shape: ModelShape, spec: DeviceSpec, layout: Layout, tokens_per_rank: float,
                       micro_batches: float, dtype_bytes: int, passes: int) -> dict[str, float]:
    """Seconds of the collectives that do not overlap compute, over `passes` passes through the
    layers (a forward 1; forward and backward 2; with recomputation 3) of `micro_batches`
    micro-batches holding `tokens_per_rank` tokens of one data-parallel rank: tensor parallelism's
    all-reduces of the hidden states (2 per layer and pass), expert parallelism's dispatch and
    combine all-to-alls of each token's k copies (2 per MoE layer and pass), context parallelism's
    ring of keys and values (an all-gather's volume per layer and pass), pipeline stages' sends of
    the hidden states (a micro-batch's forward, and its gradients backward)."""
    tp, ep, cp = layout.tp, layout.ep, layout.cp
    layers = shape.num_layers / layout.pp
    calls = layers * passes * micro_batches
    hidden = tokens_per_rank / micro_batches * shape.hidden_size * dtype_bytes  # one micro-batch's hidden states
    out = {"TP": collective_s(hidden, tp, spec, tp, layout, "all_reduce", 2 * calls)}
    if shape.num_experts:
        out["EP"] = collective_s(hidden * routed_experts_per_token(shape), ep, spec, tp * ep, layout, "all_to_all",
                                 2 * calls)
    kv = tokens_per_rank / micro_batches * kv_bytes_per_token(shape, dtype_bytes) / shape.num_layers
    out["CP"] = collective_s(kv * cp, cp, spec, tp * cp, layout, "all_gather", calls)
    # Pipeline stages hand a micro-batch's hidden states (and, backward, their gradients) to the next.
    out["PP"] = collective_s(hidden, layout.pp, spec, tp * cp * layout.pp, layout, "send",
                             micro_batches * min(passes, 2))
    return {k: v for k, v in out.items() if v}


def policy_pass_s(shape: ModelShape, spec: DeviceSpec, layout: Layout, rows: int, lengths: Lengths,
                  dtype_bytes: int, micro_batches: float, backward: bool, checkpointing: bool,
                  trained_params: float, flushes: int = 1) -> tuple[float, str, dict[str, float]]:
    """Seconds of one pass of the policy over the step's `rows` rows in `micro_batches` micro-batches
    per data-parallel rank: a forward (logprobs) or a forward and backward with the optimizer step
    (`backward`), on the layout's training devices. `flushes`: times the pipeline drains (once per
    optimizer step), each a bubble of (P - 1) micro-batches' time."""
    tokens = rows * (lengths.prompt + lengths.response)
    forwards = (4 if checkpointing else 3) if backward else 1
    flops = forwards * forward_flops(shape, tokens, (lengths.prompt + lengths.response) / 2, timed=True)
    busy = layout.share(layout.train_devices)
    compute = flops / (layout.train_devices * busy * spec.flops(dtype_bytes) * EFFICIENCY["train_mfu"])
    # FSDP over dp x cp: each micro-batch all-gathers the rank's layers (forward, and again for
    # backward) and reduce-scatters fp32 gradients; prefetching overlaps them with compute. Under
    # expert parallelism the routed experts stay whole on their EP rank, outside FSDP
    # (models/policy/expert_parallel.py): their fp32 gradients are all-reduced over the EP groups'
    # replicas once per optimizer step (`flushes`).
    shard_group = layout.dp * layout.cp
    sharded = (shape.num_params - (shape.expert_params if layout.ep > 1 else 0)) / (layout.tp * layout.pp)
    fsdp = collective_s(sharded * dtype_bytes, shard_group, spec, layout.train_devices, layout, "all_gather",
                        micro_batches * (2 if backward else 1))
    if backward:
        fsdp += collective_s(sharded * 4, shard_group, spec, layout.train_devices, layout, "reduce_scatter",
                             micro_batches)
        if layout.ep > 1:
            fsdp += collective_s(shape.expert_params / layout.ep * 4, layout.train_devices // layout.ep, spec,
                                 layout.train_devices, layout, "all_reduce", flushes)
    mesh = mesh_collectives_s(shape, spec, layout, tokens / (layout.dp * layout.cp), micro_batches, dtype_bytes,
                              (3 if checkpointing else 2) if backward else 1)
    bubble = compute * flushes * (layout.pp - 1) / micro_batches if layout.pp > 1 else 0.0
    optimizer = trained_params / layout.train_devices * OPTIMIZER_BYTES_PER_PARAM / (spec.memory_bw * busy) \
        if backward else 0.0
    seconds = max(compute, fsdp) + sum(mesh.values()) + bubble + optimizer
    parts = {"compute": compute, "FSDP": fsdp, **mesh, "pipeline bubble": bubble, "optimizer": optimizer}
    top = max(parts, key=parts.get)
    return seconds, f"{top}-bound" if top != "compute" else "compute-bound", parts


def refit_s(shape: ModelShape, spec: DeviceSpec, layout: Layout, dtype_bytes: int) -> tuple[float, str]:
    """Seconds to move the weights to the engines: each engine device receives its 1/gen_tp share
    in the engine's dtype (colocated: gathered from the FSDP shards over the training group's link;
    separate engines: broadcast over the network), and copies it into place."""
    share = shape.num_params * dtype_bytes / layout.gen_tp
    span = layout.train_devices if layout.colocated else layout.devices
    bw = link_bandwidth(spec, span, layout) * EFFICIENCY["link"]
    if layout.train_devices == 1 and layout.colocated:
        return share / spec.memory_bw, "copy in memory"
    return share / bw + share / spec.memory_bw, "link-bound"


# --- a config's step --------------------------------------------------------------------------------

def micro_batches_per_rank(policy: Any, rows_per_rank: float, tokens_per_row: float, training: bool) -> float:
    """Micro-batches one data-parallel rank runs over its rows in a pass: its tokens over a
    micro-batch's (`formulas.micro_batch_tokens`: the token budget of dynamic batching or packing,
    else the micro-batch size in rows of `tokens_per_row`)."""
    from posttrain.plan.formulas import micro_batch_tokens

    return max(1.0, math.ceil(rows_per_rank * tokens_per_row / micro_batch_tokens(policy, training, tokens_per_row)))


def step_time(cfg: Any, shape: ModelShape, spec: DeviceSpec, lengths: Lengths,
              device_bytes: Optional[float] = None) -> StepTime:
    """The time plan of one step of `cfg`'s on-policy job (GRPO, distillation's student side) on
    devices of `spec`, for rows of `lengths`' mean prompt and response."""
    from posttrain.config.schema import training_precision
    from posttrain.plan.engine import engine_dtype_bytes
    from posttrain.plan.formulas import DTYPE_BYTES
    from posttrain.plan.jobs import logprob_passes, loop_section, validates

    policy, gen = cfg.policy, cfg.policy.generation
    layout = layout_of(cfg)
    section = loop_section(cfg)
    k = section.num_generations_per_prompt
    prompts = section.num_prompts_per_step
    rows = prompts * k
    train_bytes = DTYPE_BYTES[training_precision(cfg)]
    gen_bytes = engine_dtype_bytes(cfg)
    kv_budget = None
    if gen.backend == "vllm" and layout.gpus_per_node and (device_bytes or spec.memory_gb):
        memory = device_bytes or spec.memory_gb * 1e9
        util = gen.vllm_cfg.gpu_memory_utilization or 0.5
        kv_budget = max(memory * util - shape.num_params * gen_bytes / layout.gen_tp, 0.05 * memory)
    max_running = gen.batch_size if gen.backend == "native" else None
    phases, bounds, detail = {}, {}, {}
    phases["generation"], bounds["generation"], gen_detail = generation_s(
        shape, spec, layout, rows, prompts if gen.backend == "vllm" and gen.vllm_cfg.enable_prefix_caching else rows,
        lengths, gen_bytes, gen.max_new_tokens, max_running, kv_budget, gen.backend == "vllm")
    detail.update(gen_detail)
    in_place = layout.train_devices == 1 and layout.colocated and gen.backend == "native" and gen_bytes == train_bytes
    phases["refit"], bounds["refit"] = (0.0, "weights shared in place") if in_place else \
        refit_s(shape, spec, layout, gen_bytes)
    tokens_per_row = lengths.prompt + lengths.response
    rows_per_rank = rows / layout.dp
    passes = logprob_passes(cfg)  # distillation's: planned as the student's forward (teachers' shapes aside)
    if passes:
        mbs = micro_batches_per_rank(policy, rows_per_rank, tokens_per_row, training=False)
        one, bounds["logprobs"], _ = policy_pass_s(shape, spec, layout, rows, lengths, train_bytes, mbs, False,
                                                   False, 0)
        phases["logprobs"] = passes * one
    trained = shape.lora_params if policy.lora.enabled else shape.num_params
    optimizer_steps = max(1, math.ceil(rows / policy.train_global_batch_size))
    mbs = micro_batches_per_rank(policy, rows_per_rank, tokens_per_row, training=True)
    phases["training"], bounds["training"], train_parts = policy_pass_s(
        shape, spec, layout, rows, lengths, train_bytes, mbs, True, policy.activation_checkpointing,
        trained * optimizer_steps, flushes=optimizer_steps)
    detail.update({f"training {key}": value for key, value in train_parts.items()})
    g = getattr(cfg, "grpo", None)
    result = StepTime(phases, bounds, tokens_per_step=rows * tokens_per_row, devices=layout.devices, detail=detail,
                      overlapped=bool(g is not None and g.async_grpo.enabled))
    if validates(cfg):
        val_rows = validation_rows(cfg, section)
        val_k = getattr(section, "val_num_generations_per_prompt", 1)
        result.validation_s, bounds["validation"], _ = generation_s(
            shape, spec, layout, val_rows * val_k, val_rows, lengths, gen_bytes, gen.max_new_tokens,
            max_running, kv_budget, gen.backend == "vllm")
        result.validations_per_step = 1 / section.val_period if section.val_period else 0.0
    return result


def validation_rows(cfg: Any, section: Any) -> int:
    """Validation prompts: `max_val_samples` when set, else the validation split's size when the
    config names it (`data.num_validation`), else one call's `val_batch_size`."""
    for value in (getattr(section, "max_val_samples", None), getattr(cfg.data, "num_validation", None)):
        if value:
            return int(value)
    return section.val_batch_size


def format_step_time(t: StepTime, spec: DeviceSpec, layout: Layout, lengths: Lengths) -> str:
    """The time table: one line per phase (seconds, share of the step, what bounds it), the step,
    tokens/s per device, and the inputs it rests on."""
    kind = "GPU" if layout.gpus_per_node else "process"
    lines = [f"Time plan per step on {layout.devices} x {spec.name} ({lengths.source}: mean prompt "
             f"{lengths.prompt:.0f}, mean response {lengths.response:.0f} tokens):"]
    for phase, seconds in t.phases.items():
        share = f"{seconds / t.step_s:6.1%}" if t.step_s else f"{'':6s}"
        lines.append(f"  {phase:12s} {seconds:10.3f} s  {share}  {t.bounds.get(phase, '')}")
    summed = "max(generation, refit + logprobs + training): async GRPO" if t.overlapped else \
        "generation + refit + logprobs + training"
    lines.append(f"  {'step':12s} {t.step_s:10.3f} s  ({summed})")
    if t.validations_per_step:
        lines.append(f"  {'validation':12s} {t.validation_s:10.3f} s  per validation ({t.bounds.get('validation', '')}); "
                     f"step with validation amortised: {t.step_with_validation_s:.3f} s")
    lines.append(f"  tokens/s per {kind}: {t.tokens_per_s_per_device:,.0f} "
                 f"({t.tokens_per_step:,.0f} prompt + response tokens a step)")
    return "\n".join(lines)
