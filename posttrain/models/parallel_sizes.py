"""Whether a model's sizes split over a tensor-parallel group, and whether its config splits into
pipeline stages (no torch: config checks and preflight call them in milliseconds;
`models/policy/parallel.py` and `pipeline.py` apply the splits)."""

from __future__ import annotations

from typing import Mapping, Optional

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
