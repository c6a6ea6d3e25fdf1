"""`WeightExport`: how a `PolicyWorker`'s weights leave the trainer, for export and for refit.

Every route hands out a plain model of the base architecture (LoRA adapters merged in), in HF
names: unsharded float32 tensors on rank 0 (export, CPU refit, checksums), the model's own tensors
when the engine shares this process (local backend), or device buffers packed for a GPU engine
(CUDA IPC when colocated, a broadcast group when not).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from posttrain.models import lora, refit


class WeightExport:
    """Mixin of `PolicyWorker`: reads `self.model` (possibly FSDP-sharded), `self.lora_scaling`
    (None without LoRA), `self.is_fsdp`, `self.rank` and `self.device`."""

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: unsharded weights (HF names, float32, CPU) on rank 0, `{}` elsewhere.

        With LoRA, the adapters are merged into the base weights (`models/lora.py`): what leaves
        the trainer is always a plain model of the base architecture.
        """
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.lora_scaling is not None and state:
            state = lora.merged_state_dict(state, self.lora_scaling)
        return state

    def state_dict_for_export(self) -> Optional[dict[str, torch.Tensor]]:
        """Full parameters in HF names, dtype as trained (float32 masters), on rank 0; None elsewhere."""
        state = self._full_state_dict()
        return state if self.rank == 0 else None

    def live_weights(self) -> Optional[dict[str, torch.Tensor]]:
        """The model's own weight tensors by name, not copied, for a generation engine in this
        process to read in place (the local backend); None when generation needs something else
        (LoRA: the merged weights; FSDP: the full tensors, not shards): refit copies them then."""
        if self.lora_scaling is not None or self.is_fsdp:
            return None
        return dict(self.model.state_dict())  # detached tensors sharing the parameters' storage

    def pack_for_refit(self, metadata: refit.RefitMetadata) -> Optional[list]:
        """Collective: rank 0 packs the full weights into `metadata`'s refit buffers; None elsewhere."""
        state = self._full_state_dict()
        return refit.pack(state, metadata) if self.rank == 0 else None

    def pack_for_refit_ipc(self, metadata: refit.RefitMetadata) -> dict[str, list]:
        """Collective, colocated GPU refit: every rank packs the full weights into buffers on its
        own GPU and returns `{gpu uuid: [CUDA IPC handle per buffer]}` for the generation worker
        sharing that GPU. The buffers live until `release_refit_buffers`.
        GPU only: docs/scaling.md, "GPU-only paths"."""
        from torch.multiprocessing.reductions import reduce_tensor

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
        if self.lora_scaling is not None:
            state = lora.merged_state_dict(state, self.lora_scaling)
        self._refit_buffers = refit.pack_on_device(state, metadata, self.device)
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        return {uuid: [reduce_tensor(buffer) for buffer in self._refit_buffers]}

    def release_refit_buffers(self) -> bool:
        """Free the buffers of the last `pack_for_refit_ipc` (after the generation side loaded them)."""
        self._refit_buffers = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return True

    def init_refit_broadcast(self, host: str, port: int, world_size: int) -> bool:
        """Split GPU refit: rank 0 joins the standalone broadcast group with the vLLM workers
        (as its rank 0); other ranks do nothing."""
        if self.rank == 0:
            from posttrain.distributed.collective import new_standalone_group

            self._refit_group = new_standalone_group(host, port, 0, world_size, self.device)
        return True

    def broadcast_for_refit(self, metadata: refit.RefitMetadata) -> bool:
        """Collective, split GPU refit: gather the full weights, then rank 0 packs them on its
        GPU and broadcasts each buffer to the vLLM workers.
        GPU only: docs/scaling.md, "GPU-only paths"."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        if self.rank != 0:
            return True
        if self.lora_scaling is not None:
            state = lora.merged_state_dict(state, self.lora_scaling)
        for buffer in refit.pack_on_device(state, metadata, self.device):
            self._refit_group.broadcast(buffer, src=0)
        return True

    def weights_checksum(self, dtypes: Optional[dict[str, torch.dtype]] = None) -> Optional[str]:
        """Collective: `refit.state_dict_checksum` of the full weights (cast to `dtypes` where given)
        on rank 0; None elsewhere."""
        state = self._full_state_dict()
        return refit.state_dict_checksum(state, dtypes) if self.rank == 0 else None

    def refit_info(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """`(name, full shape, dtype)` of every tensor `state_dict_for_export` returns."""
        named = self.model.state_dict().items()
        if self.lora_scaling is not None:
            return lora.export_layout(named)
        return [(name, tuple(t.shape), t.dtype) for name, t in named]
