"""Controller side of generation: the `GenerationInterface` ABC and `Generation`, which drives
a group of data-parallel `GenerationWorker`s (NeMo-RL's `GenerationInterface` / `VllmGeneration`).

Typical use from an algorithm loop:

    generation = Generation(cluster, config.policy.generation, config.policy.model_name)
    generation.prepare_refit_info(build_refit_metadata(policy_param_info, bucket_bytes, dtypes=generation.weight_dtypes()))
    ...
    if generation.weights_version != policy_version:  # lazy refit
        refit_policy_generation(policy, generation, metadata, version=policy_version)  # bucket by bucket
    generation.prepare_for_generation()
    out = generation.generate(batch, greedy=False)
    generation.finish_generation()
"""

from __future__ import annotations

import abc
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from posttrain.config.schema import GenerationConfig
from posttrain.distributed.batch import Batch
from posttrain.distributed import actors
from posttrain.distributed.worker_group import WorkerGroup
from posttrain.models.generation.worker import GenerationWorker
from posttrain.models.refit import RefitMetadata


class RefitVerificationError(RuntimeError):
    """After a refit, the generation engine does not hold the policy's weights."""


class GenerationInterface(abc.ABC):
    """What the algorithm loops need from a generation backend."""

    weights_version: int  # version of the weights the backend holds; compare before refitting

    @abc.abstractmethod
    def generate(self, batch: Batch, greedy: bool = False, params: Optional[dict[str, Any]] = None) -> Batch:
        """`batch` has `input_ids [B,S]` (right-padded), `input_lengths [B]`, optionally `seeds [B]`
        and per-row `stop_strings`. Returns `output_ids`, `generation_lengths`,
        `unpadded_sequence_lengths`, `logprobs`, `truncated` (docs/internals.md)."""

    def generate_shards(
        self, batch: Batch, greedy: bool = False, params: Optional[dict[str, Any]] = None
    ) -> Iterator[tuple[list[int], Batch]]:
        """`generate` in pieces as they finish: yields `(rows of batch, their outputs)`, so the
        caller can work on early pieces (e.g. step their environments) while the rest generate.
        Default: the whole batch at once."""
        yield list(range(batch.size)), self.generate(batch, greedy=greedy, params=params)

    @abc.abstractmethod
    def prepare_for_generation(self) -> bool:
        """Make the engine ready to generate (weights on device). Idempotent."""

    @abc.abstractmethod
    def finish_generation(self) -> bool:
        """Release generation memory when colocated with training. Idempotent."""

    @abc.abstractmethod
    def weight_dtypes(self) -> dict[str, torch.dtype] | torch.dtype:
        """dtype per weight name as the engine holds it, or one dtype for all: refit packs in these dtypes."""

    @abc.abstractmethod
    def prepare_refit_info(self, metadata: RefitMetadata) -> None:
        """Share the packed-weights layout once, before the first `update_weights`."""

    @abc.abstractmethod
    def update_weights(self, buffers: Any, version: int) -> None:
        """Load packed weights (`posttrain.models.refit.pack` output) and record `version`."""

    @abc.abstractmethod
    def load_bucket(self, buffer: Any, bucket: int) -> None:
        """Load one packed bucket (`refit.pack_bucket` output, or an ObjectRef to it) into every worker."""

    @abc.abstractmethod
    def finish_refit(self, version: int) -> None:
        """Every bucket is in: record `version` as the weights the engine holds."""

    @abc.abstractmethod
    def shutdown(self) -> bool:
        """Stop the workers."""

    def refit_from_policy(self, policy: Any, metadata: RefitMetadata, version: int) -> None:
        """Copy `policy`'s current weights in, one bucket at a time (default: rank 0 packs a bucket
        into the object store, every worker loads it, and it is freed before the next is packed,
        so the store, the sender and each receiver hold one bucket at a time). Backends with a
        faster path on GPU override this."""
        for bucket in range(len(metadata.bucket_sizes)):
            ref = policy.pack_for_refit(metadata, bucket)
            self.load_bucket(ref, bucket)
            del ref  # frees the bucket in the object store before the next one is packed
        self.finish_refit(version)

    def verify_refit(self, policy: Any, version: int) -> None:
        """Raise `RefitVerificationError` unless the engine now holds `policy`'s weights (default:
        every worker's weights checksum equals the policy's, in the engine's dtypes)."""
        expected = policy.weights_checksum(self.weight_dtypes())
        got = self.get_weights_checksums()
        bad = [rank for rank, checksum in enumerate(got) if checksum != expected]
        if bad:
            raise RefitVerificationError(
                f"refit verification failed: generation workers {bad} hold weights that differ from the "
                f"policy's (checksum {expected}) after refit to version {version}"
            )

    def get_weights_checksums(self) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} does not report weight checksums")


class WorkerGroupGeneration(GenerationInterface):
    """What every backend that drives a WorkerGroup of data-parallel engines shares: rows seeded
    here before sharding (the same batch gives the same samples for any number of workers),
    sharded generation, the generation-phase hooks and shutdown. Subclasses build the group and
    call `_attach`."""

    def _attach(self, worker_group: WorkerGroup, seed: int) -> None:
        self.worker_group = worker_group
        self.pad_token_id = worker_group.run_rank0("special_token_ids")["pad_token_id"]
        self._seed_generator = torch.Generator().manual_seed(seed)
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

    def prepare_for_generation(self) -> bool:
        return all(self.worker_group.run_all("prepare_for_generation"))

    def finish_generation(self) -> bool:
        return all(self.worker_group.run_all("finish_generation", offload=self.config.colocated.enabled))

    def shutdown(self) -> bool:
        self.worker_group.shutdown()
        return True


class Generation(WorkerGroupGeneration):
    """Data-parallel native generation on a WorkerGroup of `GenerationWorker`s.

    Args:
        cluster: the VirtualCluster (or the local backend's LocalCluster) to place workers on.
        config: `policy.generation` (`GenerationConfig` or a dict of its keys).
        model_name: `policy.model_name`; the workers load it, which is weights version 0.
        tokenizer_name, tiny_arch, precision: as in `policy` (defaults None, "llama", "auto").
        bundle_indices: bundles of `cluster` to use (default None: all; one worker per bundle).
        name: worker group name in errors and logs (default "generation").
        seed: seeds rows that arrive without `seeds` (default 0). Seeds are drawn here, before
            sharding, so the same batch gives the same samples for any number of workers.
        worker_timeout_s: longest wait for a worker call (default 1800.0).
    """

    def __init__(
        self,
        cluster: Any,
        config: GenerationConfig | dict[str, Any],
        model_name: str,
        *,
        tokenizer_name: Optional[str] = None,
        tiny_arch: str = "llama",
        precision: str = "auto",
        bundle_indices: Optional[Sequence[int]] = None,
        name: str = "generation",
        seed: int = 0,
        worker_timeout_s: float = 1800.0,
    ) -> None:
        self.config = config if isinstance(config, GenerationConfig) else GenerationConfig(**config)
        if self.config.backend != "native":
            raise ValueError(
                f"policy.generation.backend={self.config.backend!r} is not available; this build has 'native'"
            )
        worker_group = WorkerGroup(
            cluster,
            GenerationWorker,
            init_kwargs=dict(
                model_name=model_name,
                generation_config=self.config.model_dump(),
                tokenizer_name=tokenizer_name,
                tiny_arch=tiny_arch,
                precision=precision,
                seed=seed,
            ),
            name=name,
            bundle_indices=bundle_indices,
            worker_timeout_s=worker_timeout_s,
        )
        self._attach(worker_group, seed)

    def prepare_refit_info(self, metadata: RefitMetadata) -> None:
        self.worker_group.run_all("prepare_refit_info", metadata)

    def refit_from_policy(self, policy: Any, metadata: RefitMetadata, version: int) -> None:
        """With the policy in this process too (the local backend), the engine reads the policy's
        weights in place (`GenerationWorker.share_weights`): no packing, no copy once shared.
        Otherwise bucket by bucket over a broadcast group from policy rank 0 (gloo on CPU, either
        placement; nccl on GPUs, split placement), or through the object store (colocated on
        GPUs, where two ranks of one nccl group cannot share a GPU). On CPU the broadcast, not
        the object store: each bucket Ray stores touches new shared-memory pages, so a streamed
        refit through it still left every process about one model's worth larger (measured:
        ~790 MiB for a 397 MiB model, tests/functional/test_refit_memory.py)."""
        if self.worker_group.is_local and policy.worker_group.is_local:
            weights = policy.worker_group.run_rank0("live_weights")
            if weights is not None:
                self.worker_group.run_all("share_weights", weights, version)
                self.weights_version = version
                return
        on_gpus = getattr(self.worker_group.cluster, "use_gpus", False)
        if not self.worker_group.is_local and (not self.config.colocated.enabled or not on_gpus):
            self._refit_by_broadcast(policy, metadata, version, ranks_per_worker=1)
            return
        super().refit_from_policy(policy, metadata, version)

    def weight_dtypes(self) -> dict[str, torch.dtype]:
        """dtype of every weight the engine holds (all workers load the same model and precision)."""
        return self.worker_group.run_rank0("get_weight_dtypes")

    def get_weights_checksums(self) -> list[str]:
        """`refit.state_dict_checksum` of every worker's weights, in rank order."""
        return self.worker_group.run_all("get_weights_checksum")
