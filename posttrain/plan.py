"""A memory plan before launch: what each GPU (or CPU worker process) holds in each phase of a
job, from the model's config alone (no weights are loaded), and whether that fits.

    posttrain plan --config my.yaml policy.num_workers=8      # prints the table, exit 2 if it cannot fit

`model_shape` reads the model's config (config.json of `policy.model_name`, or the config of a
built-in preset) and counts the parameters by building the model on torch's meta device (exact
for any architecture, no memory). Everything else is arithmetic on that shape and the config:
`memory_plan` returns a `Plan` (rows of bytes per device and phase), `fit_problem` checks it
against the device memory and names the config keys that would make it fit.

Phases, as a colocated GRPO step runs them (NeMo-RL's step, reference notes "Refit" and
"Inside policy.train"): generation (the engine decodes; colocated on GPUs the policy's weights and
optimizer state are in host memory then, `policy.offload_during_generation`; weights lent in place
to the engine stay), refit (the policy's weights go to the engine in
`policy.refit_buffer_size_gb` buckets, one at a time), logprobs (forward passes without gradients)
and training (forward and backward, then the optimizer step). With split placement the
generation engine has devices of its own (`policy.generation.colocated.enabled=false`).

What is and is not counted: allocator bytes of tensors (what `torch.cuda.max_memory_allocated`
reports) plus, on CPU, the interpreter with torch and transformers imported (`CPU_RUNTIME_BYTES`);
not the CUDA context (about 0.5-1 GiB per process, outside torch's allocator), fragmentation,
or temporary buffers of the optimizer step. The check keeps `HEADROOM` of the device free for those.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

GiB = 2**30
MiB = 2**20
# Resident set of one posttrain worker process before any model: Python, torch 2.13 (CPU build),
# transformers and posttrain imported (measured on this project's CPU machine: 350 MiB).
CPU_RUNTIME_BYTES = 350 * MiB
# A plan must leave this share of the device free (CUDA context, fragmentation, optimizer temporaries).
HEADROOM = 0.10
# float32 logits tile of the fused logprob kernel (`models/policy/linear_logprobs.py`, TILE_BYTES).
FUSED_LOGPROB_TILE_BYTES = 16 * MiB
PHASES = ("generation", "refit", "logprobs", "training")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know of a decoder-only model (from its HF config)."""

    num_params: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # MLP width (per expert for mixtures of experts)
    num_experts: int = 0  # 0: dense
    experts_per_token: int = 0
    largest_tensor: int = 0  # elements of the largest parameter (one refit bucket must hold it)
    lora_params: int = 0  # adapter parameters with the configured policy.lora (0 without LoRA)
    embedding_params: int = 0  # input embeddings and LM head (once if tied): whole on every TP rank


def shape_from_hf_config(config: dict, num_params: int, largest_tensor: int = 0, lora_params: int = 0,
                         embedding_params: Optional[int] = None) -> ModelShape:
    """`ModelShape` from a Hugging Face config dict (config.json's keys; llama / qwen / mixtral names).
    `embedding_params` (default: vocabulary x hidden, twice unless `tie_word_embeddings`) are the
    embeddings' and LM head's elements, which tensor parallelism leaves whole."""
    hidden = config["hidden_size"]
    if embedding_params is None:
        embedding_params = config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2)
    heads = config["num_attention_heads"]
    experts = config.get("num_local_experts") or config.get("num_experts") or 0
    return ModelShape(
        num_params=num_params, hidden_size=hidden, num_layers=config["num_hidden_layers"],
        vocab_size=config["vocab_size"], num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        intermediate_size=(config.get("moe_intermediate_size") if experts and config.get("moe_intermediate_size")
                           else config["intermediate_size"]),
        num_experts=experts, experts_per_token=config.get("num_experts_per_tok") or 0 if experts else 0,
        largest_tensor=largest_tensor, lora_params=lora_params, embedding_params=embedding_params,
    )


def model_shape(policy: Any) -> ModelShape:
    """Shape of `policy.model_name` (its config.json; a preset's config): the parameters are counted
    on torch's meta device, so nothing is allocated and no weights are read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.models.hf import parse_tiny_name, resolve_model_path

    tiny = parse_tiny_name(policy.model_name, policy.tiny_arch)
    if tiny is not None:
        from posttrain.models.tiny import tiny_config

        hf_config = tiny_config(*tiny)
    else:
        from posttrain.models.paths import checkpoint_policy_dir

        # A training checkpoint (`step_N`, which every job accepts as a model) keeps its HF config
        # beside the sharded weights (`models/policy/checkpoint.py`, HF_DIR).
        checkpoint = checkpoint_policy_dir(Path(policy.model_name).expanduser())
        path = str(checkpoint / "hf") if checkpoint is not None else resolve_model_path(policy.model_name,
                                                                                       policy.tiny_arch)
        hf_config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    params = list(model.parameters())
    lora = 0
    if policy.lora.enabled:
        targets = set(policy.lora.target_modules)
        lora = sum(policy.lora.dim * (m.in_features + m.out_features) for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets)
    heads = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())
             if m is not None}  # one entry when tied
    return shape_from_hf_config(json.loads(hf_config.to_json_string()), sum(p.numel() for p in params),
                                max(p.numel() for p in params), lora, sum(heads.values()))


@dataclass
class DevicePlan:
    """Bytes one device (a GPU, or a CPU worker process) holds: `rows[item][phase]`."""

    name: str
    rows: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, item: str, nbytes: float, phases: tuple[str, ...] = PHASES) -> None:
        for phase in phases:
            self.rows.setdefault(item, {})[phase] = self.rows.get(item, {}).get(phase, 0) + int(nbytes)

    def phase_total(self, phase: str) -> int:
        return sum(row.get(phase, 0) for row in self.rows.values())

    def peak(self) -> tuple[str, int]:
        """(phase, bytes) of the phase that needs the most."""
        return max(((p, self.phase_total(p)) for p in PHASES), key=lambda pair: pair[1])


@dataclass
class Plan:
    """The devices of one job (one of each kind: every policy device holds the same) and the
    memory each has (None: unknown)."""

    devices: list[DevicePlan]
    device_bytes: Optional[int]
    on_gpu: bool
    process_counts: list[int]  # how many of each device kind the job has
    num_nodes: int = 1
    row_tokens: Optional[int] = None  # the longest row planned for (`longest_row_tokens`)
    longest_prompt: Optional[int] = None  # tokens of the longest training prompt, when known

    def node_peak(self) -> int:
        """GPU: the largest device peak; CPU: the sum of the peaks of one node's processes (a
        kind's processes spread evenly over `num_nodes`)."""
        if self.on_gpu:
            return max(d.peak()[1] for d in self.devices)
        return sum(d.peak()[1] * math.ceil(count / self.num_nodes) for d, count in zip(self.devices, self.process_counts))


# ------------------------------------------------------------------------------------- formulas
def compute_dtype_bytes(precision: str, on_gpu: bool) -> int:
    """Bytes per element of the compute dtype: `auto` is bfloat16 on a GPU, float32 on CPU (`models/hf.py`, pick_dtype)."""
    if precision == "auto":
        return 2 if on_gpu else 4
    return DTYPE_BYTES[precision]


def optimizer_state_bytes(trainable: int, name: str, shards: int) -> float:
    """AdamW / Adam keep two float32 moments per trainable parameter (8 bytes: NeMo-RL and verl
    size the optimizer as 2 x fp32 states, Kingma & Ba 2015); SGD without momentum keeps none
    (posttrain's `sgd` has no momentum). FSDP2 shards it over the data-parallel workers."""
    return (8 if name in ("adamw", "adam") else 0) * trainable / shards


def activation_bytes_per_token_layer(shape: ModelShape, dtype_bytes: int, tp: int = 1, sp: bool = False) -> float:
    """Saved activations of one decoder layer per token, for backward (Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", section 4.1, redone for a
    pre-norm RMSNorm / RoPE / SwiGLU / grouped-query decoder as transformers runs it, without
    dropout and with a fused (SDPA / flash) attention kernel, so no sequence x sequence scores):

    - attention (q = heads x head_dim, kv = kv_heads x head_dim): the norm's input and output
      (2h); RoPE keeps q and k and their rotate_half copies (2q + 2kv); the kernel's inputs, the
      rotated queries and keys and values expanded to the query heads (3q: transformers' repeat_kv
      copies them when a mask is passed; without grouping they are k and v themselves), its output
      and o_proj's contiguous input (2q): 2h + 7q + 2kv;
    - MLP: the norm's input and output (2h), gate and up projections, the activation and the
      product that down_proj reads (4 x intermediate); a mixture of experts keeps that for each of
      the top-k experts of a token, plus the router logits (experts, float32).

    Below float32 the RMSNorm upcasts its input to float32 (2 x 4h bytes more).

    Per tensor-parallel rank (`tp` > 1, Korthikanti et al. 2022, section 4.2.2): the heads' and the
    MLP width's activations divide by `tp`; the norms' inputs and outputs (the 2h terms and the
    upcast) only with sequence parallelism (`sp`), which splits them by sequence. MoE experts stay
    whole under posttrain's TP, so do their activations."""
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    norms = 1 / tp if sp else 1.0
    attention = 2 * h * norms + (7 * q + 2 * kv) / tp
    if shape.num_experts:
        mlp = 2 * h * norms + shape.experts_per_token * (h + 4 * shape.intermediate_size)
        router = 4 * shape.num_experts
    else:
        mlp, router = 2 * h * norms + 4 * shape.intermediate_size / tp, 0
    upcast = 8 * h * norms if dtype_bytes < 4 else 0
    return dtype_bytes * (attention + mlp) + router + upcast


def training_activation_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, checkpointing: bool,
                              fused_logprobs: bool, tp: int = 1, sp: bool = False) -> float:
    """Activations of one training micro-batch of `tokens` tokens.

    Without checkpointing every layer keeps its activations until backward, plus one layer's worth
    of gradients in flight. With activation checkpointing (recompute each layer in backward) only
    each layer's input is kept (h per token per layer), plus one layer recomputed and its
    gradients (Korthikanti et al. 2022, section 4.2: full recomputation keeps 2sbh per layer in 16-bit).
    The head: with fused logprobs a float32 tile of `FUSED_LOGPROB_TILE_BYTES` and the final hidden
    states; otherwise the [tokens, vocab] logits in float32, their log-softmax and its gradient (3 copies).
    Under tensor parallelism (`tp`, `sp`: see `activation_bytes_per_token_layer`) a checkpointed
    layer's input is split only with sequence parallelism; the head is whole on every rank.
    """
    per_layer = activation_bytes_per_token_layer(shape, dtype_bytes, tp, sp)
    if checkpointing:
        layers = shape.num_layers * dtype_bytes * shape.hidden_size / (tp if sp else 1) + 2 * per_layer
    else:
        layers = (shape.num_layers + 1) * per_layer
    return tokens * layers + head_bytes(shape, tokens, dtype_bytes, fused_logprobs, backward=True)


def head_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, fused_logprobs: bool, backward: bool) -> float:
    """The output head's working memory (see `training_activation_bytes`)."""
    if fused_logprobs:
        return FUSED_LOGPROB_TILE_BYTES + tokens * dtype_bytes * shape.hidden_size
    return (3 if backward else 2) * 4 * tokens * shape.vocab_size


def logprob_activation_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, fused_logprobs: bool,
                             tp: int = 1, sp: bool = False) -> float:
    """A forward without gradients keeps one layer's activations at a time (nothing is saved for backward)."""
    return tokens * activation_bytes_per_token_layer(shape, dtype_bytes, tp, sp) + head_bytes(
        shape, tokens, dtype_bytes, fused_logprobs, backward=False)


def ring_attention_block_bytes(shape: ModelShape, tokens: int, seq_len: int, cp: int) -> float:
    """Context parallelism's working memory in one attention layer when the ring computes its
    blocks with the float32 matmul fallback (CUDA in float32; models/policy/attention_blocks.py):
    the backward holds a block's scores, probabilities and their gradient, 3 copies of
    `rows x heads x (seq_len / cp)^2`, rows = tokens / seq_len. The fused kernels (CPU, and CUDA in
    bf16/fp16) tile the scores and need none of it. 0 without CP."""
    if cp == 1:
        return 0.0
    seq_len = min(tokens, seq_len)
    return 3 * 4 * (tokens // seq_len) * shape.num_heads * (seq_len / cp) ** 2


def kv_cache_bytes(shape: ModelShape, sequences: int, seq_len: int, dtype_bytes: int) -> float:
    """Keys and values of every layer for `sequences` x `seq_len` tokens: 2 x layers x kv_heads x head_dim x dtype per token."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes * sequences * seq_len


def micro_batch_tokens(policy: Any, training: bool, row_tokens: Optional[int] = None) -> int:
    """Tokens of one micro-batch: the token budget of dynamic batching or packing when on, else
    rows x `row_tokens` (default `policy.max_total_sequence_length`; an upper bound: a micro-batch
    is cut to its longest row)."""
    for budgeted in (policy.dynamic_batching, policy.sequence_packing):
        if budgeted.enabled:
            return budgeted.train_mb_tokens if training else budgeted.logprob_mb_tokens
    rows = policy.train_micro_batch_size if training else policy.logprob_batch_size
    return rows * (row_tokens or policy.max_total_sequence_length)


def longest_row_tokens(cfg: Any, longest_prompt: Optional[int]) -> int:
    """The longest row a job trains on: `policy.max_total_sequence_length`, or, for single-turn
    RL, the longest prompt plus `policy.generation.max_new_tokens` when that is shorter (a row is a
    prompt and one response). The default job's rows are 9 + 16 tokens against a limit of 64:
    planning every row 64 tokens long put its training activations 2.6x too high."""
    limit = cfg.policy.max_total_sequence_length
    grpo = getattr(cfg, "grpo", None)
    if longest_prompt is None or grpo is None or grpo.max_rollout_turns != 1:
        return limit
    return min(limit, longest_prompt + cfg.policy.generation.max_new_tokens)


# The longest prompt in tokens is looked for among this many prompts longest in characters.
PROMPTS_TOKENIZED = 64


def longest_prompt_tokens(cfg: Any, records: Optional[list[dict]] = None) -> Optional[int]:
    """Tokens of the longest training prompt as the job builds it (chat template and system prompt
    included), found among the `PROMPTS_TOKENIZED` prompts longest in characters of `records`
    (default: the training records, read here); None when the data cannot be read here (the plan
    then assumes rows of `policy.max_total_sequence_length`)."""
    if getattr(cfg, "grpo", None) is None:
        return None
    try:
        from posttrain.data.datasets import load_records
        from posttrain.data.processors import build_prompt_message_log
        from posttrain.environments.registry import env_rows_maker
        from posttrain.models.hf import load_tokenizer

        if records is None:
            records = load_records(cfg.data, "train", env_rows_maker(getattr(cfg, "env", None)))
        longest = sorted(records, key=lambda r: len(str(r.get("messages") or r.get("prompt", ""))))[-PROMPTS_TOKENIZED:]
        tokenizer = load_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name, cfg.policy.tiny_arch)
        return max(
            sum(len(m["token_ids"]) for m in build_prompt_message_log(
                record, tokenizer, cfg.policy.max_total_sequence_length, use_chat_template=cfg.data.use_chat_template,
                system_prompt=cfg.data.system_prompt, idx=index).message_log)
            for index, record in enumerate(longest))
    except Exception:  # noqa: BLE001 (unreadable data is preflight's to report, not the plan's)
        return None


# ----------------------------------------------------------------------------------------- plan
def memory_plan(cfg: Any, shape: ModelShape, device_bytes: Optional[int] = None,
                longest_prompt: Optional[int] = None) -> Plan:
    """What each device holds in each phase for `cfg` (a validated master config) and `shape`;
    `longest_prompt` (tokens, default None: unknown) bounds RL rows (`longest_row_tokens`)."""
    from posttrain.config.schema import resolve_backend
    from posttrain.models.policy.offload import offloads_during_generation
    from posttrain.models.refit import MAX_BUCKET_BYTES

    policy, gen = cfg.policy, cfg.policy.generation
    on_gpu = cfg.cluster.gpus_per_node > 0
    c = compute_dtype_bytes(policy.precision, on_gpu)
    shards, tp, sp = policy.num_workers, policy.tensor_parallel_size, policy.sequence_parallel
    cp = policy.context_parallel_size  # CP ranks hold 1/cp of every row's tokens
    dp = shards // tp
    trainable = shape.lora_params if policy.lora.enabled else shape.num_params  # LoRA is refused under TP
    colocated = gen.colocated.enabled
    local = not on_gpu and resolve_backend(cfg) == "local"
    has_generation = hasattr(cfg, "grpo") or hasattr(cfg, "teacher")
    kl = getattr(getattr(cfg, "loss_fn", None), "reference_policy_kl_penalty", 0) > 0
    row_tokens = longest_row_tokens(cfg, longest_prompt)

    # Offloaded while the engine generates (models/policy/offload.py): the training state is not on
    # the device in the generation phase, except weights lent in place to a native engine in the
    # policy's own process (the local backend with one worker), which are the engine's.
    offloaded = has_generation and offloads_during_generation(policy, on_gpu)
    lends_weights = (resolve_backend(cfg) == "local" and colocated and gen.backend == "native" and shards == 1
                     and not policy.lora.enabled)
    resident = tuple(p for p in PHASES if p != "generation") if offloaded else PHASES
    trainer = DevicePlan("policy worker" + (" (+ generation)" if colocated and has_generation else ""))
    if not on_gpu:
        trainer.add("runtime (python, torch)", CPU_RUNTIME_BYTES)
    # Master weights are float32 (autocast computes in policy.precision), sharded by FSDP2 over the
    # data-parallel ranks; tensor parallelism also splits the decoder layers over its `tp` ranks,
    # not the embeddings and LM head. FSDP2 all-gathers one layer ahead while it computes one (2
    # layers' TP shards in float32). Context parallel ranks are FSDP shards too (over dp x cp).
    per_rank = per_rank_params(shape, shards, tp)
    trainer.add("policy parameters (fp32)", 4 * per_rank, PHASES if lends_weights else resident)
    if dp > 1:
        trainer.add("FSDP all-gathered layers", 2 * 4 * (shape.num_params - shape.embedding_params * (tp > 1))
                    / shape.num_layers / tp, ("refit", "logprobs", "training"))
    trainable_per_rank = trainable / shards if policy.lora.enabled else per_rank
    trainer.add("gradients (fp32)", 4 * trainable_per_rank, ("training",))
    trainer.add(f"optimizer state ({policy.optimizer.name})",
                optimizer_state_bytes(trainable_per_rank, policy.optimizer.name, 1), resident)
    trainer.add("activations" + (" (checkpointed)" if policy.activation_checkpointing else ""),
                training_activation_bytes(shape, micro_batch_tokens(policy, True, row_tokens) // cp, c,
                                          policy.activation_checkpointing, policy.fused_logprobs, tp, sp), ("training",))
    trainer.add("logprob forward", logprob_activation_bytes(shape, micro_batch_tokens(policy, False, row_tokens) // cp, c,
                                                             policy.fused_logprobs, tp, sp), ("logprobs",))
    if cp > 1 and on_gpu and c == 4:  # no fused CUDA kernel for float32 blocks (attention_blocks.block_kernel)
        trainer.add("ring attention blocks (fp32)", ring_attention_block_bytes(
            shape, micro_batch_tokens(policy, True), policy.max_total_sequence_length, cp), ("training",))
    if kl and not on_gpu:  # the reference copy is this rank's fp32 shard in host memory (policy worker)
        trainer.add("reference model (fp32, host)", 4 * per_rank)

    devices, counts = [trainer], [shards]
    critic = getattr(cfg, "critic", None)
    if critic is not None:  # PPO's value model: the policy's shape (no LM head), FSDP2 over its own workers
        workers = shards if critic.colocated else critic.num_workers or shards
        # A process of its own, except colocated on a GPU (it shares the policy's) or in this one (local).
        own = not critic.colocated or not (on_gpu or local)
        holder = DevicePlan("critic worker") if own else trainer
        optimizer = (critic.optimizer or policy.optimizer).name
        holder.add("critic parameters (fp32)", 4 * shape.num_params / workers, resident)
        holder.add(f"critic optimizer state ({optimizer})", optimizer_state_bytes(shape.num_params, optimizer, workers),
                   resident)
        # Sharing a device, its gradients and activations come and go while the policy's are freed
        # (one trains after the other), so the policy's rows bound them; in a process of its own they count.
        if own:
            devices.append(holder)
            counts.append(workers)
            if not on_gpu:
                holder.add("runtime (python, torch)", CPU_RUNTIME_BYTES)
            holder.add("critic gradients (fp32)", 4 * shape.num_params / workers, ("training",))
            holder.add("critic activations", training_activation_bytes(
                shape, micro_batch_tokens(policy, True, row_tokens), c, policy.activation_checkpointing, True),
                ("training",))
    if has_generation:
        engine = trainer if colocated else DevicePlan("generation worker")
        if not colocated:
            devices.append(engine)
            counts.append(gen.colocated.num_workers or 1)
            if not on_gpu:
                engine.add("runtime (python, torch)", CPU_RUNTIME_BYTES)
        # Unset, the bucket is a share of free memory at run time, at most MAX_BUCKET_BYTES: plan for that most.
        bucket = policy.refit_buffer_size_gb * GiB if policy.refit_buffer_size_gb else MAX_BUCKET_BYTES
        refit_bucket = min(bucket, c * shape.num_params) + c * shape.largest_tensor
        engine_phases = ("generation", "refit") if colocated else PHASES
        if gen.backend == "vllm" and on_gpu:
            util = gen.vllm_cfg.gpu_memory_utilization
            share = util * device_bytes if device_bytes else 0
            # vLLM takes gpu_memory_utilization of the whole GPU for its weights and KV cache; asleep
            # (colocated, level 1) while the policy trains.
            engine.add(f"vLLM weights + KV cache ({util:g} of the GPU)", share, engine_phases)
        else:
            # One unsharded policy worker lends its weights to the engine in its process (no copy).
            in_place = local and colocated and gen.backend == "native" and shards == 1
            if not in_place:
                if not on_gpu and gen.backend == "vllm":
                    engine.add("vLLM runtime", CPU_RUNTIME_BYTES, engine_phases)
                engine.add("generation weights", c * shape.num_params, engine_phases)
            if gen.backend == "vllm":
                engine.add("vLLM KV cache (cpu_kv_cache_gb)", gen.vllm_cfg.cpu_kv_cache_gb * GiB, engine_phases)
            else:
                engine.add("KV cache", kv_cache_bytes(shape, gen.batch_size, policy.max_total_sequence_length, c),
                           ("generation",))
            if in_place:
                refit_bucket = 0
        if refit_bucket:
            trainer.add("refit bucket (send)", refit_bucket, ("refit",))
            engine.add("refit bucket (receive)", refit_bucket, ("refit",))
    return Plan(devices, device_bytes, on_gpu, counts, cfg.cluster.num_nodes, row_tokens, longest_prompt)


def detect_device_bytes(cfg: Any) -> Optional[int]:
    """Memory of one device: `cluster.gpu_memory_gb` / `cluster.host_memory_gb` when set, else
    torch.cuda's first device (GPU jobs) or this machine's RAM (CPU jobs); None when unknown."""
    if cfg.cluster.gpus_per_node > 0:
        if cfg.cluster.gpu_memory_gb is not None:
            return int(cfg.cluster.gpu_memory_gb * GiB)
        import torch

        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    if cfg.cluster.host_memory_gb is not None:
        return int(cfg.cluster.host_memory_gb * GiB)
    import psutil

    return psutil.virtual_memory().total


def per_rank_params(shape: ModelShape, workers: int, tp: int) -> float:
    """Parameters one policy rank holds: the decoder layers split over all `workers` (FSDP2 over
    the data-parallel ranks times TP within a layer); under TP (`tp` > 1) the embeddings and LM
    head only over the `workers / tp` data-parallel ranks (whole on every TP rank)."""
    if tp == 1:
        return shape.num_params / workers
    return (shape.num_params - shape.embedding_params) / workers + shape.embedding_params / (workers // tp)


def fits(plan: Plan) -> bool:
    """True when the plan's peak stays under (1 - HEADROOM) of the device memory (or it is unknown)."""
    return plan.device_bytes is None or plan.node_peak() <= (1 - HEADROOM) * plan.device_bytes


def candidate_fixes(cfg: Any, shape: Optional[ModelShape] = None) -> list[tuple[str, Any]]:
    """(key=value, changed config) pairs worth trying, one change each; tensor parallel sizes
    only where they divide `shape`'s heads, key/value heads and MLP width (and the workers)."""
    policy, gen = cfg.policy, cfg.policy.generation
    fixes: list[tuple[str, Any]] = []

    def variant(key: str, value: Any) -> None:
        changed = cfg.model_copy(deep=True)
        *path, leaf = key.split(".")
        node = changed
        for part in path:
            node = getattr(node, part)
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
        if gen.backend == "vllm" and gen.colocated.enabled:
            for util in (0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2):
                if util < gen.vllm_cfg.gpu_memory_utilization:
                    variant("policy.generation.vllm_cfg.gpu_memory_utilization", util)
    if not policy.lora.enabled:
        variant("policy.lora.enabled", True)
    if gen.backend == "native":
        smaller = gen.batch_size // 2
        while smaller >= 1:
            variant("policy.generation.batch_size", smaller)
            smaller //= 2
    return fixes


def fit_problem(cfg: Any, shape: ModelShape, plan: Plan) -> Optional[str]:
    """None when `plan` fits; else one line: the need, the memory, and the single changes that fit
    (for each key, the first value tried that fits: the mildest change)."""
    if fits(plan):
        return None
    where = "per GPU" if plan.on_gpu else "on this node"
    need = f"needs {plan.node_peak() / GiB:.2f} GiB {where} but {(1 - HEADROOM) * plan.device_bytes / GiB:.2f} GiB " \
           f"is usable ({1 - HEADROOM:.0%} of {plan.device_bytes / GiB:.2f} GiB)"
    found: dict[str, str] = {}
    for change, changed in candidate_fixes(cfg, shape):
        key = change.split("=", 1)[0]
        if key not in found and fits(memory_plan(changed, shape_for(changed, shape), plan.device_bytes,
                                                            plan.longest_prompt)):
            found[key] = change
    advice = ("it would fit with any one of: " + ", ".join(found.values())) if found else \
        "no single change of policy.activation_checkpointing, micro-batch sizes, policy.num_workers, " \
        "policy.tensor_parallel_size, policy.precision, policy.lora.enabled or generation settings makes it fit"
    return f"memory plan: {plan.devices[0].peak()[0]} {need}; {advice}"


def shape_for(cfg: Any, shape: ModelShape) -> ModelShape:
    """`shape` with LoRA's adapter count estimated when a fix turns LoRA on (rank x (in + out) for
    each attention projection of each layer, the default target modules)."""
    if not cfg.policy.lora.enabled or shape.lora_params:
        return shape
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_layer = (h + q) + 2 * (h + kv) + (q + h)
    return ModelShape(**{**shape.__dict__, "lora_params": cfg.policy.lora.dim * per_layer * shape.num_layers})


def format_plan(plan: Plan) -> str:
    """The plan as a table: one block per device kind, a row per item, a column per phase (GiB)."""
    lines = []
    for device, count in zip(plan.devices, plan.process_counts):
        kind = "GPU" if plan.on_gpu else "process"
        lines.append(f"{device.name} (x{count}), GiB per {kind}:")
        lines.append(f"  {'':34s}" + "".join(f"{p:>12s}" for p in PHASES))
        for item, phases in device.rows.items():
            lines.append(f"  {item:34s}" + "".join(f"{phases.get(p, 0) / GiB:12.3f}" for p in PHASES))
        lines.append(f"  {'total':34s}" + "".join(f"{device.phase_total(p) / GiB:12.3f}" for p in PHASES))
    memory = "unknown (set cluster.gpu_memory_gb)" if plan.device_bytes is None else f"{plan.device_bytes / GiB:.2f} GiB"
    scope = "per GPU" if plan.on_gpu else "on the node (all processes)"
    if plan.row_tokens:
        prompt = f" (longest prompt {plan.longest_prompt} + max_new_tokens)" if plan.longest_prompt else ""
        lines.append(f"activations planned for rows of {plan.row_tokens} tokens{prompt}")
    lines.append(f"peak {scope}: {plan.node_peak() / GiB:.3f} GiB; memory: {memory}; "
                 f"{'fits' if fits(plan) else 'does not fit'} (keeping {HEADROOM:.0%} free)")
    return "\n".join(lines)


def check_memory(cfg: Any, shape: Optional[ModelShape] = None,
                 train_records: Optional[list[dict]] = None) -> tuple[Plan, Optional[str]]:
    """The plan of `cfg` on the devices it will get, and why it cannot fit (None if it can);
    `train_records`: the training records when the caller has read them (default: read here)."""
    shape = shape or model_shape(cfg.policy)
    plan = memory_plan(cfg, shape, detect_device_bytes(cfg), longest_prompt_tokens(cfg, train_records))
    return plan, fit_problem(cfg, shape, plan)

