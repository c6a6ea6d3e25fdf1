"""`VllmGeneration`: `policy.generation.backend=vllm`, the controller side of vLLM engines.

Same interface and output contract as the native backend (`native.NativeGeneration`); the loops
cannot tell them apart. Registered as the backend "vllm" (backends.py). Each data-parallel engine is one `VllmGenerationWorker` actor started with the
interpreter of vLLM's isolated environment (`vllm_env.py`, built on first use and cached).

Refit (`refit_from_policy`), after NeMo-RL's vLLM refit, streamed one bucket at a time
(`policy.refit_buffer_size_gb`; each bucket gathered tensor by tensor from the shards, loaded and
freed before the next):
- CPU, either placement: the policy's rank 0 packs a bucket into Ray's object store; each engine
  reads it zero-copy and vLLM's `load_weights` takes it.
- GPU, colocated: each policy rank packs the bucket on its own GPU and sends a CUDA IPC handle;
  the engine on the same GPU loads from it without a copy through the host.
- GPU, split: policy rank 0 broadcasts each bucket (nccl) to every vLLM worker over a process
  group set up once.
The two GPU paths are written and reviewed but have not run yet (docs/scaling.md, "GPU-only
paths").

Verification (`verify_refit`, on by default for vLLM): a probe sequence's logprobs from every
engine must match the policy's; an engine that did not take the weights fails with
`RefitVerificationError` naming it. A checksum would need vLLM's fused, sharded parameters
mapped back to Hugging Face names; the probe checks what matters, the distribution it samples.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from posttrain.distributed.batch import Batch
from posttrain.distributed.cluster import VirtualCluster
from posttrain.distributed.worker_group import WorkerGroup
from posttrain.models.generation.backends import register_generation_backend
from posttrain.models.generation.interface import RefitVerificationError
from posttrain.models.generation.spec import GenerationSpec
from posttrain.models.generation.vllm_env import ensure_vllm_env
from posttrain.models.generation.vllm_worker import VLLM_ENV_VARS, VllmGenerationWorker
from posttrain.models.generation.worker_group_generation import WorkerGroupGeneration
from posttrain.models.refit import RefitMetadata

PROBE_LENGTH = 32
# Largest mean |logp_engine - logp_policy| over the probe that counts as "same weights": float32
# engines agree to ~1e-6; bfloat16 / float16 ones differ by rounding (~1e-2).
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 5e-2}
# An engine in another precision than the trainer (`policy.generation.precision`) differs by that
# rounding itself. On this probe of SmolLM2-135M against float32 the native engine measured: bfloat16
# 0.117, int8 0.147, FP8 with 128x128 blocks (emulated) 0.489; vLLM's fp8 (per-tensor scales, GPU
# only) is not measured. See docs/generation.md, "Low-precision generation". About twice those: the
# probe then tells a refit that was not taken only from a model that moved further than the rounding.
MIXED_PRECISION_PROBE_TOLERANCE = {"float32": 0.3, "bfloat16": 0.3, "fp8": 1.0}


@register_generation_backend("vllm")
class VllmGeneration(WorkerGroupGeneration):
    """Data-parallel vLLM engines on a WorkerGroup of `VllmGenerationWorker`s.

    Args:
        cluster: the VirtualCluster to place engines on (GPU bundles: one per tensor-parallel
            rank; CPU bundles: one engine each).
        spec: the model, `policy.generation` settings (`vllm_cfg`), seed and worker timeout
            (`GenerationSpec`); `spec.max_model_len` is the longest prompt + generation when
            `vllm_cfg.max_model_len` is unset (None: 4096).
        bundle_indices: bundles of `cluster` to use (default None: all).
        name: worker group name in errors and logs (default "generation-vllm").
    """

    def __init__(
        self, cluster: VirtualCluster, spec: GenerationSpec, *, bundle_indices: Optional[Sequence[int]] = None,
        name: str = "generation-vllm",
    ) -> None:
        self.config = spec.config
        vcfg = self.config.vllm_cfg
        self.use_gpu = cluster.use_gpus
        tp = vcfg.tensor_parallel_size
        bundles = list(range(len(cluster.bundle_locations())) if bundle_indices is None else bundle_indices)
        if tp > 1 and not self.use_gpu:
            raise ValueError("policy.generation.vllm_cfg.tensor_parallel_size > 1 needs GPUs (cluster.gpus_per_node)")
        if len(bundles) % tp:
            raise ValueError(
                f"{len(bundles)} generation bundles are not a multiple of "
                f"policy.generation.vllm_cfg.tensor_parallel_size={tp}"
            )
        python = ensure_vllm_env(self.use_gpu, vcfg.requirements, vcfg.python_executable)
        env_vars = dict(VLLM_ENV_VARS)
        leaders = bundles[::tp]
        init_kwargs: dict[str, Any] = dict(spec=spec, use_gpu=self.use_gpu)
        actor_resources = None
        if tp > 1:  # GPU only: docs/scaling.md, "GPU-only paths"
            init_kwargs["gpu_share"] = cluster.actor_resources()["num_gpus"]
            init_kwargs["tp_bundle_groups"] = _tp_bundle_groups(cluster, bundles, tp)
            actor_resources = {"num_gpus": 0}  # vLLM's own Ray workers hold the GPUs
        self.tensor_parallel_size = tp
        worker_group = WorkerGroup(
            cluster,
            VllmGenerationWorker,
            init_kwargs=init_kwargs,
            name=name,
            bundle_indices=leaders,
            env_vars=env_vars,
            worker_timeout_s=spec.worker_timeout_s,
            heartbeat_timeout_s=spec.heartbeat_timeout_s,
            progress_limits=spec.progress_limits,
            python_executable=python,
            actor_resources=actor_resources,
        )
        self._attach(worker_group, spec)
        self._engine_dtype: torch.dtype = self.worker_group.run_rank0("get_weight_dtypes")

    # ------------------------------------------------------------------ refit
    def weight_dtypes(self) -> torch.dtype:
        """vLLM holds every weight in one dtype (`policy.precision`); refit buffers carry it."""
        return self._engine_dtype

    def prepare_refit_info(self, metadata: RefitMetadata) -> None:
        self.metadata = metadata
        self.worker_group.run_all("prepare_refit_info", metadata)

    def refit_from_policy(self, policy: Any, metadata: RefitMetadata, version: int) -> None:
        """Bucket by bucket: through the object store on CPU, CUDA IPC handles when colocated on
        GPUs (each bucket packed on every policy GPU, loaded by the vLLM worker on that GPU, then
        freed), a broadcast from policy rank 0 to every tensor-parallel rank when split."""
        if not self.use_gpu:
            super().refit_from_policy(policy, metadata, version)
        elif self.config.colocated.enabled:
            for bucket in range(len(metadata.bucket_sizes)):
                handles = policy.pack_for_refit_ipc(metadata, bucket)
                try:
                    self.worker_group.run_all("load_bucket_ipc", handles, bucket)
                finally:
                    policy.release_refit_buffers()
            self.finish_refit(version)
        else:
            self._refit_by_broadcast(policy, metadata, version, ranks_per_worker=self.tensor_parallel_size)

    def verify_refit(self, policy: Any, version: int) -> None:
        """Every engine's logprobs of a fixed probe sequence must match the policy's (mean
        absolute difference within `PROBE_TOLERANCE` of the engine's dtype)."""
        probe = self.probe_token_ids()
        expected = policy.get_logprobs(
            Batch(input_ids=torch.tensor([probe]), input_lengths=torch.tensor([len(probe)])), temperature=1.0
        )["logprobs"][0, 1 : len(probe)]
        tolerance = self._probe_tolerance()
        bad = []
        for engine, got in enumerate(self.worker_group.run_all("prompt_logprobs", probe)):
            error = (got[1:] - expected.float()).abs().mean().item()
            if not error <= tolerance:  # also catches NaN
                bad.append(f"engine {engine}: mean |difference| {error:.3g}")
        if bad:
            raise RefitVerificationError(
                f"refit to version {version} not taken: vLLM's logprobs of a probe sequence differ from the "
                f"policy's ({'; '.join(bad)}; tolerance {tolerance:g} for {self._engine_dtype}, "
                f"policy.generation.precision={self.config.precision}). The engine "
                "does not generate with the policy's weights."
            )

    def _probe_tolerance(self) -> float:
        """`PROBE_TOLERANCE` of the engine's dtype, or `MIXED_PRECISION_PROBE_TOLERANCE` of
        `policy.generation.precision` when it is not the trainer's `policy.precision`."""
        precision = self.config.precision
        if precision not in ("auto", self.spec.precision):
            return MIXED_PRECISION_PROBE_TOLERANCE[precision]
        return PROBE_TOLERANCE.get(self._engine_dtype, 5e-2)

    def probe_token_ids(self) -> list[int]:
        """A fixed pseudo-random token sequence over the vocabulary (the refit probe)."""
        vocab = int(self.worker_group.run_rank0("vocab_size"))
        # The engine scores a prompt only with room for one generated token after it.
        length = min(PROBE_LENGTH, int(self.worker_group.run_rank0("get_max_model_len")) - 1)
        generator = torch.Generator().manual_seed(20240611)
        return torch.randint(0, vocab, (length,), generator=generator).tolist()

    def get_weights_versions(self) -> list[int]:
        return self.worker_group.run_all("get_weights_version")



def _tp_bundle_groups(cluster: VirtualCluster, bundles: list[int], tp: int) -> list[list[int]]:
    """Per engine, the placement-group bundle indices of its `tp` consecutive bundles, which
    must lie in one placement group (one node)."""
    locations = cluster.bundle_locations()
    groups = []
    for start in range(0, len(bundles), tp):
        members = [locations[b] for b in bundles[start : start + tp]]
        if len({pg.id for pg, _ in members}) != 1:
            raise ValueError(
                f"a tensor-parallel group of {tp} GPUs would span nodes (bundles {bundles[start:start + tp]}): "
                "use a tensor_parallel_size that divides cluster.gpus_per_node"
            )
        groups.append([index for _, index in members])
    return groups
