"""Whether a model's sizes split over a tensor-parallel group, and its experts over an
expert-parallel one (no torch: config checks and preflight call it in milliseconds;
`models/policy/parallel.py` and `expert_parallel.py` apply the splits)."""

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
