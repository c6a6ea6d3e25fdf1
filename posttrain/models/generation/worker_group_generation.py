"""`WorkerGroupGeneration`: what every backend that drives a `WorkerGroup` of data-parallel
engines shares (the native and the vLLM backend both build on it)."""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import numpy as np

import torch

from posttrain.distributed import actors
from posttrain.distributed.batch import Batch
from posttrain.distributed.worker_group import WorkerGroup
from posttrain.models.generation.interface import GenerationInterface
from posttrain.models.generation.spec import GenerationSpec
from posttrain.models.refit import RefitMetadata
from posttrain.models.router_replay import NOT_RECORDED, ROUTED_EXPERTS
from posttrain.utils.phase_memory import merge_peaks


class WorkerGroupGeneration(GenerationInterface):
    """What every backend that drives a WorkerGroup of data-parallel engines shares: rows seeded
    here before sharding (the same batch gives the same samples for any number of workers),
    sharded generation, the generation-phase hooks and shutdown. Subclasses build the group and
    call `_attach`."""

    def _attach(self, worker_group: WorkerGroup, spec: GenerationSpec) -> None:
        self.spec, self.config = spec, spec.config
        self.worker_group = worker_group
        self.pad_token_id = worker_group.run_rank0("special_token_ids")["pad_token_id"]
        self._seed_generator = torch.Generator().manual_seed(spec.seed)
        self.weights_version = 0

    def generate(self, batch: Batch, greedy: bool = False, params: Optional[dict[str, Any]] = None) -> Batch:
        refs = self.worker_group.run_sharded_async("generate", self._seeded(batch, greedy), greedy=greedy,
                                                   params=params)
        return self.worker_group.gather(refs, pad_values={"output_ids": self.pad_token_id,
                                                          ROUTED_EXPERTS: NOT_RECORDED})  # 0 is an expert

    def _seeded(self, batch: Batch, greedy: bool) -> Batch:
        """`batch` with a seed for every row of a sampled batch that came without seeds."""
        if "seeds" in batch or greedy:
            return batch
        batch = batch.copy()
        batch["seeds"] = torch.randint(0, 2**62, (batch.size,), generator=self._seed_generator)
        return batch

    def generate_shards(
        self, batch: Batch, greedy: bool = False, params: Optional[dict[str, Any]] = None
    ) -> Iterator[tuple[list[int], Batch]]:
        """Each worker's shard as soon as that worker returns it (`Batch.shard`'s contiguous rows)."""
        batch = self._seeded(batch, greedy)
        refs = self.worker_group.run_sharded_async("generate", batch, greedy=greedy, params=params)
        rows, start = {}, 0
        for ref, shard in zip(refs, batch.shard(len(refs))):
            rows[ref] = list(range(start, start + shard.size))
            start += shard.size
        for ref, result in self.worker_group.as_completed(refs):
            if rows[ref]:
                yield rows[ref], result

    # ------------------------------------------------------------------ refit
    def update_weights(self, buffers: Sequence[np.ndarray] | Any, version: int) -> None:
        """Load every packed buffer (`refit.pack` output, or an ObjectRef to it), bucket by bucket."""
        if actors.is_ref(buffers):
            buffers = actors.get(buffers)
        for bucket, buffer in enumerate(buffers):
            self.load_bucket(buffer, bucket)
        self.finish_refit(version)

    def load_bucket(self, buffer: np.ndarray | Any, bucket: int) -> None:
        """Send one packed bucket to every worker through the object store, once (an ObjectRef,
        e.g. what the policy's rank 0 returned, is passed on without fetching it here: Ray
        resolves a top-level ObjectRef argument in each worker, zero-copy from shared memory)."""
        ref = buffer if actors.is_ref(buffer) else actors.put(buffer, self.worker_group.is_local)
        self.worker_group.run_all("load_bucket", ref, bucket)

    def finish_refit(self, version: int) -> None:
        self.worker_group.run_all("finish_refit", version)
        self.weights_version = version

    def _refit_by_broadcast(self, policy: Any, metadata: RefitMetadata, version: int, ranks_per_worker: int) -> None:
        """Split placement: policy rank 0 broadcasts bucket after bucket to every engine process
        (`ranks_per_worker` per worker: vLLM's tensor-parallel ranks), which loads each before
        receiving the next."""
        if not getattr(self, "_broadcast_ready", False):
            host, port = policy.worker_group.cluster.master_address_and_port(0)
            world_size = 1 + self.worker_group.world_size * ranks_per_worker
            joins = policy.init_refit_broadcast(host, port, world_size)
            receivers = [
                self.worker_group.run_single_async(worker, "init_broadcast_group", host, port, world_size,
                                                   1 + worker * ranks_per_worker)
                for worker in range(self.worker_group.world_size)
            ]
            self.worker_group.get(receivers)
            policy.worker_group.get(joins)
            self._broadcast_ready = True
        sends = policy.broadcast_for_refit(metadata)
        receives = self.worker_group.run_all_async("load_broadcast")
        self.worker_group.get(receives)
        policy.worker_group.get(sends)
        self.finish_refit(version)

    def restart(self, metadata: RefitMetadata) -> None:
        """Rebuild every engine after one died or stopped answering (`WorkerGroup.restart`: they
        share a process group) and prepare them for the policy's weights, which they get at the
        next refit (`refit_from_policy`; until then they hold `model_name`'s)."""
        self.worker_group.restart()
        self.weights_version = 0
        self.forget_refit_channel()
        self.prepare_refit_info(metadata)

    def forget_refit_channel(self) -> None:
        """The policy's or the engines' processes changed: set the broadcast group of the refit up
        again at the next refit (its old members are gone)."""
        self._broadcast_ready = False

    def prepare_for_generation(self) -> bool:
        return all(self.worker_group.run_all("prepare_for_generation"))

    def finish_generation(self) -> bool:
        return all(self.worker_group.run_all("finish_generation", offload=self.config.colocated.enabled))

    def take_phase_memory(self) -> dict[str, float]:
        """The workers' peak memory per phase (generation, refit) since the last call, the highest
        over workers (`utils/phase_memory.py`)."""
        return merge_peaks(self.worker_group.run_all("take_phase_memory"))

    def shutdown(self) -> bool:
        self.worker_group.shutdown()
        return True
