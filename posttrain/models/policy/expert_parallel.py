"""Expert parallelism (EP, `policy.expert_parallel_size`, default 1): the routed experts of a
mixture-of-experts model are split over the ranks of an EP group, each token is sent to the rank
holding its chosen experts and their outputs come back (all-to-all dispatch and combine; GShard,
Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021).

Layout (as torchtitan's): EP reuses the data-parallel ranks. The workers form the mesh
`("edp", "ep")` of shape `(num_workers / ep, ep)` (`build_mesh`): rank r is EP rank `r % ep`, so the
ranks of one EP group are neighbours, and each rank still sees its own rows (data parallelism is
unchanged). EP rank i holds experts `[i * E / ep, (i + 1) * E / ep)` of every MoE layer, as
DTensors `Shard(0)` over the `ep` sub-mesh (so state dicts, DCP checkpoints, refit and the gradient
norm see full tensors); the `edp` ranks hold the same experts (replicas). Everything else (attention,
norms, embeddings, the routers, DeepSeek-V3's shared expert and dense first layer) is FSDP2-sharded
over all ranks as without EP; FSDP ignores the experts (`fully_shard(ignored_params=...)`).

The experts module of transformers 5 (`Qwen3MoeExperts`, `MixtralExperts`, `DeepseekV3Experts`:
3-D `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`, `forward(hidden, top_k_index,
top_k_weights)`) gets `ep_experts_forward`: the router stays the model's own and runs on the rank's
own tokens, then each (token, chosen expert) pair goes to the expert's rank (`all_to_all_single`
with uneven splits, after exchanging the counts), the rank runs its local experts over what it
received, the outputs go back by the inverse all-to-all and are weighted by the router's weights and
summed per token on the token's rank, as transformers' loop does. gloo (CPU) and nccl (GPU) both
have `all_to_all_single` with uneven splits (checked with torch 2.13 gloo), so no fallback is
needed; `_AllToAll` makes it differentiable (its backward is the inverse all-to-all).

Gradients. The loss of each rank is divided by the global token count and multiplied by the FSDP
size (`worker.py`), and FSDP averages the non-expert gradients over all ranks: one worker's
gradient. An expert's gradient arrives on its rank through the all-to-all's backward, summed over
the EP group's tokens; it is then summed over the `edp` replicas (all-reduce) and divided by the
FSDP size (`reduce_expert_gradients`), which gives one worker's gradient too. The router's
load-balancing loss (transformers' own, `models/moe.py`) and the expert load metrics are computed
from each rank's own tokens' router logits, as without EP.

Tolerance: float32 throughout; EP changes only the order in which each token's expert outputs are
summed (per token, in expert order instead of transformers' expert-major loop), so losses and
gradient norms agree with one worker to about 1e-6 relative and weights after two SGD steps to
1e-6 absolute (tests/functional/test_expert_parallel_workers.py allows 1e-5 relative, 1e-6 absolute, as
the tensor-parallel tests do).

Refused in one line (the config; preflight and the worker by `parallel_sizes.expert_parallel_problem`):
EP with tensor or context parallelism or LoRA, EP on a dense model, an EP size that does not divide
`num_workers` or the number of routed experts, reward and value models. Every forward of the model is collective over the EP group, as FSDP's already are
(the worker pads the micro-batch count with dummies).

Loading: from a local safetensors checkpoint every rank reads the tensors outside the routed experts
and only its own experts' (`sharded_load.ExpertSliceReader`, called by `shard_experts`), so a node's
ranks read the experts once between them; a checkpoint that is not local safetensors is read whole
by every rank, which keeps its experts.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from posttrain.distributed import collective
from posttrain.models.parallel_sizes import num_routed_experts

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # transformers 5's 3-D expert tensors


@dataclass
class ExpertShard:
    """What an EP experts module needs to dispatch: its EP group and the experts it holds."""

    group: Any  # the EP group's process group
    size: int  # EP ranks
    rank: int  # this rank's place in the EP group
    local: int  # experts per rank


def build_mesh(device_type: str, world_size: int, ep_size: int) -> DeviceMesh:
    """The `("edp", "ep")` mesh of all ranks (module doc); `mesh["ep"]` shards the experts."""
    return init_device_mesh(device_type, (world_size // ep_size, ep_size), mesh_dim_names=("edp", "ep"))


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules holding each MoE layer's routed experts as 3-D tensors (module doc)."""
    experts = num_routed_experts(model.config)
    found = []
    for module in model.modules():
        weights = [getattr(module, name, None) for name in EXPERT_WEIGHTS]
        if all(isinstance(w, torch.nn.Parameter) and w.ndim == 3 and w.shape[0] == experts for w in weights):
            found.append(module)
    return found


def expert_weight_names(model: torch.nn.Module) -> list[str]:
    """The names of the routed experts' 3-D tensors of `model` (`expert_modules`), in model order."""
    modules = {id(module) for module in expert_modules(model)}
    return [f"{name}.{weight}" for name, module in model.named_modules() if id(module) in modules
            for weight in EXPERT_WEIGHTS]


def shard_experts(model: torch.nn.Module, ep_mesh: DeviceMesh,
                  read: Optional[Callable[[str, int, int], torch.Tensor]] = None) -> list[torch.nn.Parameter]:
    """Keep this rank's experts of every MoE layer (DTensors `Shard(0)` over `ep_mesh`, on its
    device) and dispatch tokens with `ep_experts_forward`. Returns the expert parameters in model
    order, the same on every rank (FSDP ignores them; their gradients are all-reduced in this
    order). Raises ValueError when the model has no experts module transformers 5 builds.

    Experts still on the meta device (a model built by `sharded_load`) are read by
    `read(parameter name, first expert, end)` (`sharded_load.ExpertSliceReader`): this rank's only."""
    modules = expert_modules(model)
    if not modules:
        raise ValueError(f"policy.expert_parallel_size: {type(model).__name__} has no experts module with 3-D "
                         f"{' / '.join(EXPERT_WEIGHTS)} tensors (transformers 5's layout) to split")
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    local = num_routed_experts(model.config) // size
    shard = ExpertShard(ep_mesh.get_group(), size, rank, local)
    device = torch.device(ep_mesh.device_type, torch.cuda.current_device()) if ep_mesh.device_type == "cuda" else None
    params: list[torch.nn.Parameter] = []
    module_names = {id(m): name for name, m in model.named_modules()}
    for module in modules:
        for name in EXPERT_WEIGHTS:
            full = getattr(module, name)
            if full.is_meta:
                if read is None:
                    raise ValueError(f"{module_names[id(module)]}.{name} is on the meta device and nothing reads it")
                mine = read(f"{module_names[id(module)]}.{name}", rank * local, (rank + 1) * local)
                mine = mine.to(device or "cpu", dtype=full.dtype)
            else:
                mine = full.detach()[rank * local:(rank + 1) * local].to(device or full.device, copy=True)
            param = torch.nn.Parameter(DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False),
                                       requires_grad=full.requires_grad)
            setattr(module, name, param)
            params.append(param)
        module._expert_shard = shard
        module.forward = types.MethodType(ep_experts_forward, module)
    return params


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows with uneven splits; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        collective.all_to_all_single(out, rows, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        collective.all_to_all_single(back, grad, in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _run_local_experts(module: torch.nn.Module, rows: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
    """Each received row through its expert (`local_expert`: index among this rank's experts), in
    the received order; every local expert runs (on zero rows if none came), so each expert
    weight has a gradient on every rank."""
    gate_up, down = module.gate_up_proj.to_local(), module.down_proj.to_local()
    order = torch.argsort(local_expert, stable=True)
    counts = torch.bincount(local_expert, minlength=gate_up.shape[0]).tolist()
    outputs = []
    for expert, chunk in enumerate(rows[order].split(counts)):
        gate, up = F.linear(chunk, gate_up[expert]).chunk(2, dim=-1)
        outputs.append(F.linear(module.act_fn(gate) * up, down[expert]))
    return torch.cat(outputs).index_select(0, torch.argsort(order))


def ep_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward (`[tokens, H]` states, `[tokens, k]` chosen experts and their
    weights) with the experts spread over the EP group: dispatch, local experts, combine (module doc)."""
    shard: ExpertShard = self._expert_shard
    tokens, top_k = top_k_index.shape
    expert = top_k_index.reshape(-1)
    token = torch.arange(tokens, device=expert.device).repeat_interleave(top_k)
    weight = top_k_weights.reshape(-1)
    chosen = expert < self.num_experts  # transformers' index E means "no expert"
    expert, token, weight = expert[chosen], token[chosen], weight[chosen]
    order = torch.argsort(expert, stable=True)  # grouped by the rank holding the expert
    expert, token, weight = expert[order], token[order], weight[order]

    send = torch.bincount(expert // shard.local, minlength=shard.size)
    recv = torch.empty_like(send)
    collective.all_to_all_single(recv, send, group=shard.group)
    send_splits, recv_splits = send.tolist(), recv.tolist()
    recv_expert = expert.new_empty(sum(recv_splits))
    collective.all_to_all_single(recv_expert, expert, recv_splits, send_splits, group=shard.group)

    received = _AllToAll.apply(hidden_states[token], recv_splits, send_splits, shard.group)
    outputs = _run_local_experts(self, received, recv_expert - shard.rank * shard.local)
    returned = _AllToAll.apply(outputs, send_splits, recv_splits, shard.group)
    weighted = (returned * weight[:, None]).to(hidden_states.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token, weighted)


@torch.no_grad()
def reduce_expert_gradients(params: list[torch.nn.Parameter], replica_group: Any, replicas: int,
                            fsdp_size: int) -> None:
    """Expert gradients (module doc): summed over the `replicas` ranks holding the same experts,
    divided by the FSDP size the loss was multiplied by. In place, before clipping."""
    for param in params:
        if param.grad is None:
            continue
        grad = param.grad._local_tensor if isinstance(param.grad, DTensor) else param.grad
        if replicas > 1:
            collective.all_reduce(grad, "sum", group=replica_group)
        grad.div_(fsdp_size)
