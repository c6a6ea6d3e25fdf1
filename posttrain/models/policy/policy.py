"""`Policy`: the controller-side handle on a group of `PolicyWorker`s (data and tensor parallel).

The algorithm loops call it with whole batches; it shards rows across the data-parallel ranks
(the `tensor_parallel_size` workers of one tensor-parallel group get the same rows), calls the
workers together (they run collectives among themselves) and returns results in the caller's
row order.

Colocated with generation on GPUs, the workers' training state leaves the device while the engine
generates (`offload_to_host`, `policy.offload_during_generation`, models/policy/offload.py); every
call that needs it on the device brings it back first (`_on_device`), so no caller can forget.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from posttrain.config.schema import PolicyConfig
from posttrain.distributed.batch import Batch
from posttrain.distributed.worker_group import WorkerGroup
from posttrain.models.policy.offload import offload_note, offloads_during_generation
from posttrain.models.policy.worker import PolicyWorker
from posttrain.utils.phase_memory import GIB, merge_peaks

if TYPE_CHECKING:
    from posttrain.distributed.progress import ProgressLimits
    from posttrain.distributed.cluster import VirtualCluster


class Policy:
    """A policy (or reward model) on `cfg.num_workers` bundles of `cluster`: `cfg.dp_size`
    data-parallel ranks of `cfg.tensor_parallel_size` workers each (see `parallel.py`).

    Args:
        cluster: where the workers run; uses its first `cfg.num_workers` bundles.
        cfg: the `policy` config section (`PolicyConfig` or a dict).
        init_reference_model: keep the initial weights for `get_reference_logprobs` (KL, DPO).
        init_optimizer: build optimizer and scheduler (default True).
        weights_path: a `save_checkpoint` directory to start from (default None: `cfg.model_name`).
        name: worker-group name shown in errors and logs (default "policy").
        model_type: "lm" (default), "reward" (scalar score per sequence) or "value" (a value per
            token: PPO's critic); see `PolicyWorker`.
        worker_timeout_s: longest wait for one call (default 1800.0, `cluster.worker_timeout_s`).
        heartbeat_timeout_s: a worker silent for this long has stopped answering (default 0.0: no
            heartbeats; `cluster.heartbeat_timeout_s`, `WorkerGroup`).
        progress_limits: the bounds of its calls' phases (`progress.ProgressLimits`; default None:
            none; `cluster.progress_timeout_*`, `WorkerGroup`).
    """

    def __init__(
        self,
        cluster: "VirtualCluster",
        cfg: PolicyConfig | dict,
        *,
        init_reference_model: bool,
        init_optimizer: bool = True,
        weights_path: Optional[str] = None,
        name: str = "policy",
        model_type: str = "lm",
        worker_timeout_s: float = 1800.0,
        heartbeat_timeout_s: float = 0.0,
        progress_limits: Optional["ProgressLimits"] = None,
    ) -> None:
        self.cfg = cfg if isinstance(cfg, PolicyConfig) else PolicyConfig.model_validate(cfg)
        if cluster.world_size() < self.cfg.num_workers:
            raise ValueError(
                f"policy.num_workers={self.cfg.num_workers} but the cluster has only {cluster.world_size()} bundles"
            )
        self.dp_size = self.cfg.dp_size
        self.tp_size = self.cfg.tensor_parallel_size
        # The ranks of a TP, CP or PP group see the same rows: one shard per data-parallel rank.
        self.replicas = self.cfg.num_workers // self.cfg.dp_size
        self.worker_group = WorkerGroup(
            cluster,
            PolicyWorker,
            init_kwargs=dict(
                cfg=self.cfg.model_dump(),
                init_reference_model=init_reference_model,
                init_optimizer=init_optimizer,
                weights_path=None if weights_path is None else str(weights_path),
                model_type=model_type,
            ),
            name=name,
            bundle_indices=list(range(self.cfg.num_workers)),
            worker_timeout_s=worker_timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            progress_limits=progress_limits,
        )
        on_gpus = bool(getattr(cluster, "use_gpus", False))
        self.offloads_during_generation = offloads_during_generation(self.cfg, on_gpus)
        note = offload_note(self.cfg, on_gpus)
        if note and name == "policy":
            print(note, flush=True)
        self._offloaded = False
        self._offloaded_bytes = 0  # over the workers, since the last take_phase_memory
        # `train` calls begun: a step that failed after its update must not be replayed on top of it.
        self.updates = 0

    # ------------------------------------------------------------------------ memory phases
    def offload_to_host(self) -> int:
        """When `policy.offload_during_generation` applies: move every worker's parameters,
        gradients and optimizer state to host memory (the generation phase begins). Returns the
        bytes moved over all workers (0 when off or already offloaded)."""
        if not self.offloads_during_generation or self._offloaded:
            return 0
        moved = sum(self.worker_group.run_all("offload_to_host"))
        self._offloaded, self._offloaded_bytes = True, self._offloaded_bytes + moved
        return moved

    def _on_device(self) -> None:
        """Bring back what `offload_to_host` moved (no call when nothing is away)."""
        if self._offloaded:
            self.worker_group.run_all("reload_to_device")
            self._offloaded = False

    def reload_to_device(self) -> None:
        """The end of the generation phase: the training state back on the workers' devices."""
        self._on_device()

    def take_phase_memory(self) -> dict[str, float]:
        """The workers' peak memory per phase since the last call (`utils/phase_memory.py`: the
        highest over workers), plus `memory/offload/moved_gb` when the policy was offloaded."""
        peaks = merge_peaks(self.worker_group.run_all("take_phase_memory"))
        if self._offloaded_bytes:
            peaks["memory/offload/moved_gb"] = self._offloaded_bytes / GIB
            self._offloaded_bytes = 0
        return peaks

    # ------------------------------------------------------------------------------ logprobs
    def get_logprobs(self, batch: Batch, temperature: float = 1.0) -> Batch:
        """`Batch({"logprobs": [B, S]})` in the caller's row order (see `PolicyWorker.get_logprobs`)."""
        self._on_device()
        return self.worker_group.run_sharded("get_logprobs", batch, replicas=self.replicas, temperature=temperature)

    def get_reference_logprobs(self, batch: Batch, temperature: float = 1.0) -> Batch:
        """Like `get_logprobs`, from the initial weights (needs `init_reference_model=True`)."""
        self._on_device()
        return self.worker_group.run_sharded("get_reference_logprobs", batch, replicas=self.replicas, temperature=temperature)

    def get_topk_logits(self, batch: Batch, k: int, temperature: float = 1.0, token_logprobs: bool = False) -> Batch:
        """`Batch(topk_logits, topk_indices)`, each `[B, S, k]` (with `token_logprobs`, also `token_logprobs`
        `[B, S]`), in the caller's row order (see `PolicyWorker.get_topk_logits`): what a distillation
        teacher gives the student."""
        self._on_device()
        options = {"token_logprobs": True} if token_logprobs else {}
        return self.worker_group.run_sharded("get_topk_logits", batch, replicas=self.replicas, k=k,
                                             temperature=temperature, **options)

    def get_scores(self, batch: Batch) -> Batch:
        """`Batch({"scores": [B]})` from a reward model (`model_type="reward"`)."""
        self._on_device()
        return self.worker_group.run_sharded("get_scores", batch, replicas=self.replicas)

    def get_values(self, batch: Batch) -> Batch:
        """`Batch({"values": [B, S]})` from a value model (`model_type="value"`, PPO's critic)."""
        self._on_device()
        return self.worker_group.run_sharded("get_values", batch, replicas=self.replicas)

    # --------------------------------------------------------------------------------- train
    def train(
        self,
        batch: Batch,
        loss_fn: Any,
        *,
        global_batch_size: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """One optimizer step per `global_batch_size` rows (default `policy.train_global_batch_size`).

        Rows `[k*G, (k+1)*G)` of `batch` form optimizer step k, whatever the number of workers:
        each worker gets `G / dp` rows of every step. Returns the metrics of
        `PolicyWorker.train`, already reduced over workers (sums, min/max; `lr` and `grad_norm`
        are global values).
        """
        gbs = global_batch_size or self.cfg.train_global_batch_size
        if gbs % self.dp_size:
            raise ValueError(
                f"global batch size {gbs} (policy.train_global_batch_size or the global_batch_size argument) "
                f"is not divisible by the {self.dp_size} data-parallel ranks (policy.num_workers / "
                "policy.tensor_parallel_size)"
            )
        if batch.size == 0 or batch.size % gbs:
            raise ValueError(
                f"train got {batch.size} rows; it needs a positive multiple of the global batch size {gbs} "
                "(policy.train_global_batch_size or the global_batch_size argument)"
            )
        # Reorder so that the contiguous shard of rank r holds, for every step k, rows
        # k*G + r*L ... k*G + (r+1)*L - 1 (L = G / dp), in step order.
        local = gbs // self.dp_size
        steps = batch.size // gbs
        check = getattr(loss_fn, "check_train_batch", None)  # a loss may refuse a batch it cannot train on
        if check is not None:
            check(batch, steps)
        self._on_device()
        self.updates += 1  # before the call: a failed update may have stepped some ranks' optimizers
        order = torch.arange(batch.size).view(steps, self.dp_size, local).transpose(0, 1).flatten()
        refs = self.worker_group.run_sharded_async(
            "train",
            batch.select(order),
            replicas=self.replicas,
            loss_fn=loss_fn,
            global_batch_size=gbs,
            micro_batch_size=micro_batch_size,
            temperature=temperature,
        )
        return self.worker_group.get(refs)[0]  # every rank returns the same reduced metrics

    # ------------------------------------------------------------------ weights & checkpoints
    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> str:
        """Sharded checkpoint directory (atomic rename); see `posttrain.models.policy.checkpoint`."""
        self._on_device()
        return self.worker_group.run_all("save_checkpoint", str(path), save_optimizer=save_optimizer)[0]

    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> None:
        self._on_device()
        self.worker_group.run_all("load_checkpoint", str(path), load_optimizer=load_optimizer)

    def export_hf(self, out_dir: str | Path) -> str:
        """Write a consolidated Hugging Face directory (safetensors, config, tokenizer) to `out_dir`,
        through a temporary sibling, so a half-written export is never found there; a previous
        export in `out_dir` is replaced."""
        import shutil

        from posttrain.utils.checkpoint import publish_dir

        out_dir = Path(out_dir)
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted export
        self._on_device()
        self.worker_group.run_all("export_hf", str(tmp))
        return str(publish_dir(tmp, out_dir))

    def state_dict_for_export(self) -> dict[str, torch.Tensor]:
        """Full weights in HF names (gathered on rank 0; every worker takes part)."""
        self._on_device()
        return self.worker_group.run_all("state_dict_for_export")[0]

    def refit_bucket_bytes(self) -> int:
        """Bytes per refit bucket: `policy.refit_buffer_size_gb`, or by default the smallest of
        the workers' shares of their free memory (`refit.default_bucket_bytes`)."""
        return min(self.worker_group.run_all("refit_bucket_bytes"))

    def pack_for_refit(self, metadata, bucket: int) -> Any:
        """Rank 0's packed refit bucket `bucket` as an ObjectRef (not fetched: the generation
        workers read it straight from the object store). Every worker takes part in gathering."""
        self._on_device()
        refs = self.worker_group.run_all_async("pack_for_refit", metadata, bucket)
        self.worker_group.get(refs[1:])
        return refs[0]

    def pack_for_refit_ipc(self, metadata, bucket: int) -> dict[str, list]:
        """Colocated GPU refit: `{gpu uuid: CUDA IPC handles}` of bucket `bucket` packed on every
        policy GPU (kept until `release_refit_buffers`)."""
        self._on_device()
        handles: dict[str, list] = {}
        for per_rank in self.worker_group.run_all("pack_for_refit_ipc", metadata, bucket):
            handles.update(per_rank)
        return handles

    def release_refit_buffers(self) -> None:
        self.worker_group.run_all("release_refit_buffers")

    def init_refit_broadcast(self, host: str, port: int, world_size: int) -> Any:
        """Split refit: rank 0 joins the broadcast group (returns the futures: the generation
        workers join concurrently)."""
        return self.worker_group.run_all_async("init_refit_broadcast", host, port, world_size)

    def broadcast_for_refit(self, metadata) -> Any:
        """Split refit: gather and broadcast bucket by bucket from rank 0 (returns the futures)."""
        self._on_device()
        return self.worker_group.run_all_async("broadcast_for_refit", metadata)

    def weights_checksum(self, dtypes: Optional[dict[str, torch.dtype]] = None) -> str:
        """Checksum of the full weights, cast to `dtypes` (name -> dtype) where given (see
        `refit.state_dict_checksum`)."""
        self._on_device()
        return self.worker_group.run_all("weights_checksum", dtypes=dtypes)[0]

    def refit_info(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """`(name, shape, dtype)` of every exported tensor, for `Generation.prepare_refit_info`."""
        return self.worker_group.run_rank0("refit_info")

    def restart(self) -> None:
        """Rebuild every worker after one died or stopped answering (`WorkerGroup.restart`): the
        FSDP process group takes no new member, and no rank holds a whole copy of the shards to
        rebuild another from, so all of them start again as at first (`policy.model_name`, or
        `weights_path`); the caller then loads the last checkpoint (`TrainingLoop.rewind`)."""
        self.worker_group.restart()
        self._offloaded, self._offloaded_bytes = False, 0

    def shutdown(self) -> None:
        self.worker_group.shutdown()
