"""Mixture-of-experts support for training: the router's load-balancing loss.

A MoE layer sends each token to its top-k experts; without a penalty the router collapses onto a
few experts. The load-balancing loss (Switch Transformer, Fedus et al. 2021, eqs. 4-6) is
`E * sum_e f_e * P_e` (f_e: fraction of routed tokens that go to expert e, P_e: the mean router
probability of e), added to the training loss with weight `router_aux_loss_coef`.

transformers computes it inside `XForCausalLM.forward` only together with a label loss, and with
an attention mask it cannot take the block-diagonal mask of packed sequences. So here the router
logits are recorded with forward hooks on the router modules transformers itself names for
`output_router_logits` (`model._can_record_outputs["router_logits"]`), and the loss is
transformers' own `load_balancing_loss_func` of the model's module, with a 2-D mask of the real
tokens. This works for any transformers MoE causal LM that declares its router that way
(Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, ...).

Normalisation: the loss of each micro-batch is weighted by its share of the optimizer step's
tokens (all ranks), so the logged `router_aux_loss` is the token-weighted mean over micro-batches.
Its routing fractions f_e are those of the micro-batch (as in Megatron and NeMo-RL), so unlike the
policy loss it depends on which rows share a micro-batch: data parallelism with the same
micro-batches (e.g. 2 workers x 2 rows = 1 worker x 2 rows) gives the same gradient.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from posttrain.models.parallel_sizes import num_routed_experts


def router_recorder_spec(model: torch.nn.Module):
    """transformers' `OutputRecorder` for router logits of `model` (None for a dense model)."""
    inner = getattr(model, "base_model", model)  # peft / wrappers: the recorder table is on the HF model
    for candidate in (model, inner, getattr(model, "model", None)):
        table = getattr(candidate, "_can_record_outputs", None) or {}
        spec = table.get("router_logits")
        if spec is not None:
            return spec
    return None


def is_moe(model: torch.nn.Module) -> bool:
    """Whether `model` has routers transformers can record (a mixture-of-experts model)."""
    return router_recorder_spec(model) is not None and _num_experts(model.config) is not None


def _num_experts(config) -> Optional[int]:
    return num_routed_experts(config)


def aux_loss_coef(model: torch.nn.Module, configured: Optional[float]) -> float:
    """The load-balancing weight to use: `configured` when set, else the model config's
    `router_aux_loss_coef` (0.0 for dense models)."""
    if not is_moe(model):
        return 0.0
    if configured and _load_balancing_loss_func(model) is None:
        # DeepSeek-V3's sigmoid routers: transformers has no loss of their own (Mixtral's softmax one
        # would be another model's maths); they are balanced by their bias (models/moe_balance.py).
        raise ValueError(f"policy.router_aux_loss_coef={configured}: {model.config.model_type} has no load-balancing "
                         "loss in transformers; its routers are balanced by policy.moe_router_bias_update_rate")
    if configured is not None:
        return float(configured)
    return float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)


class RouterLogits:
    """Collects each router's logits `[tokens, num_experts]` during one forward pass."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []


@contextmanager
def record_router_logits(model: torch.nn.Module, enabled: bool = True) -> Iterator[Optional[RouterLogits]]:
    """Within the block, every forward of `model` appends its routers' logits to the yielded
    `RouterLogits` (in layer order); yields None when disabled or for a dense model."""
    spec = router_recorder_spec(model) if enabled else None
    if spec is None:
        yield None
        return
    record = RouterLogits()
    target, index = spec.target_class, spec.index

    def hook(_module, _inputs, output):
        record.logits.append(output[index] if isinstance(output, (tuple, list)) else output)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, target)]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


def _load_balancing_loss_func(model: torch.nn.Module):
    """transformers' `load_balancing_loss_func` of the model's own modeling module (None if it has
    none and its routers carry a balancing bias, as DeepSeek-V3's do; Mixtral's otherwise)."""
    # The modeling module of the model's class (FSDP2 subclasses it, so walk the MRO).
    modules = (sys.modules.get(cls.__module__) for cls in type(model).__mro__)
    loss_func = next((m.load_balancing_loss_func for m in modules if hasattr(m, "load_balancing_loss_func")), None)
    if loss_func is None and not any(name.endswith("e_score_correction_bias") for name, _ in model.named_buffers()):
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as loss_func
    return loss_func


def load_balancing_loss(model: torch.nn.Module, router_logits: list[torch.Tensor], token_mask: torch.Tensor) -> torch.Tensor:
    """transformers' load-balancing loss of one forward pass over the real tokens.

    Args:
        model: the MoE model (its module provides `load_balancing_loss_func`, its config the
            number of experts and `num_experts_per_tok`).
        router_logits: per router layer, `[batch * seq, num_experts]` logits of that forward.
        token_mask: `[batch, seq]` 1 for real tokens, 0 for padding (rows flattened like the logits).
    """
    loss_func = _load_balancing_loss_func(model)
    if loss_func is None:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as loss_func
    config = model.config
    return loss_func(tuple(router_logits), _num_experts(config), config.num_experts_per_tok, token_mask)
