"""Router replay for mixture-of-experts policies: the training forward routes each token to the
experts the generation engine chose for it.

Why: a MoE policy's logprob mismatch between the generation engine and the trainer is larger than a
dense one's, because a tiny numerical difference (bf16 generation, another batch shape, another
kernel) can flip a router's top-k choice, and a flipped expert changes the token's whole MLP output
(Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
Routers": Rollout Routing Replay). Replaying the generation's choices removes that source: only the continuous
part of the mismatch is left.

Recording (`RoutingRecorder`): forward hooks on the routers transformers names for
`output_router_logits` (`moe.router_recorder_spec`) keep each call's top-k indices; the native
engine (`generation/engine.py`, `record_routing=True`) files them by row and position after its
prefill and each decode step, and returns `routed_experts [B, S+T, layers, k]` (int16, aligned with
`output_ids`; -1 where nothing was recorded: padding, and the last generated token, which is never fed
back). vLLM's are converted to the same layout (`from_vllm`; recorded by vLLM itself on GPUs, by
`generation/vllm_routing.py` on CPU).

Replay (`replaying`): a forward hook on each router replaces its top-k indices by the recorded ones
(tokens whose record is -1 keep the router's own choice) and recomputes the gate weights of the
replayed experts from the router's logits as the router's own code does, so the router still gets
its gradient: softmax routers (Qwen3-MoE, Mixtral) take the softmax probabilities of the chosen
experts, renormalised over them where the router renormalises (`norm_topk_prob`; Mixtral always);
sigmoid routers with a balancing bias (DeepSeek-V3) take the sigmoid scores, renormalised
(`norm_topk_prob`, + 1e-20) and times `routed_scaling_factor`. The load-balancing loss reads the
logits, which replay does not change.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from posttrain.models import moe_balance

ROUTED_EXPERTS = "routed_experts"  # the generation output's and the training batch's key
NOT_RECORDED = -1


def _indices_and_position(output) -> tuple[torch.Tensor, int]:
    """A router output's `[tokens, k]` integer top-k indices and their place in the output tuple."""
    for position in range(len(output) - 1, -1, -1):
        part = output[position]
        if isinstance(part, torch.Tensor) and not part.is_floating_point() and part.ndim == 2:
            return part, position
    raise ValueError("router replay: the router returns no [tokens, k] expert indices (transformers 5's "
                     "(logits, weights, indices) routers do)")


def replayed_weights(router: torch.nn.Module, logits: torch.Tensor, indices: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """The gate weights `[tokens, k]` the router's own code gives the experts `indices` (module doc)."""
    if hasattr(router, moe_balance.BIAS_NAME):  # DeepSeek-V3: sigmoid scores (the bias only picks)
        weights = logits.float().sigmoid().gather(1, indices)
        if getattr(router, "norm_topk_prob", False):
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * getattr(router, "routed_scaling_factor", 1.0)).to(dtype)
    weights = torch.softmax(logits.float(), dim=-1).gather(1, indices)
    if getattr(router, "norm_topk_prob", True):  # Qwen3-MoE's switch; Mixtral always renormalises
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype)


@contextmanager
def replaying(model: torch.nn.Module, routed: Optional[torch.Tensor]) -> Iterator[None]:
    """Within the block, the model's next forward routes token t of router layer l to
    `routed[t, l]` (`[tokens, layers, k]`, tokens flattened as the routers see them; -1: the
    router's own choice). Nothing is hooked when `routed` is None."""
    layers = moe_balance.routers(model) if routed is not None else []
    if not layers:
        yield
        return
    if routed.shape[1] != len(layers):
        raise ValueError(f"router replay: {routed.shape[1]} recorded router layers for the model's {len(layers)}")

    def hook_for(layer: int):
        def hook(router, _inputs, output):
            logits, weights = output[0], output[1]
            indices, position = _indices_and_position(output)
            recorded = routed[:, layer].to(indices.device, torch.long)
            if recorded.shape != indices.shape:
                raise ValueError(f"router replay: {tuple(recorded.shape)} recorded choices for the router's "
                                 f"{tuple(indices.shape)}")
            chosen = torch.where(recorded >= 0, recorded, indices)
            replaced = list(output)
            replaced[1] = replayed_weights(router, logits.reshape(-1, logits.shape[-1]), chosen, weights.dtype)
            replaced[position] = chosen
            return tuple(replaced)
        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, router in enumerate(layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class RoutingRecorder:
    """Keeps the top-k expert indices of every router call of `model` (module doc); `take` hands
    over those since the last `take` as `[tokens, layers, k]`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = moe_balance.routers(model)
        if not self.layers:
            raise ValueError(f"router replay: {type(model).__name__} has no routers to record (a dense model)")
        self._slot = {id(router): i for i, router in enumerate(self.layers)}
        self._pending: list[Optional[torch.Tensor]] = [None] * len(self.layers)
        self._handles: list = []

    def __enter__(self) -> "RoutingRecorder":
        def hook(router, _inputs, output):
            self._pending[self._slot[id(router)]] = _indices_and_position(output)[0].detach()

        self._handles = [router.register_forward_hook(hook) for router in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def take(self) -> torch.Tensor:
        """`[tokens, layers, k]` of the last forward (each router's last call)."""
        if any(p is None for p in self._pending):
            raise RuntimeError("router replay: a router did not run in the last forward")
        out = torch.stack(self._pending, dim=1)
        self._pending = [None] * len(self.layers)
        return out


def empty_routing(recorder: RoutingRecorder, rows: int, width: int, device: torch.device) -> torch.Tensor:
    """`[rows, width, layers, k]` int16 of -1: a generation's routing before anything is filed."""
    top_k = int(getattr(recorder.layers[0], "top_k", 0) or 0)
    if top_k <= 0:
        raise ValueError(f"router replay: {type(recorder.layers[0]).__name__} has no top_k")
    return torch.full((rows, width, len(recorder.layers), top_k), NOT_RECORDED, dtype=torch.int16, device=device)


def file_prefill(routing: torch.Tensor, taken: torch.Tensor, prompt_lengths: torch.Tensor,
                 row_map: torch.Tensor, rows: Optional[torch.Tensor] = None) -> None:
    """File a prefill's routing (`taken [U * P, layers, k]` of `U` left-padded prompts of width `P`,
    `prompt_lengths [U]`) into `routing` at each row's right-padded prompt columns; `row_map [R]`:
    each row's prompt among the `U`; `rows [R]`: the rows' indices in `routing` (default: 0..R-1)."""
    prompts = prompt_lengths.numel()
    width = taken.shape[0] // prompts
    taken = taken.reshape(prompts, width, *taken.shape[1:])[row_map]
    columns = torch.arange(width, device=taken.device)[None, :] - (width - prompt_lengths[row_map])[:, None]
    real = columns >= 0  # left padding holds no token
    if rows is None:
        rows = torch.arange(row_map.numel(), device=taken.device)
    rows = rows.to(taken.device)[:, None].expand(-1, width)
    routing[rows[real], columns[real]] = taken[real].to(routing.dtype)


def moe_layer_indices(config: dict) -> list[int]:
    """The decoder layers that route to experts, in order (the model's routers, `moe_balance.routers`),
    from a Hugging Face config dict: Qwen2/3-MoE skip `mlp_only_layers` and keep every
    `decoder_sparse_step`-th layer, DeepSeek-V3 keeps every `moe_layer_freq`-th from
    `first_k_dense_replace` on, Mixtral routes in every layer."""
    layers = range(int(config["num_hidden_layers"]))
    if "first_k_dense_replace" in config:
        first, every = int(config["first_k_dense_replace"]), int(config.get("moe_layer_freq") or 1)
        return [i for i in layers if i >= first and i % every == 0]
    skipped, step = set(config.get("mlp_only_layers") or ()), int(config.get("decoder_sparse_step") or 1)
    return [i for i in layers if i not in skipped and (i + 1) % step == 0]


def from_vllm(routed: Sequence[Optional[np.ndarray]], prompt_lengths: torch.Tensor, generation_lengths: torch.Tensor,
              width: int, moe_layers: Sequence[int]) -> torch.Tensor:
    """vLLM's per-request routed experts as the native engine's `ROUTED_EXPERTS [B, width, layers, k]`
    (int16, -1 where nothing was fed).

    vLLM (`enable_return_routed_experts`: `CompletionOutput.routed_experts`; on CPU
    `generation/vllm_routing.py`) gives each request
    `[P + T - 1, all decoder layers, k]`: every token it fed, the prompt's `P` (also those read from
    its prefix cache) and the generated `T` but the last, for every decoder layer (dense layers'
    rows are meaningless). Row i's tokens sit at columns `0 .. P + T - 2`, as in `output_ids`;
    `moe_layers` (`moe_layer_indices`) picks the router layers."""
    layers = list(moe_layers)
    rows = len(routed)
    out = None
    for i, experts in enumerate(routed):
        fed = int(prompt_lengths[i]) + int(generation_lengths[i]) - 1
        if experts is None or experts.shape[0] != fed:
            got = None if experts is None else tuple(experts.shape)
            raise ValueError(f"router replay: vLLM returned routed experts of shape {got} for a request of {fed} fed "
                             "tokens")
        if out is None:
            out = torch.full((rows, width, len(layers), experts.shape[2]), NOT_RECORDED, dtype=torch.int16)
        out[i, :fed] = torch.from_numpy(experts[:, layers].astype(np.int16))
    return out if out is not None else torch.full((0, width, len(layers), 0), NOT_RECORDED, dtype=torch.int16)
