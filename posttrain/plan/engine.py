"""A generation engine's rows in the memory plan (`add_engine`): its weights and, per decoding
phase, the working memory of one call (`native_engine_bytes`; vLLM's own share). A native engine
decodes at most `policy.generation.batch_size` of a call's rows at once (`engine_rows`), admitting
the others as rows finish (continuous batching, `running_batch.py`): its KV cache holds that many
rows, each `max_new_tokens` columns longer when rows wait (the room compaction needs)."""

from __future__ import annotations

import math
from typing import Any, Optional

from posttrain.config.schema import generation_precision, training_precision
from posttrain.plan.devices import DevicePlan
from posttrain.plan.formulas import (
    CPU_RUNTIME_BYTES, DTYPE_BYTES, GiB, activation_bytes_per_token_layer, kv_cache_bytes, rollout_turns,
)

from posttrain.plan.shape import ModelShape

QUANTIZED = ("int8", "fp8")


def engine_dtype(cfg: Any) -> str:
    """The dtype an engine holds its weights, KV cache and activations in (`GenerationSpec.engine_precision`):
    `policy.generation.precision` when it is float32 or bfloat16, else the trainer's (int8 and fp8
    quantize a copy of the linear layers beside those weights)."""
    precision = generation_precision(cfg)
    return precision if precision not in QUANTIZED else training_precision(cfg)


def engine_dtype_bytes(cfg: Any) -> int:
    return DTYPE_BYTES[engine_dtype(cfg)]


def has_quantized_copy(cfg: Any) -> bool:
    return generation_precision(cfg) in QUANTIZED


def engine_shares_dtype(cfg: Any) -> bool:
    """Whether an engine in the policy's process can hold the policy's own tensors
    (`GenerationWorker.share_weights`): only when its weights have the dtype of the trainer's
    weights, which are float32 masters whatever `policy.precision` (bfloat16 and float16 are
    autocast's compute dtypes): a bfloat16 engine keeps its own 2-byte copy and refit copies into it."""
    return engine_dtype(cfg) == "float32"


def engine_rows(rows_per_call: int, engines: int, batch_size: int) -> int:
    """Rows one engine decodes at once: its share of a call's rows (`Batch.shard` over `engines`),
    at most `batch_size` (`policy.generation.batch_size`) of them."""
    return max(1, min(batch_size, math.ceil(rows_per_call / engines)))


def native_engine_bytes(shape: ModelShape, rows: int, prompts: int, prompt_tokens: int, row_tokens: int,
                        dtype_bytes: int) -> dict[str, float]:
    """Working memory of one native-engine call (`NativeGenerationEngine.generate`) of `rows` rows
    of `row_tokens` cache columns each, whose `prompts` distinct prompts are `prompt_tokens` long:

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


def add_engine(engine: DevicePlan, cfg: Any, shape: ModelShape, c: int, device_bytes: Optional[int], *, weights: bool,
               calls: dict[str, tuple[int, int]], engines: int, row_tokens: int, longest_prompt: Optional[int],
               phases: Optional[tuple[str, ...]] = None, quantized_copy: bool = False) -> None:
    """Add a generation engine's rows to `engine`: its weights of `c` bytes each (unless lent in
    place, `weights` False), and per decoding phase in `calls` (`phase: (rows of one call, rows
    sharing a prompt)`) its working memory in the same dtype; `phases` the engine is resident in
    (default: all of the device's); `quantized_copy`: the int8 / fp8 copy of the linear layers
    beside the weights (`policy.generation.precision`)."""
    gen = cfg.policy.generation
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
    if quantized_copy and gen.backend == "native":
        # One byte per weight of the linear layers outside the embeddings and head (their scales:
        # 4 bytes per output channel or 128x128 block, left out), rebuilt after every refit.
        engine.add(f"{generation_precision(cfg)} copy of the linear layers", shape.num_params - shape.embedding_params,
                   phases)
    if gen.backend == "vllm":
        engine.add("vLLM KV cache (cpu_kv_cache_gb)", gen.vllm_cfg.cpu_kv_cache_gb * GiB, phases)
        return
    # A single-turn prompt is at most the longest prompt; a later turn's holds the conversation so far.
    single_turn = rollout_turns(cfg) == 1
    prompt_tokens = min(longest_prompt, row_tokens) if single_turn and longest_prompt else row_tokens
    for phase, (rows_per_call, group) in calls.items():
        rows = engine_rows(rows_per_call, engines, gen.batch_size)
        waiting = math.ceil(rows_per_call / engines) > rows  # continuous batching: `LlamaLikeDecoder.keep_rows`' room
        cache_tokens = row_tokens + (gen.max_new_tokens if waiting else 0)
        # Rows share their prompt's prefill; later turns of a multi-turn rollout prefill each row's own conversation.
        prompts = math.ceil(rows / group) if single_turn else rows
        for item, nbytes in native_engine_bytes(shape, rows, prompts, prompt_tokens, cache_tokens, c).items():
            engine.add(item, nbytes, (phase,))
    return weights
