"""The contract of a generation backend: `GenerationInterface` (what the algorithm loops call) and
`RefitVerificationError`. What every backend is built from, `GenerationSpec`, is in `spec.py`.

Backends (`backends.py` registers them by name; `policy.generation.backend` picks one):
`native` (`native.NativeGeneration`, posttrain's PyTorch engine) and `vllm`
(`vllm_generation.VllmGeneration`), or a user's class by import path. A backend class is built as
`cls(cluster, spec)` (optionally `bundle_indices=`, `name=`) on the cluster its workers go to.

Typical use from an algorithm loop:

    generation = make_generation(cfg, cluster)  # posttrain.job: the configured backend
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
from typing import Any, Iterator, Optional

import torch

from posttrain.distributed.batch import Batch
from posttrain.models.refit import RefitMetadata


class RefitVerificationError(RuntimeError):
    """After a refit, the generation engine does not hold the policy's weights."""


class GenerationInterface(abc.ABC):
    """What the algorithm loops need from a generation backend."""

    weights_version: int  # version of the weights the backend holds; compare before refitting

    @abc.abstractmethod
    def generate(self, batch: Batch, greedy: bool = False, params: Optional[dict[str, Any]] = None) -> Batch:
        """`batch` has `input_ids [B,S]` (right-padded), `input_lengths [B]`, optionally `seeds [B]`,
        per-row `stop_strings` and `start_steps [B]` (tokens of the turn already generated at the end
        of the prompt, to continue exactly: the native backend; partial rollouts). Returns `output_ids`, `generation_lengths`,
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

    def take_phase_memory(self) -> dict[str, float]:
        """`{"memory/<phase>/<stat>": GiB}`: the engine's peak memory per phase (generation, refit)
        since the last call (`posttrain.utils.phase_memory`). Default: nothing measured."""
        return {}

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
