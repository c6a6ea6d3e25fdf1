"""Set-up shared by the training loops: seeding, Ray, clusters, data, logging and resume state."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from posttrain.config.loader import save_config
from posttrain.config.schema import MasterConfig

log = logging.getLogger("posttrain")

LOADER_STATE_FILE = "dataloader.json"


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def sample_seeds(base_seed: int, step: int, n: int) -> torch.Tensor:
    """Per-sample sampling seeds that depend only on (seed, step, index).

    Generation is then reproducible across resume, batching and the number of workers.
    """
    return torch.arange(n, dtype=torch.long) + (base_seed * 1_000_003 + step * 65_537) % (2**40)


def with_schedule_horizon(cfg, max_num_steps: int):
    """Fill `policy.scheduler.total_steps` (decay horizon) from the run length when unset."""
    if cfg.policy.scheduler.total_steps is not None:
        return cfg
    cfg = cfg.model_copy(deep=True)
    cfg.policy.scheduler.total_steps = max_num_steps
    return cfg


def start_ray(cfg: MasterConfig) -> None:
    from posttrain.distributed.ray_utils import init_ray

    cluster = cfg.cluster
    init_ray(address=cluster.ray_address)


def make_cluster(cfg: MasterConfig, num_workers: int, *, colocated_groups: int = 1, name: str = "policy"):
    """A `VirtualCluster` of `num_workers` bundles per node (GPUs when `cluster.gpus_per_node`)."""
    from posttrain.distributed.cluster import VirtualCluster

    c = cfg.cluster
    use_gpus = c.gpus_per_node > 0
    per_node = min(num_workers, c.gpus_per_node) if use_gpus else num_workers
    nodes = max(1, -(-num_workers // per_node))
    if nodes > c.num_nodes:
        raise ValueError(
            f"{name} needs {num_workers} workers but cluster.num_nodes={c.num_nodes} x "
            f"{per_node} per node is too few"
        )
    return VirtualCluster(
        [per_node] * nodes,
        use_gpus=use_gpus,
        cpus_per_bundle=c.cpus_per_worker,
        max_colocated_worker_groups=colocated_groups,
        placement_timeout_s=c.placement_timeout_s,
        name=name,
    )


def make_generation(cfg: MasterConfig, cluster, *, seed: int = 0):
    """Generation workers for `policy.model_name` with `policy.generation` settings."""
    from posttrain.models.generation.interface import Generation

    p = cfg.policy
    return Generation(
        cluster, p.generation, p.model_name, tokenizer_name=p.tokenizer_name, tiny_arch=p.tiny_arch,
        precision=p.precision, seed=seed, worker_timeout_s=cfg.cluster.worker_timeout_s,
    )


def prepare_run_dirs(cfg: MasterConfig) -> None:
    """Create the log dir and save the resolved config beside the run's logs."""
    log_dir = Path(cfg.logger.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, log_dir / "config.yaml")


def save_loader_state(path: Path, state: dict) -> None:
    (path / LOADER_STATE_FILE).write_text(json.dumps(state))


def load_loader_state(path: Path) -> Optional[dict]:
    f = path / LOADER_STATE_FILE
    return json.loads(f.read_text()) if f.exists() else None


def prefixed(metrics: dict, prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()}


def save_training_state(
    checkpointer, policy, loader, step: int, metrics: dict, training_info: Optional[dict] = None
) -> None:
    """Write `step_N/` atomically: policy (weights, optimizer, RNG), loader position, info.

    `metrics` rank the checkpoint for `keep_top_k`; `training_info` is extra resume state.
    """
    tmp = checkpointer.begin(step)
    policy.save_checkpoint(tmp / "policy")
    save_loader_state(tmp, loader.state_dict())
    checkpointer.finalize(step, tmp, metrics, training_info)


def restore_training_state(checkpointer, policy, loader, logger) -> Optional[dict]:
    """Load the latest complete checkpoint, if any; returns its training info."""
    latest = checkpointer.latest()
    if latest is None:
        logger.truncate_after(-1)  # a fresh start: forget metrics of a run that never checkpointed
        return None
    info = checkpointer.load_training_info(latest)
    policy.load_checkpoint(latest / "policy")
    loader.load_state_dict(load_loader_state(latest))
    logger.truncate_after(int(info["step"]))
    print(f"[posttrain] resumed from {latest} (step {info['step']})", flush=True)
    return info
