"""The memory plan's arithmetic: bytes of parameters, optimizer state, activations, KV caches and
the rows they are planned for, from a `ModelShape` and a config's sizes. Each formula names its source."""

from __future__ import annotations

from typing import Any, Optional

from posttrain.plan.shape import ModelShape
from posttrain.cpu_precision import auto_cpu_precision

GiB = 2**30
MiB = 2**20
# Resident set of one posttrain worker process before any model: Python, torch 2.13 (CPU build),
# transformers and posttrain imported (measured on this project's CPU machine: 350 MiB).
CPU_RUNTIME_BYTES = 350 * MiB
# Resident set of one loaded fast tokenizer per byte of its tokenizer.json, measured (RSS before and
# after `load_tokenizer`): Gemma 3's 33.4 MB file (262,144 tokens) 0.27-0.28 GiB a load, 8.8 per
# byte; SmolLM2's 3.5 MB one 13-45 MiB. Each process loads its own: with the local backend the
# controller, the policy worker and the engine (three in one process).
TOKENIZER_BYTES_PER_FILE_BYTE = 9
# float32 logits tile of the fused logprob kernel (`models/policy/linear_logprobs.py`, TILE_BYTES).
FUSED_LOGPROB_TILE_BYTES = 16 * MiB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def tokenizer_bytes(shape: ModelShape) -> int:
    """Host memory of one loaded tokenizer of `shape`'s model (`TOKENIZER_BYTES_PER_FILE_BYTE`)."""
    return TOKENIZER_BYTES_PER_FILE_BYTE * shape.tokenizer_file_bytes


def compute_dtype_bytes(precision: str, on_gpu: bool) -> int:
    """Bytes per element of the compute dtype: `auto` is bfloat16 on a GPU and on a CPU with bfloat16
    matmul instructions, else float32 (`models/hf.py`, pick_dtype)."""
    if precision == "auto":
        return 2 if on_gpu or auto_cpu_precision()[0] == "bfloat16" else 4
    return DTYPE_BYTES[precision]


def optimizer_state_bytes(trainable: int, name: str, shards: int) -> float:
    """AdamW / Adam keep two float32 moments per trainable parameter (8 bytes: NeMo-RL and verl
    size the optimizer as 2 x fp32 states, Kingma & Ba 2015); SGD without momentum keeps none
    (posttrain's `sgd` has no momentum). FSDP2 shards it over the data-parallel workers."""
    return (8 if name in ("adamw", "adam") else 0) * trainable / shards


def fused_optimizer(cfg: Any) -> bool:
    """Whether the policy's optimizer step is torch's fused Adam / AdamW kernel (one pass per
    parameter, no temporaries): for adam and adamw when one worker holds plain tensors
    (`models/policy/worker.fused_optimizer_kwargs`); FSDP2's DTensors keep torch's default."""
    return cfg.policy.optimizer.name in ("adam", "adamw") and cfg.policy.num_workers == 1


def optimizer_step_bytes(shape: ModelShape, name: str, shards: int, tp: int, trainable_per_rank: float,
                         lora: bool) -> float:
    """Temporaries of an unfused Adam / AdamW step on CPU (Muon's too: its embeddings and head are
    AdamW's, `models/policy/muon.py`), torch's single-tensor loop: for each
    parameter in turn `exp_avg_sq.sqrt()` and its division by the bias correction, two float32
    copies of it, so at the step's peak two copies of the largest tensor this rank holds (FSDP2
    splits it over the data-parallel ranks; under TP the embeddings and head stay whole on each TP
    rank). LoRA trains only the adapters: at most its trainable share. Counted beside the
    activations, which backward has freed by then: an upper bound. SGD (no momentum) makes none."""
    if name not in ("adam", "adamw", "muon"):
        return 0.0
    largest = shape.largest_tensor / max(1, shards // tp if tp > 1 else shards)
    return 2 * 4 * (min(largest, trainable_per_rank) if lora else largest)


def autocast_copy_bytes(shape: ModelShape, dtype_bytes: int, fused_head: bool) -> float:
    """autocast's copies of the float32 weights in the compute dtype (`dtype_bytes` < 4), alive
    from the forward that casts them to the backward that reads them: the decoder layers' weights
    and, without the fused head (whose kernel makes its own, `fused_head_weight_bytes`), the LM
    head's `vocab x hidden`."""
    head = 0 if fused_head else shape.vocab_size * shape.hidden_size
    return dtype_bytes * (shape.num_params - shape.embedding_params + head)


def fused_head_weight_bytes(shape: ModelShape, dtype_bytes: int, trains_head: bool = True,
                            gathered_in_compute_dtype: bool = False) -> float:
    """The output head's weight in the fused logprob kernel's training step (`linear_logprobs`,
    not under pipeline parallelism: `pipeline_rank`'s head), `vocab x hidden` = W elements: below
    float32 the kernel's compute-dtype copy of the float32 weight, saved for backward (dtype x W;
    none when FSDP2 already all-gathered it in the compute dtype, `gathered_in_compute_dtype`);
    its backward's float32 weight-gradient accumulator (4 W) and its cast to the compute dtype
    (dtype x W), alive together at the end of the backward (then autograd casts that back to
    float32 for a float32 parameter). Gemma 3 270M in bfloat16 on one worker: 8 x 262,144 x 640
    bytes = 1.25 GiB. A frozen head (LoRA) has only the copy."""
    weight = shape.vocab_size * shape.hidden_size
    half = dtype_bytes * weight if dtype_bytes < 4 else 0
    copy = 0 if gathered_in_compute_dtype else half
    return copy + (4 * weight + half if trains_head else 0)


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
    """Keys and values of every layer for `sequences` x `seq_len` tokens: 2 x layers x kv_heads x head_dim x dtype per
    token (multi-head latent attention: layers x `shape.kv_cache_width` x dtype, the compressed latent)."""
    width = shape.kv_cache_width or 2 * shape.num_kv_heads * shape.head_dim
    return shape.num_layers * width * dtype_bytes * sequences * seq_len


def micro_batch_tokens(policy: Any, training: bool, row_tokens: Optional[int] = None) -> int:
    """Tokens of one micro-batch: the token budget of dynamic batching or packing when on, else
    rows x `row_tokens` (default `policy.max_total_sequence_length`; an upper bound: a micro-batch
    is cut to its longest row)."""
    for budgeted in (policy.dynamic_batching, policy.sequence_packing):
        if budgeted.enabled:
            return budgeted.train_mb_tokens if training else budgeted.logprob_mb_tokens
    rows = policy.train_micro_batch_size if training else policy.logprob_batch_size
    return rows * (row_tokens or policy.max_total_sequence_length)


def rollout_turns(cfg: Any) -> Optional[int]:
    """Turns per episode at most of a job that rolls out prompts (GRPO, distillation, eval); None for the others."""
    section = next((getattr(cfg, s) for s in ("grpo", "distillation", "eval") if hasattr(cfg, s)), None)
    return None if section is None else section.max_rollout_turns


def longest_row_tokens(cfg: Any, longest_prompt: Optional[int]) -> int:
    """The longest row a job trains on or generates: `policy.max_total_sequence_length`, or, for
    single-turn rollouts (GRPO, distillation, eval), the longest prompt plus
    `policy.generation.max_new_tokens` when that is shorter (a row is a prompt and one response).
    The default job's rows are 9 + 16 tokens against a limit of 64: planning every row 64 tokens
    long put its training activations 2.6x too high."""
    limit = cfg.policy.max_total_sequence_length
    if longest_prompt is None or rollout_turns(cfg) != 1:
        return limit
    return min(limit, longest_prompt + cfg.policy.generation.max_new_tokens)


# The longest prompt in tokens is looked for among this many prompts longest in characters.
PROMPTS_TOKENIZED = 64


def longest_prompt_tokens(cfg: Any, records: Optional[list[dict]] = None) -> Optional[int]:
    """Tokens of the longest prompt a job rolls out as it builds it (chat template and system prompt
    included), found among the `PROMPTS_TOKENIZED` prompts longest in characters of `records`
    (default: read here, the training and validation records, or eval's `eval.split`); None for
    a job without rollouts or when the data cannot be read here (the plan then assumes rows of
    `policy.max_total_sequence_length`)."""
    if rollout_turns(cfg) is None:
        return None
    try:
        from posttrain.data.datasets import load_records
        from posttrain.data.processors import build_prompt_message_log
        from posttrain.environments.registry import env_rows_maker
        from posttrain.models.hf import load_tokenizer

        if records is None:
            splits = (cfg.eval.split,) if hasattr(cfg, "eval") else ("train", "validation")
            records = [r for split in splits for r in load_records(cfg.data, split, env_rows_maker(getattr(cfg, "env", None)))]
        longest = sorted(records, key=lambda r: len(str(r.get("messages") or r.get("prompt", ""))))[-PROMPTS_TOKENIZED:]
        tokenizer = load_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name, cfg.policy.tiny_arch)
        return max(
            sum(len(m["token_ids"]) for m in build_prompt_message_log(
                record, tokenizer, cfg.policy.max_total_sequence_length, use_chat_template=cfg.data.use_chat_template,
                system_prompt=cfg.data.system_prompt, idx=index).message_log)
            for index, record in enumerate(longest))
    except Exception:  # noqa: BLE001 (unreadable data is preflight's to report, not the plan's)
        return None


def per_rank_params(shape: ModelShape, workers: int, tp: int, ep: int = 1) -> float:
    """Parameters one policy rank holds: the decoder layers split over all `workers` (FSDP2 over
    the data-parallel ranks times TP within a layer); under TP (`tp` > 1) the embeddings and LM
    head only over the `workers / tp` data-parallel ranks (whole on every TP rank). Under expert
    parallelism (`ep` > 1) the routed experts are split over the `ep` ranks of an EP group only
    (whole experts, replicated across groups), the rest over all workers."""
    if ep > 1:
        return (shape.num_params - shape.expert_params) / workers + shape.expert_params / ep
    if tp == 1:
        return shape.num_params / workers
    return (shape.num_params - shape.embedding_params) / workers + shape.embedding_params / (workers // tp)


def topk_logits_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, k: int) -> float:
    """The head of a distillation teacher's top-k forward (`forward.microbatch_logits`, then
    `PolicyWorker.get_topk_logits`), N = tokens x vocabulary: the LM head's logits in the compute
    dtype, their float32 upcast (a copy below float32, the same tensor in float32) and its shifted
    copy (`F.pad`) alive together: (dtype + 8) x N below float32, 8 x N in float32; the
    temperature's division and the padding mask each make a float32 copy while the last is alive
    (8 x N); then one float32 copy and the top-k values (float32) and indices (int64) of every token."""
    n = tokens * shape.vocab_size
    return max((dtype_bytes + 8 if dtype_bytes < 4 else 8) * n, 4 * n + 12 * tokens * k)



def pipeline_rank(policy: Any, shape: ModelShape, dp: int, tp: int, dtype_bytes: int, tokens: int,
                  pp_rank: int) -> dict[str, Any]:
    """Under pipeline parallelism (`models/policy/pipeline.py`), what pipeline rank `pp_rank` holds.
    Which rank holds the most depends on the model and the split: the first rank has the input
    embeddings, the most micro-batches in flight under 1F1B and interleaved 1F1B (`pp - rank`) and,
    in an even split, the extra layers; the last has the LM head and the logprob head's working
    memory, which grow with the vocabulary; an uneven `policy.pipeline_layer_split` can make any
    rank the largest. Returns

    - `first`, `last`: whether it holds the first / last stage;
    - `params`: its stages' layers over its `dp` FSDP ranks and `tp` TP ranks, plus the input
      embeddings (first) and the LM head (last), each half of `embedding_params` (pipeline stages
      need them untied), whole on every TP rank, over `dp`;
    - `gathered`: what FSDP keeps all-gathered from a micro-batch's forward to its backward
      (`split_and_shard`: every layer and each chunk's root, reshard_after_forward=False), in fp32:
      its layers' TP shards and its embeddings / head;
    - `layers` (its decoder layers), `in_flight` (stage forwards whose activations it holds at its
      peak, `pipeline_in_flight` for this rank, for `train_global_batch_size / dp` rows in
      micro-batches of `train_micro_batch_size`);
    - `activations` (bytes): each in-flight stage forward keeps its layers' activations (its
      largest local stage's), or with activation checkpointing their inputs, for a micro-batch of
      `tokens`, plus the layer computed in backward;
    - `head` (bytes, last rank only, else 0): the final hidden states the fused chunked lm_head +
      logprob kernel saves (`StageChunk` always takes that path, `linear_logprobs.py`: no
      `[tokens, vocab]` logits) for each micro-batch whose head forward waits for its backward (1
      under 1F1B and interleaved 1F1B, where the last stage turns each forward straight into its
      backward; every micro-batch under GPipe) plus its float32 tile (`head_bytes`), and its
      backward's float32 `[vocab, hidden]` weight-gradient accumulator (and its cast to the compute
      dtype below float32), alive while every saved activation still is."""
    from posttrain.models.parallel_sizes import (
        local_stages, microbatches_needed, pipeline_in_flight, stage_layer_counts,
    )

    pp, virtual = policy.pipeline_parallel_size, policy.pipeline_stages_per_worker
    num_stages = pp * virtual
    counts = stage_layer_counts(shape.num_layers, num_stages, policy.pipeline_layer_split)
    stages = local_stages(pp_rank, pp, virtual)
    first, last = 0 in stages, num_stages - 1 in stages
    layers = sum(counts[s] for s in stages)
    layer_params = (shape.num_params - shape.embedding_params) * layers / shape.num_layers / tp
    ends = shape.embedding_params / 2 * (first + last)  # input embeddings, LM head
    microbatches = -(-(policy.train_global_batch_size // dp) // policy.train_micro_batch_size)
    needed = microbatches_needed(microbatches, policy.pipeline_schedule, pp, num_stages)
    in_flight = pipeline_in_flight(policy.pipeline_schedule, pp, virtual, needed, pp_rank)
    per_layer = activation_bytes_per_token_layer(shape, dtype_bytes, tp)
    kept = dtype_bytes * shape.hidden_size if policy.activation_checkpointing else per_layer
    working = 2 * per_layer if policy.activation_checkpointing else per_layer
    activations = tokens * (in_flight * max(counts[s] for s in stages) * kept + working)
    head = 0.0
    if last:
        waiting = needed if policy.pipeline_schedule == "gpipe" else 1
        weight = shape.vocab_size * shape.hidden_size
        head = (head_bytes(shape, tokens, dtype_bytes, fused_logprobs=True, backward=True)
                + (waiting - 1) * tokens * dtype_bytes * shape.hidden_size
                + (4 + (dtype_bytes if dtype_bytes < 4 else 0)) * weight)
    return dict(first=first, last=last, params=(layer_params + ends) / dp, gathered=4 * (layer_params + ends),
                layers=layers, in_flight=in_flight, activations=activations, head=head)
