"""Ray worker layer: `Batch`, `VirtualCluster`, `WorkerGroup`, `DistributedWorker`, `init_ray`.

Names are resolved lazily so that `import posttrain.distributed` stays cheap; importing one of
them pulls in torch (Batch) or torch and ray (the rest).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Batch": "posttrain.distributed.batch",
    "ClusterError": "posttrain.distributed.cluster",
    "VirtualCluster": "posttrain.distributed.cluster",
    "DistributedWorker": "posttrain.distributed.worker_group",
    "WorkerError": "posttrain.distributed.worker_group",
    "WorkerGroup": "posttrain.distributed.worker_group",
    "WorkerTimeoutError": "posttrain.distributed.worker_group",
    "init_ray": "posttrain.distributed.ray_utils",
    "reuse_clusters": "posttrain.distributed.cluster_reuse",
    "shutdown_ray": "posttrain.distributed.ray_utils",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'posttrain.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
