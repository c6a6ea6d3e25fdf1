"""Whether a model's sizes split over a tensor-parallel group (no torch: config checks and
preflight call it in milliseconds; `models/policy/parallel.py` applies the split)."""

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
