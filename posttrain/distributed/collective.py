"""A process group apart from the default one, for refit broadcasts between worker groups.

Policy workers (FSDP) and vLLM workers (tensor parallel) each already own a default
torch.distributed group, so a broadcast from policy rank 0 to every vLLM worker needs a second,
standalone group: a `TCPStore` rendezvous and a backend object built on it (nccl on GPU, gloo on
CPU), without touching either side's default group. Used by the split-placement GPU refit into
vLLM (`models/generation/vllm_extension.py`).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


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
