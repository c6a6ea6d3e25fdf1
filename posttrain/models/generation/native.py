"""`NativeGeneration`: `policy.generation.backend=native`, the controller side of posttrain's own
PyTorch engines (`GenerationWorker`, worker.py), registered as the backend "native"."""

from __future__ import annotations

from typing import Any, Optional, Sequence


import torch

from posttrain.distributed.worker_group import WorkerGroup
from posttrain.models.generation.backends import register_generation_backend
from posttrain.models.generation.spec import GenerationSpec
from posttrain.models.generation.worker import GenerationWorker
from posttrain.models.generation.worker_group_generation import WorkerGroupGeneration
from posttrain.models.refit import RefitMetadata


@register_generation_backend("native")
class NativeGeneration(WorkerGroupGeneration):
    """Data-parallel native generation on a WorkerGroup of `GenerationWorker`s.

    Args:
        cluster: the VirtualCluster (or the local backend's LocalCluster) to place workers on.
        spec: the model, `policy.generation` settings, seed and worker timeout (`GenerationSpec`).
        bundle_indices: bundles of `cluster` to use (default None: all; one worker per bundle).
        name: worker group name in errors and logs (default "generation").
    """

    def __init__(
        self, cluster: Any, spec: GenerationSpec, *, bundle_indices: Optional[Sequence[int]] = None,
        name: str = "generation",
    ) -> None:
        worker_group = WorkerGroup(
            cluster, GenerationWorker, init_kwargs=dict(spec=spec), name=name, bundle_indices=bundle_indices,
            worker_timeout_s=spec.worker_timeout_s, heartbeat_timeout_s=spec.heartbeat_timeout_s,
            progress_limits=spec.progress_limits,
        )
        self._attach(worker_group, spec)

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
