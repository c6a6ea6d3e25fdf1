"""Expert load balance of mixture-of-experts models in training: what the routers chose, its metrics,
and DeepSeek-V3's auxiliary-loss-free balancing.

Load: forward hooks on the router modules transformers names for `output_router_logits`
(`moe.router_recorder_spec`) take each router's top-k expert indices (the integer tensor its forward
returns: Qwen3-MoE, Mixtral and DeepSeek-V3 routers return `(logits, weights, indices)`; a router
returning logits only is read as their top `num_experts_per_tok`). Only real tokens count (padding
and a packed bin's tail are masked out), summed over the micro-batches of an optimizer step and over
all ranks. Each router layer's load `c_e` (tokens sent to expert e) gives two metrics, averaged over
the MoE layers and over the call's optimizer steps:

- `moe/expert_load_max_over_mean`: `max_e c_e / mean_e c_e`; 1 when balanced, `E / k` when every
  token goes to the same k of E experts;
- `moe/expert_load_entropy`: the entropy of `c / sum c` divided by `ln E`; 1 when balanced, 0 when
  one expert takes everything.

The policy logs them as `train/moe/...`. Under tensor parallelism every TP rank saw the same tokens,
so the summed loads are the true ones times the TP size: the ratios (and the update's signs) are
unchanged. Under context parallelism each rank routes its slices of the rows, padding included
(the worker's token mask is of whole rows, so it is not applied there).

Auxiliary-loss-free balancing (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for
Mixture-of-Experts"; DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 2.1.2): routers with a
per-expert bias (`e_score_correction_bias`; it enters the top-k choice only, never the gate weights,
so it has no gradient) are balanced by moving the bias after every optimizer step,
`b_e += rate * sign(mean_e' c_e' - c_e)`: an overloaded expert becomes less likely to be chosen, an
underloaded one more. transformers 5.23 keeps the bias fixed (a buffer it loads and saves but never
updates), so `policy.moe_router_bias_update_rate` does it here (default 0.0, off; DeepSeek-V3
pre-trained with 0.001). The bias is a persistent buffer: checkpoints, HF exports and refits carry it.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from posttrain.models import moe

BIAS_NAME = "e_score_correction_bias"  # transformers' name of a router's balancing bias (DeepSeek-V3, GLM-4-MoE, ...)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """`model`'s router modules in layer order (empty for a dense model)."""
    spec = moe.router_recorder_spec(model)
    return [] if spec is None else [m for m in model.modules() if isinstance(m, spec.target_class)]


def balance_biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`{name: buffer}` of the routers' balancing biases (`e_score_correction_bias`), by state-dict name."""
    return {name: buffer for name, buffer in model.named_buffers() if name.rsplit(".", 1)[-1] == BIAS_NAME}


def _top_k_indices(output, spec, top_k: int) -> torch.Tensor:
    """The `[tokens, k]` expert indices in a router's output (see the module doc)."""
    parts = output if isinstance(output, (tuple, list)) else (output,)
    for part in reversed(parts):
        if isinstance(part, torch.Tensor) and not part.is_floating_point() and part.ndim == 2:
            return part
    logits = parts[spec.index] if isinstance(output, (tuple, list)) else output
    return logits.reshape(-1, logits.shape[-1]).topk(top_k, dim=-1).indices


class ExpertLoads:
    """Tokens routed to each expert of each router layer, `counts [layers, experts]` (float64), over
    the micro-batches `add`ed since construction."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self._pending: list[torch.Tensor] = []

    def add(self, token_mask: Optional[torch.Tensor]) -> None:
        """Count the choices recorded since the last `add`, one `[tokens, k]` tensor per router layer,
        over the tokens where `token_mask` (flattened like the router's input) is 1. A mask of another
        size than the routed tokens (context parallelism's slices) counts every routed token."""
        for layer, indices in enumerate(self._pending):
            if token_mask is not None and token_mask.numel() == indices.shape[0]:
                indices = indices[token_mask.reshape(-1).to(indices.device).bool()]
            self.counts[layer] += torch.bincount(indices.reshape(-1).cpu(), minlength=self.counts.shape[1])[
                : self.counts.shape[1]].double()  # an index of E (transformers' "no expert") is dropped
        self._pending = []


@contextmanager
def record_expert_choices(model: torch.nn.Module, loads: Optional[ExpertLoads]) -> Iterator[None]:
    """Within the block, each router's forward leaves its top-k choices in `loads` (counted by
    `loads.add`); nothing is hooked when `loads` is None."""
    layers = routers(model) if loads is not None else []
    if not layers:
        yield
        return
    spec = moe.router_recorder_spec(model)
    top_k = int(getattr(model.config, "num_experts_per_tok", 1) or 1)
    slots: dict[int, int] = {id(m): i for i, m in enumerate(layers)}
    pending: list[Optional[torch.Tensor]] = [None] * len(layers)

    def hook(module, _inputs, output):
        pending[slots[id(module)]] = _top_k_indices(output, spec, top_k).detach()

    handles = [m.register_forward_hook(hook) for m in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        loads._pending = [p for p in pending if p is not None]


def new_loads(model: torch.nn.Module) -> Optional[ExpertLoads]:
    """An empty `ExpertLoads` for `model`'s routers (None for a dense model)."""
    layers = routers(model)
    num_experts = moe._num_experts(model.config)
    if not layers or num_experts is None:
        return None
    return ExpertLoads(len(layers), num_experts)


def load_metrics(counts: torch.Tensor) -> dict[str, float]:
    """`moe/expert_load_max_over_mean` and `moe/expert_load_entropy` of `counts [layers, experts]`,
    averaged over the layers that routed any token (module doc); {} when none did."""
    counts = counts.double()
    used = counts[counts.sum(-1) > 0]
    if used.numel() == 0:
        return {}
    share = used / used.sum(-1, keepdim=True)
    entropy = -(share * share.clamp_min(1e-300).log()).sum(-1) / math.log(counts.shape[-1])
    max_over_mean = used.max(-1).values / used.mean(-1)
    return {"moe/expert_load_max_over_mean": max_over_mean.mean().item(),
            "moe/expert_load_entropy": entropy.mean().item()}


@torch.no_grad()
def update_balance_biases(model: torch.nn.Module, counts: torch.Tensor, rate: float) -> int:
    """Auxiliary-loss-free balancing step (module doc): each router layer's bias moves by
    `rate * sign(mean load - load)`, from that layer's row of `counts [layers, experts]` (the router
    layers in `routers(model)` order). Returns the number of biases updated; a layer that routed no
    token keeps its bias."""
    updated = 0
    for router, load in zip(routers(model), counts):
        bias = getattr(router, BIAS_NAME, None)
        if bias is None or load.sum() == 0:
            continue
        step = torch.sign(load.mean() - load).to(bias.dtype) * rate
        local = bias.to_local() if hasattr(bias, "to_local") else bias  # a replicated DTensor under TP
        local.add_(step.to(local.device))
        updated += 1
    return updated
