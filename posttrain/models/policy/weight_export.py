"""`WeightExport`: how a `PolicyWorker`'s weights leave the trainer, for export and for refit.

Every route hands out a plain model of the base architecture (LoRA adapters merged in), in HF
names: unsharded float32 tensors on rank 0 (export, checksums), the model's own tensors when the
engine shares this process (local backend), or refit buckets: one bucket at a time, gathered
tensor by tensor from the shards (`DTensor.full_tensor()`, FSDP and tensor-parallel shards alike)
and packed in the engine's dtypes, for the object store (CPU), CUDA IPC (colocated GPUs) or a
broadcast group (split placement; gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from posttrain.models import lora, refit
from posttrain.utils.phase_memory import measured_phase


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

    @measured_phase("refit")
    def live_weights(self) -> Optional[dict[str, torch.Tensor]]:
        """The model's own weight tensors by name, not copied, for a generation engine in this
        process to read in place (the local backend); None when generation needs something else
        (LoRA: the merged weights; FSDP: the full tensors, not shards): refit copies them then.
        Lent weights stay on the device when the policy offloads (`offload.py`)."""
        if self.lora_scaling is not None or self.is_fsdp:
            return None
        self._weights_lent = True
        return dict(self.model.state_dict())  # detached tensors sharing the parameters' storage

    def _exported_tensor_getter(self) -> Callable[[str], torch.Tensor]:
        """`name -> full tensor` in export names, gathered on call (collective under FSDP or
        tensor parallelism: every rank asks for the same names in the same order). Nothing is
        gathered up front, so a refit holds one full tensor (and its LoRA adapter) at a time."""
        sharded = self.model.state_dict()  # DTensor shards under FSDP/TP; no gather

        def full(tensor: torch.Tensor) -> torch.Tensor:
            return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()

        if self.lora_scaling is None:
            return lambda name: full(sharded[name])
        peft_names = {lora.base_name(name): name for name in sharded if not lora.is_adapter(name)}
        return lambda name: lora.merged_tensor(sharded, peft_names[name], self.lora_scaling, full)

    def _pack_refit_bucket(self, metadata: refit.RefitMetadata, bucket: int, device: torch.device,
                           keep: bool, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Collective: bucket `bucket` packed on `device` (into `out` if given) where `keep`, else
        only take part in the gathers (ranks whose bucket nobody reads)."""
        tensor_of = self._exported_tensor_getter()
        if keep:
            return refit.pack_bucket(tensor_of, metadata, bucket, device, out=out)
        for slot in refit.bucket_slots(metadata, bucket):
            tensor_of(slot.name)
        return None

    def refit_bucket_bytes(self) -> int:
        """`policy.refit_buffer_size_gb` in bytes, or its default from this rank's free memory
        (`refit.default_bucket_bytes`)."""
        if self.cfg.refit_buffer_size_gb is not None:
            return max(1, int(self.cfg.refit_buffer_size_gb * 2**30))
        return refit.default_bucket_bytes(self.device)

    @measured_phase("refit")
    def pack_for_refit(self, metadata: refit.RefitMetadata, bucket: int) -> Optional[np.ndarray]:
        """Collective: rank 0 packs bucket `bucket` on the CPU (returned through the object store);
        None elsewhere."""
        buffer = self._pack_refit_bucket(metadata, bucket, torch.device("cpu"), keep=self.rank == 0)
        return None if buffer is None else buffer.numpy()

    @measured_phase("refit")
    def pack_for_refit_ipc(self, metadata: refit.RefitMetadata, bucket: int) -> dict[str, list]:
        """Collective, colocated GPU refit: every rank packs bucket `bucket` on its own GPU and
        returns `{gpu uuid: [its CUDA IPC handle]}` for the generation worker sharing that GPU.
        The buffer lives until `release_refit_buffers`.
        GPU only: docs/scaling.md, "GPU-only paths"."""
        from torch.multiprocessing.reductions import reduce_tensor

        self._refit_buffers = [self._pack_refit_bucket(metadata, bucket, self.device, keep=True)]
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        return {uuid: [reduce_tensor(buffer) for buffer in self._refit_buffers]}

    def release_refit_buffers(self) -> bool:
        """Free the buffer of the last `pack_for_refit_ipc` (after the generation side loaded it)."""
        self._refit_buffers = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return True

    def init_refit_broadcast(self, host: str, port: int, world_size: int) -> bool:
        """Split refit: rank 0 starts joining the standalone broadcast group with the generation
        workers (as its rank 0) in a thread of its own and returns; other ranks do nothing.

        A join whose peers never come (a generation worker lost with its node before it joined)
        waits out the rendezvous's 30 minutes; in the worker's one call slot it would hold back
        every later call, the set-up with the rebuilt engines first. `broadcast_for_refit` waits for
        the join, which is over once the controller saw every engine join."""
        if self.rank == 0:
            import threading
            from concurrent.futures import Future

            from posttrain.distributed.collective import new_standalone_group

            joined: Future = Future()

            def join() -> None:
                try:
                    joined.set_result(new_standalone_group(host, port, 0, world_size, self.device))
                except BaseException as error:  # noqa: BLE001 - raised again by broadcast_for_refit
                    joined.set_exception(error)

            threading.Thread(target=join, name="posttrain-refit-join", daemon=True).start()
            self._refit_group = joined
        return True

    @measured_phase("refit")
    def broadcast_for_refit(self, metadata: refit.RefitMetadata) -> bool:
        """Collective, split refit: bucket after bucket, gather it (every rank), pack it on rank
        0's device and broadcast it to the generation workers, who load it before the next one."""
        # One buffer of the largest bucket's size serves every bucket.
        send = torch.empty(metadata.max_bucket_bytes, dtype=torch.uint8, device=self.device) if self.rank == 0 else None
        failed: Optional[BaseException] = None
        group = None
        if self.rank == 0:
            try:
                group = self._refit_group.result()
            except Exception as error:  # the join failed: take part in the gathers all the same (below)
                failed = error
        for bucket in range(len(metadata.bucket_sizes)):
            buffer = self._pack_refit_bucket(metadata, bucket, self.device, keep=self.rank == 0, out=send)
            if buffer is not None and failed is None:
                try:
                    group.broadcast(buffer, src=0)
                except Exception as error:  # a generation worker died: stop sending, but keep taking part
                    failed = error  # in the gathers, or the other ranks would wait in one for ever
        if failed is not None:
            raise failed
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
