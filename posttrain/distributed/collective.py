"""Every torch.distributed collective posttrain calls, in one module that knows the devices.

A worker group's default process group carries two kinds of traffic: model tensors (FSDP's
all-gathers, DTensor's reductions; on the accelerator) and control-plane counts (micro-batch
counts, valid-token counts, flags, metric sums; small CPU tensors). NCCL refuses CPU tensors ("No
backend type associated with device type cpu"), so on GPUs the group is created with one backend
per device type, `cpu:gloo,cuda:nccl` (`process_group_backend`), and the collectives here run a
tensor on a device the group has a backend for (`collective_device`). Calling
`torch.distributed`'s collectives anywhere else is refused by `tests/unit/test_collectives.py`, so
a CPU-only test suite catches the class of bug that otherwise shows only on a multi-GPU step.

Also here: a process group apart from the default one, for refit broadcasts between worker groups.
Policy workers (FSDP) and vLLM workers (tensor parallel) each already own a default
torch.distributed group, so a broadcast from policy rank 0 to every vLLM worker needs a second,
standalone group: a `TCPStore` rendezvous and a backend object built on it (nccl on GPU, gloo on
CPU), without touching either side's default group. Used by the split-placement GPU refit into
vLLM (`models/generation/vllm_extension.py`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

# Reduction names the callers use (torch's ReduceOp objects are not hashable on every version).
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def process_group_backend(device_type: str, accelerator_backend: str = "nccl") -> str:
    """The backend string of a worker group's default process group: gloo alone on CPU; on an
    accelerator, gloo for CPU tensors beside `accelerator_backend` for the device's."""
    if device_type == "cpu":
        return "gloo"
    return f"cpu:gloo,{device_type}:{accelerator_backend}"


def init_worker_process_group(device_type: str, rank: int, size: int, timeout_s: float,
                              accelerator_backend: str = "nccl") -> None:
    """Join the worker group's default process group (rendezvous from the environment that
    `WorkerGroup` sets: MASTER_ADDR, MASTER_PORT) with `process_group_backend(device_type)`."""
    dist.init_process_group(backend=process_group_backend(device_type, accelerator_backend), init_method="env://",
                            rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s))


def forget_destroyed_groups() -> None:
    """Drop what torch.distributed cached about the device meshes of process groups this process
    has left, for a process that lives on to join other groups (`worker_host.py`).

    DTensor caches sharding decisions and redistribution plans keyed by `DeviceMesh`, and two
    meshes of the same shape and dimension names are equal whatever groups they were built on. A
    cached plan keeps its own mesh, whose subgroups it names as registered then ("8"); in the next
    process group those names are unregistered ("Could not resolve the process group registered
    under the name 8", measured: a dp2 x tp2 group after a cp2 x tp2 one) or name other groups, and
    a collective on the wrong group corrupted the heap (glibc aborted a tensor-parallel test).
    Cleared: DTensor's C++ dispatch cache, every `functools` cache of `torch.distributed` (the
    thread-local ones included: they are found through the garbage collector, not by name), the
    redistribution planners and DTensor's RNG tracker, which hold meshes too. Call it on the thread
    that ran the group's work (a Ray actor's calls run on one), since the C++ cache is that
    thread's."""
    import functools
    import gc
    import sys

    if "torch.distributed.tensor" not in sys.modules:
        return  # no DTensor was made here, so no mesh was cached
    clear_dispatch_cache = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_dispatch_cache is not None:
        clear_dispatch_cache()
    lru_cache_type = type(functools.lru_cache(None)(len))
    for obj in gc.get_objects():
        if isinstance(obj, lru_cache_type) and str(getattr(obj, "__module__", "")).startswith("torch.distributed"):
            obj.cache_clear()
    from torch.distributed.tensor import _random, _redistribute

    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()
    _random._rng_tracker = None


def backend_devices(group: Optional[Any] = None) -> list[str]:
    """The device types the group has a backend for (`cpu:gloo,cuda:nccl` -> ['cpu', 'cuda'])."""
    config = dist.get_backend_config(group)
    return [entry.split(":")[0] for entry in config.split(",")]


def collective_device(tensor_device: torch.device, devices: list[str]) -> torch.device:
    """Where a collective on a tensor living on `tensor_device` runs, for a group with backends for
    `devices`: on the tensor's own device when the group has a backend for it, else on the group's
    first device (the current CUDA device for 'cuda')."""
    if tensor_device.type in devices:
        return tensor_device
    if devices[0] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(devices[0])


def world_size(group: Optional[Any] = None) -> int:
    """Ranks in the group; 1 without a process group (a local-backend worker has none)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Optional[Any] = None) -> torch.Tensor:
    """Reduce `tensor` over the group's ranks in place (`op`: sum, max or min) and return it; a
    tensor on a device the group has no backend for travels to one and back."""
    if world_size(group) == 1:
        return tensor
    device = collective_device(tensor.device, backend_devices(group))
    moved = tensor if device == tensor.device else tensor.to(device)
    dist.all_reduce(moved, op=REDUCE_OPS[op], group=group)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def all_gather_object(obj: Any, group: Optional[Any] = None) -> list[Any]:
    """Every rank's `obj`, in rank order (a one-element list without a process group)."""
    if world_size(group) == 1:
        return [obj]
    gathered: list[Any] = [None] * world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def all_gather_tensor(tensor: torch.Tensor, group: Optional[Any] = None) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on every rank), in group rank order; not differentiable
    (context parallelism wraps it in an autograd function)."""
    if world_size(group) == 1:
        return [tensor]
    device = collective_device(tensor.device, backend_devices(group))
    moved = tensor.contiguous().to(device)
    gathered = [torch.empty_like(moved) for _ in range(world_size(group))]
    dist.all_gather(gathered, moved, group=group)
    return [t.to(tensor.device) for t in gathered]


def broadcast(tensor: torch.Tensor, src: int, group: Optional[Any] = None) -> torch.Tensor:
    """Overwrite `tensor` on every rank of the group with global rank `src`'s, in place, and return
    it; a tensor on a device the group has no backend for travels to one and back."""
    if world_size(group) == 1:
        return tensor
    device = collective_device(tensor.device, backend_devices(group))
    moved = tensor if device == tensor.device else tensor.to(device)
    dist.broadcast(moved, src=src, group=group)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def all_to_all_single(out: torch.Tensor, tensor: torch.Tensor, out_splits: Optional[list[int]] = None,
                      in_splits: Optional[list[int]] = None, group: Optional[Any] = None) -> torch.Tensor:
    """Rank i's `in_splits[j]` rows of `tensor` land in rank j's `out` (its `out_splits[i]` rows),
    in rank order (torch's `all_to_all_single`; even splits when None); returns `out`. Not
    differentiable (expert parallelism wraps it in an autograd function). Both tensors are on a
    device the group has a backend for (gloo: CPU, nccl: CUDA)."""
    dist.all_to_all_single(out, tensor.contiguous(), out_splits, in_splits, group=group)
    return out


def ring_shift(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Send `tensor` to the next rank of `group` (group rank + 1, wrapping) and return the one the
    previous rank sent (same shape and dtype): one step of a ring (ring attention's K/V pass)."""
    size = world_size(group)
    if size == 1:
        return tensor
    rank = dist.get_rank(group)
    device = collective_device(tensor.device, backend_devices(group))
    outgoing = tensor.contiguous().to(device)
    incoming = torch.empty_like(outgoing)
    ops = [dist.P2POp(dist.isend, outgoing, dist.get_global_rank(group, (rank + 1) % size), group),
           dist.P2POp(dist.irecv, incoming, dist.get_global_rank(group, (rank - 1) % size), group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return incoming.to(tensor.device)


def barrier(group: Optional[Any] = None) -> None:
    """Wait for every rank of the group (nothing to wait for without a process group)."""
    if world_size(group) > 1:
        dist.barrier(group=group)


class StandaloneGroup:
    """`broadcast` over a backend process group that is not torch.distributed's default one."""

    def __init__(self, backend_group, device: torch.device):
        self._group = backend_group
        self.device = device

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In-place broadcast of `tensor` from rank `src` to every rank of the group."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        self._group.broadcast([tensor], options).wait()


def new_standalone_group(
    host: str, port: int, rank: int, world_size: int, device: torch.device, timeout_s: float = 1800.0
) -> StandaloneGroup:
    """Join a standalone group of `world_size` ranks whose rank 0 listens on `host:port`.

    Every member calls this with the same host, port and size and its own rank; the call returns
    once all have joined (or raises after `timeout_s`). nccl for a CUDA `device`, gloo otherwise.
    """
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore("posttrain-refit", store)
    if device.type == "cuda":  # GPU only: docs/scaling.md, "GPU-only paths"
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, dist.ProcessGroupNCCL.Options())
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return StandaloneGroup(group, device)
