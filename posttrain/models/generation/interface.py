"""The contract of a generation backend: `GenerationInterface` (what the algorithm loops call),
`GenerationSpec` (what every backend is built from) and `RefitVerificationError`.

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
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from posttrain.config.schema import GenerationConfig
from posttrain.distributed.batch import Batch
from posttrain.models.refit import RefitMetadata


@dataclass(frozen=True)
class GenerationSpec:
    """What every generation backend is built from; the controller passes it on to its workers.

    Args:
        model_name: the model the engines load (a preset, local directory or hub id), which is
            weights version 0.
        generation: `policy.generation` (`GenerationConfig` or a dict of its keys; kept as a dict,
            which crosses into vLLM's own environment unchanged).
        tokenizer_name: default None: `model_name`.
        tiny_arch: arch of a built-in preset (default "llama").
        precision: `policy.precision` (default "auto": bfloat16 on a capable GPU, else float32).
        max_model_len: longest prompt + generation (default None: the backend's own default; the
            jobs pass `policy.max_total_sequence_length`). vLLM sizes its engine by it.
        seed: seeds rows that arrive without `seeds` (default 0); drawn by the controller before
            sharding, so the same batch gives the same samples for any number of workers.
        worker_timeout_s: longest wait for a worker call, start-up included (default 1800.0).
    """

    model_name: str
    generation: dict[str, Any] = field(default_factory=dict)
    tokenizer_name: Optional[str] = None
    tiny_arch: str = "llama"
    precision: str = "auto"
    max_model_len: Optional[int] = None
    seed: int = 0
    worker_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        generation = self.generation
        if isinstance(generation, GenerationConfig):
            generation = generation.model_dump()
        # Validated here, in the controller: a bad key fails before any worker starts.
        object.__setattr__(self, "generation", GenerationConfig(**generation).model_dump())

    @property
    def config(self) -> GenerationConfig:
        """`generation` as a `GenerationConfig`."""
        return GenerationConfig(**self.generation)

    @classmethod
    def from_config(cls, cfg: Any, *, model: Any = None, seed: int = 0) -> "GenerationSpec":
        """The spec of a job's generation: `cfg.policy.generation`, the run's
        `policy.max_total_sequence_length` and `cluster.worker_timeout_s`, and the model of
        `model` (default None: `cfg.policy`; anything with `model_name`, `tokenizer_name`,
        `tiny_arch` and `precision`, such as distillation's `teacher`)."""
        model = cfg.policy if model is None else model
        return cls(
            model_name=model.model_name, generation=cfg.policy.generation, tokenizer_name=model.tokenizer_name,
            tiny_arch=model.tiny_arch, precision=model.precision,
            max_model_len=cfg.policy.max_total_sequence_length, seed=seed,
            worker_timeout_s=cfg.cluster.worker_timeout_s,
        )


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
