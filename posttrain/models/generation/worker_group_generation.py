"""`WorkerGroupGeneration`: what every backend that drives a `WorkerGroup` of data-parallel
engines shares (the native and the vLLM backend both build on it)."""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from posttrain.distributed.batch import Batch
from posttrain.distributed.worker_group import WorkerGroup
from posttrain.models.generation.interface import GenerationInterface, GenerationSpec


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
        return self.worker_group.gather(refs, pad_values={"output_ids": self.pad_token_id})

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

    def prepare_for_generation(self) -> bool:
        return all(self.worker_group.run_all("prepare_for_generation"))

    def finish_generation(self) -> bool:
        return all(self.worker_group.run_all("finish_generation", offload=self.config.colocated.enabled))

    def shutdown(self) -> bool:
        self.worker_group.shutdown()
        return True
