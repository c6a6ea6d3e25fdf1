"""Whether a model's sizes split over a tensor-parallel group, its experts over an expert-parallel
one, and its config into pipeline stages (no torch: config checks and preflight call them in
milliseconds; `models/policy/parallel.py`, `expert_parallel.py` and `pipeline.py` apply the splits)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

# Sizes that tensor parallelism divides between the ranks of a TP group: attention q/k/v are split
# by heads, the dense MLP's gate/up/down by the intermediate width. Embeddings, norms, the LM head
# and mixture-of-experts experts stay whole on every rank, so their sizes need not divide.
TP_SPLIT_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def tensor_parallel_problem(sizes: Mapping[str, Optional[int]], tp_size: int, model_key: str) -> Optional[str]:
    """One line saying which of `sizes` (a model config's `TP_SPLIT_KEYS`; None values are
    skipped) `tp_size` does not divide, naming `model_key` (the config key of the model) and
    `policy.tensor_parallel_size`; None when all split."""
    if tp_size == 1:
        return None
    bad = [f"{key}={sizes[key]}" for key in TP_SPLIT_KEYS if sizes.get(key) and sizes[key] % tp_size]
    if not bad:
        return None
    return (f"policy.tensor_parallel_size={tp_size} does not divide the model's {', '.join(bad)} "
            f"({model_key}); pick a tensor_parallel_size that divides them")


# ------------------------------------------------------------------------------ pipeline stages
def stage_layer_counts(num_layers: int, num_stages: int, split: Optional[list[int]] = None) -> list[int]:
    """Decoder layers per stage: `split` when given (checked), else even with the first
    `num_layers % num_stages` stages one layer more. Raises ValueError naming the key."""
    if split is not None:
        if len(split) != num_stages or sum(split) != num_layers or min(split) < 1:
            raise ValueError(f"policy.pipeline_layer_split={split} must give {num_stages} stages (pipeline_parallel_size "
                             f"* virtual stages) of at least one layer each, {num_layers} layers in all")
        return list(split)
    if num_layers < num_stages:
        raise ValueError(f"policy.pipeline_parallel_size: the model's {num_layers} layers cannot fill {num_stages} "
                         "pipeline stages (pipeline_parallel_size * virtual stages)")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def stage_layers(counts: list[int]) -> list[list[int]]:
    """The layer indices of each stage, in order."""
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [list(range(start, start + n)) for start, n in zip(starts, counts)]


def local_stages(pp_rank: int, pp_size: int, virtual: int) -> list[int]:
    """The stages pipeline rank `pp_rank` holds (loop placement: stage s on rank s % pp)."""
    return [pp_rank + v * pp_size for v in range(virtual)]


def microbatches_needed(count: int, schedule: str, pp_size: int, num_stages: int) -> int:
    """The micro-batch count the schedule runs for `count` real ones: 1F1B needs at least the
    stage count, interleaved 1F1B a multiple of `pp_size` (torch's checks); the rest are stand-ins."""
    if schedule == "1f1b":
        return max(count, num_stages)
    if schedule == "interleaved_1f1b":
        return max(pp_size, -(-count // pp_size) * pp_size)
    return max(count, 1)


def pipeline_in_flight(schedule: str, pp_size: int, virtual: int, microbatches: int, pp_rank: int) -> int:
    """Stage forwards whose activations pipeline rank `pp_rank` holds at its peak (each of one
    stage's layers, one micro-batch): GPipe all of them; 1F1B `pp - rank` (its warm-up, then one
    forward per backward); interleaved 1F1B torch's warm-up of `(v - 1) * pp + 2 * (pp - 1 - rank)`
    stage forwards plus the steady state's one, at most every micro-batch of every local stage."""
    total = microbatches * virtual
    if schedule == "gpipe":
        return total
    if schedule == "1f1b":
        return min(total, pp_size - pp_rank)
    return min(total, (virtual - 1) * pp_size + 2 * (pp_size - 1 - pp_rank) + 1)


# Decoders whose forward pipeline stages reproduce (`models/policy/pipeline.py`, `StageChunk`).
PIPELINE_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})


def pipeline_problem(config: Mapping, num_stages: int, layer_split: Optional[list[int]] = None) -> Optional[str]:
    """One line saying why a model of `config` (a config.json dict) cannot be cut into `num_stages`
    pipeline stages (`layer_split`: `policy.pipeline_layer_split`); None when it can."""
    model_type, layers = config.get("model_type"), config.get("num_hidden_layers")
    if model_type not in PIPELINE_MODEL_TYPES:
        return (f"policy.pipeline_parallel_size: model_type {model_type!r} is not one posttrain splits into stages "
                f"({sorted(PIPELINE_MODEL_TYPES)})")
    if config.get("tie_word_embeddings"):
        return ("policy.pipeline_parallel_size: the model ties its input and output embeddings (tie_word_embeddings), "
                "which live on different stages; use pipeline_parallel_size=1 for it")
    if config.get("use_sliding_window") or any(t != "full_attention" for t in config.get("layer_types") or ()):
        return "policy.pipeline_parallel_size: sliding-window attention layers are not supported"
    if layer_split is not None and layers is not None and sum(layer_split) != layers:
        return f"policy.pipeline_layer_split={layer_split} sums to {sum(layer_split)}, not the model's {layers} layers"
    if layers is not None and layers < num_stages:
        return (f"policy.pipeline_parallel_size: the model's {layers} layers cannot fill {num_stages} pipeline stages "
                "(pipeline_parallel_size * virtual stages)")
    return None


def num_routed_experts(config: Any) -> Optional[int]:
    """Routed experts per MoE layer of a transformers config (None for a dense model)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, key, None) if not isinstance(config, dict) else config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def expert_parallel_problem(config: Any, ep_size: int) -> Optional[str]:
    """One line saying why the model of `config` (a transformers config or a config.json dict)
    cannot split its experts over `ep_size` ranks; None when it can."""
    if ep_size == 1:
        return None
    experts = num_routed_experts(config)
    if experts is None:
        return (f"policy.expert_parallel_size={ep_size}: the model is dense (no routed experts); expert parallelism "
                "is for mixture-of-experts models (tiny-qwen3_moe, tiny-mixtral, tiny-deepseek_v3, ...)")
    if experts % ep_size:
        return (f"policy.expert_parallel_size={ep_size} does not divide the model's {experts} routed experts; pick an "
                "expert_parallel_size that divides them")
    return None
