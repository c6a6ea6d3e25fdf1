"""`DistributedWorker`: the worker side of a `WorkerGroup` (`worker_group.py`), the base class of
every worker actor (policy, generation, critic, teachers).

On construction it reads its identity from the environment the group set, starts its heartbeat
thread (`heartbeat.py`: beats, and the stacks `progress.py` asks for), sets its torch threads and
device, and joins its group's process group (`collective.py`).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from posttrain.distributed import actors, collective, heartbeat
from posttrain.utils import startup_gc

# Set by WorkerGroup for every actor; the timeout also bounds each torch.distributed collective.
RENDEZVOUS_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LOCAL_IDENTITY_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # a local worker joins no process group
COLLECTIVE_TIMEOUT_ENV = "POSTTRAIN_COLLECTIVE_TIMEOUT_S"
# torch threads of a CPU worker: its bundle's CPUs. Colocated groups share a bundle but take turns
# (generation, then training), so each may use all of them; Ray alone would give an actor holding
# half a CPU one thread.
NUM_THREADS_ENV = "POSTTRAIN_NUM_THREADS"


class DistributedWorker:
    """Base class of worker actors: joins the process group of its WorkerGroup on construction.

    Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` from the environment
    (WorkerGroup sets them) and joins the group's process group (`collective.init_worker_process_group`:
    gloo on CPU; gloo for CPU tensors beside nccl when the actor was given a GPU). Subclasses call `super().__init__()` first, then build models.
    """

    is_local = False  # set in __init__; a subclass that builds itself without it (vLLM's) runs under Ray

    def __init__(self) -> None:
        local = actors.worker_identity()  # a local actor's ranks; a Ray worker's are in its environment
        if local is None:  # a Ray worker's own process (a local one runs in the controller's)
            startup_gc.imports_done(freeze=True)
        env = local if local is not None else os.environ
        needed = LOCAL_IDENTITY_VARS if local is not None else RENDEZVOUS_ENV_VARS
        missing = [name for name in needed if name not in env]
        if missing:
            raise RuntimeError(
                f"{type(self).__name__} needs the environment variables {missing}; "
                "create workers through posttrain.distributed.worker_group.WorkerGroup"
            )
        self.rank = int(env["RANK"])
        self.world_size = int(env["WORLD_SIZE"])
        self.local_rank = int(env["LOCAL_RANK"])
        self.is_local = local is not None
        if not self.is_local and env.get(heartbeat.HEARTBEAT_ENV):
            heartbeat.start_beating(float(env[heartbeat.HEARTBEAT_ENV]))  # first: a long model load beats too
        if env.get(NUM_THREADS_ENV):
            torch.set_num_threads(int(env[NUM_THREADS_ENV]))
        if _has_gpu():
            # Ray shows each actor only its own GPU, so this is device 0; the modulo covers the rest.
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if self.is_local:
            # A local group has one worker, which needs no process group (every collective in the
            # workers is skipped at world size 1); the process-wide default group could not be
            # initialised once per local group anyway.
            return
        collective.init_worker_process_group(self.device.type, self.rank, self.world_size,
                                             float(env.get(COLLECTIVE_TIMEOUT_ENV, 1800.0)))

    def ping(self) -> bool:
        """True once the worker is constructed (a liveness check)."""
        return True

    def pid(self) -> int:
        """This worker's process id (on its node)."""
        return os.getpid()

    def host_memory(self, reset_peak: bool = False) -> dict[str, int]:
        """`{"rss": bytes resident now, "peak_rss": highest since the last reset}` of this worker's
        process (`posttrain.utils.memory`); `reset_peak` first starts a new high-water mark."""
        from posttrain.utils import memory

        if reset_peak:
            memory.reset_peak_rss()
        return {"rss": memory.rss_bytes(), "peak_rss": memory.peak_rss_bytes()}

    def get_node_ip(self) -> str:
        """IP address of the node this worker runs on."""
        if self.is_local:
            return "local"
        import ray

        return ray.util.get_node_ip_address()

    def get_node_id(self) -> str:
        """Ray node id (hex) of the node this worker runs on ("local" for the local backend)."""
        if self.is_local:
            return "local"
        import ray

        return ray.get_runtime_context().get_node_id()

    def all_reduce_sum(self, value: torch.Tensor | float) -> torch.Tensor | float:
        """Sum `value` over all ranks; returns the same kind (CPU tensor or Python number)."""
        tensor = collective.all_reduce(torch.as_tensor(value).to(self.device).clone())
        return tensor.cpu() if isinstance(value, torch.Tensor) else tensor.item()

    def peak_rss_mb(self) -> float:
        """This worker process's peak resident memory, in MiB, since it started or the last reset
        (`posttrain.utils.memory`; not `ru_maxrss`, which no reset clears: a reused process,
        `worker_host.py`, would report an earlier member's peak)."""
        from posttrain.utils import memory

        return memory.peak_rss_bytes() / 2**20

    def shutdown(self) -> bool:
        """Leave the process group; called by `WorkerGroup.shutdown` before the actor is killed."""
        if dist.is_initialized():
            dist.destroy_process_group()
        return True


def _has_gpu() -> bool:
    """Whether this process should use CUDA.

    Inside a Ray actor: only if Ray assigned it a GPU. CPU-only actors on a GPU machine still see
    every GPU, and several ranks on one device would break nccl.
    """
    if not torch.cuda.is_available():
        return False
    if actors.worker_identity() is not None or "ray" not in sys.modules:
        return True  # a local actor (or no Ray at all): the process's GPU
    import ray

    return bool(ray.get_gpu_ids()) if ray.is_initialized() else True
