"""`cluster`: where workers run (Ray or this process) and what each gets."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from posttrain.config.schema.base import Section


class ClusterConfig(Section):
    """The Ray cluster the job runs on and the resources of its workers."""

    backend: Literal["auto", "ray", "local"] = Field(
        "auto",
        description=(
            "Where workers run. 'ray': Ray actors, one process per worker (any size, several nodes, GPUs). 'local': "
            "every worker group and environment in this process, one worker each (starts in seconds: no Ray, "
            "torch imported once); for one node without GPUs or with one, native generation, sync training. 'auto': "
            "local when the job fits it (one node, no GPU, no cluster.ray_address, one worker per group, native "
            "generation, no async GRPO), else ray."
        ),
    )
    num_nodes: int = Field(1, ge=1, description="Nodes in the Ray cluster to use.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node; 0 runs on CPU.")
    gpu_memory_gb: Optional[float] = Field(
        None, gt=0,
        description=(
            "Memory of one GPU in GiB, for the memory plan (`posttrain plan`, checked before launch); None: "
            "torch.cuda's first device where the controller has one, else the plan is printed but not checked."
        ),
    )
    gpu_type: Literal["auto", "H100", "H200", "B200", "GB200", "A100", "L40S"] = Field(
        "auto",
        description=(
            "GPU model, for the time plan (`posttrain plan`: peak compute, memory and link bandwidth of each, "
            "docs/plan-time.md) and, when cluster.gpu_memory_gb is unset, the memory plan's GPU memory. 'auto': "
            "torch.cuda's first device where the controller has one, else H100."
        ),
    )
    host_memory_gb: Optional[float] = Field(
        None, gt=0,
        description="RAM of one node in GiB, for the memory plan of a CPU job; None: this machine's RAM.",
    )
    cpus_per_worker: Optional[float] = Field(
        None, gt=0,
        description=(
            "CPU cores per worker slot in CPU mode: the torch threads of its workers (colocated groups take turns, "
            "so each uses them all) and, with Ray, the logical CPUs its bundle reserves. Default (null): every core "
            "this process may use with the local backend, 1 with Ray."
        ),
    )
    adapt_threads_to_load: bool = Field(
        False,
        description=(
            "Local backend with cluster.cpus_per_worker unset: compute with the cores other processes leave free, "
            "measured once a second (at least 1 thread). Beside a busy loop on each of 2 cores the default's SFT step "
            "took 0.18 s adapting against 0.31 s with both threads (benchmarks/busy_machine.py). Off by default: "
            "float sums depend on the thread count, so a run would then depend on the machine's load in its last "
            "bits and a rerun would not repeat it exactly."
        ),
    )
    ray_address: Optional[str] = Field(None, description="Existing Ray cluster to join; None starts a local one.")
    placement_timeout_s: float = Field(
        120.0, gt=0,
        description=(
            "How long to wait for worker slots the cluster could hold but that are busy (other jobs) or, with "
            "cluster.autoscaling, on nodes still to join; a request the live nodes cannot hold fails at once."
        ),
    )
    worker_timeout_s: float = Field(
        1800.0, gt=0,
        description=(
            "Longest a single worker call (or environment step) may take, start-up and a phase's first call "
            "included; a worker past it counts as hung, and the run recovers from it as from a dead one "
            "(cluster.max_restarts). Calls of a phase that already finished once are bounded sooner "
            "(cluster.progress_timeout_*)."
        ),
    )
    heartbeat_timeout_s: float = Field(
        60.0, ge=0,
        description=(
            "A worker process whose heartbeat (a counter its own thread writes to Ray every few seconds) has not "
            "moved for this long while the controller waits for it has stopped answering (frozen, swapped out, "
            "deadlocked) and is recovered from as a dead one, without waiting for cluster.worker_timeout_s. "
            "Environment actors beat too. 0 turns heartbeats off. Ray backend only."
        ),
    )
    progress_timeout_s: dict[str, float] = Field(
        {},
        description=(
            "Per phase, the longest a worker call may run before it counts as making no progress (a deadlock, an "
            "endless loop, a collective whose peer is alive but stuck): the controller asks the worker for its "
            "Python stacks, names in one line where the call was stuck, and recovers from it as from a dead "
            "worker (cluster.max_restarts). A phase is the worker method called (train, generate, get_logprobs, "
            "get_values, save_checkpoint, broadcast_for_refit, ...), env_step for an environment's step (env_finish "
            "for its finish), e.g. "
            "{train: 900, env_step: 120}. A phase without one here gets cluster.progress_timeout_factor times its "
            "slowest call so far. Ray backend only."
        ),
    )
    progress_timeout_factor: float = Field(
        10.0, ge=0,
        description=(
            "A call of a phase without a cluster.progress_timeout_s counts as making no progress once it has run "
            "this many times longer than the slowest call of its phase so far in the run (at least "
            "cluster.progress_timeout_floor_s; before the first call of the phase finished, only "
            "cluster.worker_timeout_s applies). 0: only the phases of cluster.progress_timeout_s are bounded."
        ),
    )
    progress_timeout_floor_s: float = Field(
        300.0, ge=0,
        description="The least bound cluster.progress_timeout_factor gives a phase (seconds).",
    )
    max_restarts: int = Field(
        3, ge=0,
        description=(
            "How many times a run recovers in process from a dead or hung worker (a policy, critic, teacher or "
            "generation worker, an environment actor, or a lost node): it rebuilds what failed (the policy and "
            "the critic from the last checkpoint, so that needs checkpointing.enabled; a teacher from its model; "
            "generation by a refit from the policy), replays the interrupted step and goes on, counting "
            "recovery/restarts in the metrics. The count is kept beside the checkpoints (recovery.json), so it "
            "bounds the run across reruns of its command; a fresh checkpoint directory starts at 0. One more "
            "failure stops the run with a one-line reason and exit code 3, its last checkpoint whole. 0: stop at "
            "the first. Ray backend only: "
            "with cluster.backend=local a worker is the controller's own process, so a killed worker is the run "
            "(rerun it to resume from the last checkpoint)."
        ),
    )
    autoscaling: bool = Field(
        False,
        description=(
            "The Ray cluster adds nodes on demand (Ray autoscaler / KubeRay): a request larger than the live "
            "nodes waits up to cluster.placement_timeout_s instead of failing at once."
        ),
    )
    bundle_resources: dict[Literal["policy", "generation"], dict[str, float]] = Field(
        {},
        description=(
            "Extra Ray custom resources per worker slot of a group, e.g. {policy: {trainer: 1}, generation: "
            "{rollout: 1}} to put training and (non-colocated) generation workers on the nodes started with "
            "`ray start --resources '{\"trainer\": 8}'` / '{\"rollout\": 8}'."
        ),
    )

    @model_validator(mode="after")
    def _check_bundle_resources(self):
        for group, resources in self.bundle_resources.items():
            for key, value in resources.items():
                if key in ("CPU", "GPU") or value <= 0:
                    raise ValueError(
                        f"cluster.bundle_resources.{group}.{key}={value}: give positive custom resources here; "
                        "CPUs and GPUs come from cluster.cpus_per_worker and cluster.gpus_per_node"
                    )
        return self
