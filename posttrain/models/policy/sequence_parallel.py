"""Sequence parallelism's gather in front of a decoder block (Megatron-LM's SP, Korthikanti et al.
2022, section 4.2.2), used by the TP plan of `parallel.py` under `policy.sequence_parallel`.

Between the blocks each TP rank holds `1/tp` of the sequence. A block (attention, MLP) needs the
whole sequence for its column-wise projections, so `GatherSequence` all-gathers its input once,
into a replicated DTensor that q, k and v (or gate and up) all take. Gathering per projection
instead (`ColwiseParallel(input_layouts=Shard(1))`) gathers three times and keeps three whole
copies for the backward pass: more activation memory than TP without SP (measured: +10% at 4096
tokens on the 100m preset).

The projections' backward needs that whole input again. Kept as autograd saves it, it is a whole
`[batch, seq, hidden]` tensor per block, which is what SP is meant to split. So, as Megatron-LM
does, the block keeps only its rank's slice (the input it was given) and gathers the rest again
when the backward pass asks for it (`saved_tensors_hooks` around the block's forward): one more
all-gather per block in the backward pass, for `2 x (1 - 1/tp)` fewer whole-sequence tensors per
layer. Not under activation checkpointing, whose own hooks already keep nothing inside a layer
(the recomputed gather lives only while its layer's backward runs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from posttrain.distributed.collective import all_gather_tensor


class GatherSequence(ParallelStyle):
    """A block's `hidden_states` input (the first positional argument or the keyword: transformers
    passes attention's by keyword, the MLP's by position), split by sequence over the TP group,
    all-gathered once into a replicated DTensor that every column-wise projection of the block
    takes as it is; its gradient (each rank's partial sum over its heads) is reduce-scattered back.

    Args:
        regather_in_backward: keep only the local slice for the backward pass and gather it again
            there (default True; False under activation checkpointing, see the module doc)."""

    def __init__(self, regather_in_backward: bool = True):
        super().__init__()
        self.regather_in_backward = regather_in_backward

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        hooks: list[Any] = []  # the saved-tensor hooks of the forward in flight (one at a time per module)

        def gather(x: torch.Tensor) -> DTensor:  # a DTensor from the norm's SequenceParallel, or local
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            whole = x.redistribute(device_mesh, (Replicate(),))
            if self.regather_in_backward and torch.is_grad_enabled() and whole._local_tensor.is_contiguous():
                hooks.append(_regather_hooks(x._local_tensor, whole, device_mesh))
                hooks[-1].__enter__()
            return whole

        def before(_module, args, kwargs):
            if "hidden_states" in kwargs:
                return args, dict(kwargs, hidden_states=gather(kwargs["hidden_states"]))
            return (gather(args[0]), *args[1:]), kwargs

        def after(_module, _args, _output):
            while hooks:
                hooks.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, always_call=True)  # also when the forward raises
        return module


class _Regather:
    """What autograd keeps of a view of the gathered input: where the view lies in it."""

    def __init__(self, state: dict, saved: torch.Tensor):
        self.state = state  # shared by every view of one gather: the slice, and the whole once regathered
        local = _local(saved)
        self.view = (local.shape, local.stride(), local.storage_offset())
        self.spec = (saved.device_mesh, saved.placements, saved.shape, saved.stride()) if isinstance(saved, DTensor) else None

    def kept(self) -> torch.Tensor:
        """The tensor this keeps alive until the backward pass: the rank's slice."""
        return self.state["shard"]

    def unpack(self) -> torch.Tensor:
        state = self.state
        if state["whole"] is None:  # the first projection to need it gathers; the others share it
            pieces = all_gather_tensor(state["shard"], state["mesh"].get_group())
            state["whole"] = torch.cat(pieces, dim=1)  # the sequence is dim 1; contiguous, as gathered
        local = state["whole"].as_strided(*self.view)
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's tensor behind a DTensor (or the tensor itself)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _regather_hooks(shard: torch.Tensor, whole: DTensor, mesh: DeviceMesh):
    """Saved-tensor hooks that keep views of `whole` (the gathered `shard`) as `_Regather`s."""
    state = {"shard": shard, "mesh": mesh, "whole": None}
    storage = whole._local_tensor.untyped_storage().data_ptr()

    def pack(saved: torch.Tensor) -> Any:
        local = _local(saved)
        if local.device == shard.device and local.untyped_storage().data_ptr() == storage:
            return _Regather(state, saved)
        return saved

    def unpack(packed: Any) -> torch.Tensor:
        return packed.unpack() if isinstance(packed, _Regather) else packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
