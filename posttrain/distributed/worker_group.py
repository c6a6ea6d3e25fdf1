"""`WorkerGroup`: N Ray actors, one per bundle of a `VirtualCluster`, forming one torch.distributed job.

The controller calls methods on all workers at once (`run_all`), on rank 0 only (`run_rank0`) or
on shards of a `Batch` (`run_sharded`, results gathered back in the original row order). Every
wait goes through `get`, which fails fast: the first worker whose call raises or whose process
dies ends the wait with a `WorkerError` naming it, instead of waiting for the other ranks, which
may be blocked forever in a collective with the dead one; a worker whose process stops answering
(no heartbeat for `cluster.heartbeat_timeout_s`, `heartbeat.py`), or whose call makes no progress
(past its phase's bound, `progress.py`: the error says where it was stuck), ends it with a
`WorkerTimeoutError`. `restart` starts every member again (a new process group, on bundles placed
again after a lost node): the recovery of a run (`posttrain.distributed.recovery`) builds on it.
Modelled on NeMo-RL's `RayWorkerGroup`.

On a `LocalCluster` (`cluster.backend: local`) the group is one `LocalActor` in the controller's
process instead (`posttrain.distributed.actors`); everything else here is the same code. On a
`VirtualCluster(reuse_worker_processes=True)` each member lives in a `WorkerHost` process that
outlives the group when it shuts down cleanly, for the next member on its node (`worker_host.py`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Sequence

from posttrain.distributed import actors, collective, heartbeat, progress
from posttrain.distributed.actors import LocalCluster
from posttrain.distributed.batch import Batch
from posttrain.distributed.distributed_worker import (  # noqa: F401 (DistributedWorker: part of this module's interface)
    COLLECTIVE_TIMEOUT_ENV,
    LOCAL_IDENTITY_VARS,
    NUM_THREADS_ENV,
    RENDEZVOUS_ENV_VARS,
    DistributedWorker,
)

if TYPE_CHECKING:
    from posttrain.distributed.cluster import VirtualCluster

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0
FAILURE_GRACE_S = 1.0  # after a failure, how long to wait for the other ranks' errors
PROGRESS_CHECK_LAG_S = 0.05  # how long after a call's progress bound falls due it is checked
# The rendezvous port is one found free on rank 0's node just before the workers start; another
# process (a parallel test, another job) may bind it first: the group then starts again on a new one.
RENDEZVOUS_ATTEMPTS = 3
# Ray counts resources in units of 1e-4: a third of a CPU shows as 0.3333 free when 0.333333 is
# asked (a group of three colocated groups, PPO's policy, critic and engine, restarting).
RAY_RESOURCE_UNIT = 1e-4


def is_port_taken(error: BaseException) -> bool:
    """Whether `error` (a worker group's start-up failure, its causes included) is rank 0's
    rendezvous store failing to listen on a port another process took (EADDRINUSE)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if "EADDRINUSE" in str(error) or "address already in use" in str(error).lower():
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


# The keyword argument that carries a member's own variables to its constructor (`_setting_its_environment`).
MEMBER_ENV_KWARG = "_posttrain_member_env"
_member_classes: dict[type, type] = {}


def _setting_its_environment(actor_cls: type[DistributedWorker]) -> type[DistributedWorker]:
    """`actor_cls` whose constructor first puts `MEMBER_ENV_KWARG`'s variables (its rank, the
    rendezvous address, its thread count...) into `os.environ`, where `DistributedWorker` and
    torch.distributed read them. Same name, so Ray's process titles and errors name the worker."""
    if actor_cls not in _member_classes:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            os.environ.update(kwargs.pop(MEMBER_ENV_KWARG))
            actor_cls.__init__(self, *args, **kwargs)

        _member_classes[actor_cls] = type(actor_cls.__name__, (actor_cls,), {
            "__init__": __init__, "__qualname__": actor_cls.__qualname__, "__module__": actor_cls.__module__,
            "__doc__": actor_cls.__doc__,
        })
    return _member_classes[actor_cls]


class WorkerError(RuntimeError):
    """A worker's call failed or its process died; the message names the worker and the cause.

    `group` is the worker group's name and `ranks` the ranks that failed (or did not answer), for
    recovery to know whom to rebuild ("" and () when unknown, e.g. after crossing a process)."""

    def __init__(self, message: str, *, group: str = "", ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.group, self.ranks = group, tuple(ranks)


class WorkerTimeoutError(WorkerError):
    """Workers did not answer within the wall-clock limit (`worker_timeout_s`)."""


class WorkerGroup:
    """One actor of `actor_cls` per bundle of `cluster`, with torch.distributed set up among them.

    Args:
        cluster: the VirtualCluster whose bundles host the workers.
        actor_cls: a plain subclass of `DistributedWorker` (not `ray.remote`-decorated; the group
            wraps it).
        init_kwargs: keyword arguments for `actor_cls(...)` (default none).
        name: shown in errors and logs (default: the class name).
        bundle_indices: which bundles of the cluster (rank order of
            `cluster.bundle_locations()`) to use; default None uses all of them. Rank *r* of the
            group runs on bundle `bundle_indices[r]`.
        env_vars: extra environment variables for every worker (e.g. NCCL settings), set before its
            interpreter starts (a per-actor Ray `runtime_env`; without them each member sets its
            rank's variables itself, at the start of its constructor).
        python_executable: interpreter of an isolated environment to start the workers with
            (`posttrain.distributed.isolated_env.ensure_isolated_env`); default None: the driver's
            environment. This checkout of posttrain is put on the workers' `PYTHONPATH` there.
        actor_resources: overrides of the Ray resources each actor asks for (default None: its
            share of a bundle, `cluster.actor_resources()`), e.g. `{"num_gpus": 0}` for an actor
            whose GPU work runs in processes it starts itself.
        worker_timeout_s: longest wait for any call, actor start-up included, and the timeout of
            torch.distributed collectives (default 1800.0, `cluster.worker_timeout_s`).
        heartbeat_timeout_s: a worker whose process has not beaten for this long while the group
            waits for it has stopped answering (`heartbeat.py`; default 0.0: no heartbeats;
            `cluster.heartbeat_timeout_s`). Ray backend only.
        progress_limits: the bounds of its calls' phases (`progress.ProgressLimits`,
            `cluster.progress_timeout_*`; default None: none). Ray backend only.
    """

    def __init__(
        self,
        cluster: VirtualCluster | LocalCluster,
        actor_cls: type[DistributedWorker],
        *,
        init_kwargs: Mapping[str, Any] | None = None,
        name: str = "",
        bundle_indices: Sequence[int] | None = None,
        env_vars: Mapping[str, str] | None = None,
        worker_timeout_s: float = 1800.0,
        python_executable: str | os.PathLike | None = None,
        actor_resources: Mapping[str, float] | None = None,
        heartbeat_timeout_s: float = 0.0,
        progress_limits: progress.ProgressLimits | None = None,
    ) -> None:
        if not (isinstance(actor_cls, type) and issubclass(actor_cls, DistributedWorker)):
            raise TypeError(
                f"actor_cls must be a plain subclass of DistributedWorker (WorkerGroup applies ray.remote), "
                f"got {actor_cls!r}"
            )
        clashes = sorted(set(env_vars or {}) & {*RENDEZVOUS_ENV_VARS, COLLECTIVE_TIMEOUT_ENV, NUM_THREADS_ENV,
                                                heartbeat.HEARTBEAT_ENV})
        if clashes:
            raise ValueError(f"env_vars may not set {clashes}: WorkerGroup sets them per worker")
        self.name = name or actor_cls.__name__
        self.cluster = cluster
        self.worker_timeout_s = worker_timeout_s
        self._actor_cls = actor_cls
        self._python_executable = None if python_executable is None else str(python_executable)
        self._actor_resources = {**cluster.actor_resources(), **(actor_resources or {})}
        self._pending: dict[Any, tuple[int, str]] = {}  # ref -> (rank, method), for errors
        self.is_local = isinstance(cluster, LocalCluster)
        # Members in reusable processes (`worker_host.py`) where the cluster keeps them and they need
        # nothing set before their interpreter starts (env_vars, an isolated environment are a
        # runtime_env). CPU only: a reused process's CUDA context and memory are untested.
        pool = getattr(cluster, "worker_hosts", None)
        self._host_pool = pool if (pool is not None and not self.is_local and not env_vars
                                   and self._python_executable is None and not cluster.use_gpus) else None
        self._failed = False  # a failure seen (or a restart): the processes are not reused
        # Heartbeats (Ray only: a local worker is this process, which cannot stop without us).
        beats = heartbeat_timeout_s > 0 and not self.is_local
        self._watch = heartbeat.HeartbeatWatch(heartbeat_timeout_s) if beats else None
        watched = progress_limits is not None and progress_limits.enabled and not self.is_local
        self._progress = progress.ProgressWatch(progress_limits) if watched else None
        # The heartbeat thread also answers requests for stacks: it runs when either needs it.
        self._beat_period = heartbeat.period_for(heartbeat_timeout_s) if self._watch else \
            heartbeat.STACKS_POLL_S if self._progress else 0.0

        size = cluster.world_size()
        bundle_indices = list(range(size) if bundle_indices is None else bundle_indices)
        if not bundle_indices or len(set(bundle_indices)) != len(bundle_indices):
            raise ValueError(f"bundle_indices must be distinct and non-empty, got {bundle_indices}")
        if any(not 0 <= b < size for b in bundle_indices):
            raise ValueError(f"bundle_indices {bundle_indices} out of range: the cluster has {size} bundles")
        if self.is_local and self._python_executable is not None:
            raise ValueError(f"WorkerGroup {self.name!r}: an isolated Python environment needs cluster.backend=ray")

        self.workers: list[Any] = []  # Ray actor handles, or one LocalActor
        self.node_ips = ["?"] * len(bundle_indices)
        self._start = (bundle_indices, dict(init_kwargs or {}), dict(env_vars or {}))  # kept for `restart`
        self._start_members()

    def _start_members(self) -> None:
        bundle_indices, init_kwargs, env_vars = self._start
        for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
            try:
                if self.is_local:
                    self._spawn_local(init_kwargs)
                else:
                    # Open until its shutdown: not handed to the next job, its members' CPUs counted.
                    self.cluster.group_started(self)
                    self._wait_for_room(bundle_indices)
                    self.get(self._spawn(bundle_indices, init_kwargs, env_vars))  # hosted members' constructors
                # Constructing = joining the process group; a failure in any __init__ surfaces here.
                self.node_ips = self.run_all("get_node_ip")
                return
            except BaseException as error:
                self._failed = True
                self.shutdown(timeout_s=1.0)  # ranks that did start wait in the rendezvous; kill them
                if self.is_local or attempt == RENDEZVOUS_ATTEMPTS or not is_port_taken(error):
                    raise
                logger.warning("WorkerGroup %r: the rendezvous port was taken before rank 0 listened on it; "
                               "starting the workers again on another port (attempt %d of %d)",
                               self.name, attempt + 1, RENDEZVOUS_ATTEMPTS)

    def restart(self) -> None:
        """Start every member again: the recovery of a member that died or stopped answering.

        All of them, on the same bundles, as a new process group (a new `MASTER_PORT`): the others
        may be waiting in a collective with the failed one, and a process group takes no new
        member. After a lost node the bundles are first placed again on the live nodes
        (`VirtualCluster.replace_lost_nodes`, which raises `ClusterError` when they cannot hold
        them). The members start as they first did (same constructor arguments); the state they
        had is the caller's to restore (a checkpoint, a refit).
        """
        if self.is_local:
            raise WorkerError(f"WorkerGroup {self.name!r}: the local backend cannot restart a worker (it is this process)",
                              group=self.name)
        self._failed = True  # whatever the members went through, their processes are not reused
        self.shutdown(timeout_s=0.0)  # nobody to say goodbye to: the failed member will not answer
        self.cluster.replace_lost_nodes()
        self._start_members()

    def faults(self) -> list[tuple[int, str, str | None]]:
        """`(rank, cause in words, IP of the lost node or None)` of every member Ray reports dead
        (`actors.actor_death`: Ray's record, which answers at once however busy the members are)."""
        dead = []
        for rank, worker in enumerate(self.workers):
            death = actors.actor_death(worker)
            if death is not None:
                dead.append((rank, *death))
        return dead

    def describe_rank(self, rank: int) -> str:
        """"rank R (node IP)": a member in words, for messages."""
        return f"rank {rank} (node {self.node_ips[rank]})"

    def _spawn_local(self, init_kwargs: Mapping[str, Any]) -> None:
        """The local backend: one worker, an object on a thread of this process (environment
        variables are the process's own and are not set per worker here)."""
        identity = dict(zip(LOCAL_IDENTITY_VARS, ("0", "1", "0")))
        self.workers.append(actors.LocalActor(self._actor_cls, kwargs=init_kwargs, name=self.name, identity=identity))

    def _spawn(self, bundle_indices: list[int], init_kwargs: Mapping[str, Any], env_vars: Mapping[str, str]) -> list[Any]:
        """Start one actor per bundle with its rendezvous environment (they rendezvous in __init__);
        returns the futures of the constructors that run as calls (members in reused processes,
        `worker_host.py`; a plain actor's failed constructor fails its first call instead)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        locations = self.cluster.bundle_locations()
        node_ids = self.cluster.bundle_node_ids()
        master_addr, master_port = self.cluster.master_address_and_port(bundle_indices[0])
        # The user's variables (NCCL's, thread counts) must exist before the interpreter starts, and
        # an isolated environment is a runtime_env anyway; otherwise each member sets its own in
        # its constructor, before it joins the process group: a per-actor runtime_env would start
        # it through Ray's `setup_worker.py` first (0.4 s more CPU per actor).
        in_runtime_env = bool(env_vars) or self._python_executable is not None
        remote_cls = ray.remote(self._actor_cls if in_runtime_env else _setting_its_environment(self._actor_cls))
        seen_per_node: dict[str, int] = {}
        constructing = []
        for rank, bundle in enumerate(bundle_indices):
            local_rank = seen_per_node.get(node_ids[bundle], 0)  # rank among this group's workers on that machine
            seen_per_node[node_ids[bundle]] = local_rank + 1
            env = {key: str(value) for key, value in env_vars.items()}
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(len(bundle_indices)),
                LOCAL_RANK=str(local_rank),
                MASTER_ADDR=master_addr,
                MASTER_PORT=str(master_port),
            )
            env[COLLECTIVE_TIMEOUT_ENV] = str(self.worker_timeout_s)
            if self._beat_period:
                env[heartbeat.HEARTBEAT_ENV] = str(self._beat_period)
            if not self.cluster.use_gpus:
                env[NUM_THREADS_ENV] = str(max(1, int(self.cluster.cpus_per_bundle)))
            if self._host_pool is not None:  # on the bundle's node, its CPUs counted by the cluster
                ranks = (rank, len(bundle_indices)) if len(bundle_indices) > 1 else None  # worker_host.py: why
                member = self._host_pool.host(node_ids[bundle], ranks)
                ref = member.construct(self._actor_cls, dict(init_kwargs), env)
                self._pending[ref] = (rank, "__init__")  # for errors, as `_submit` records a call
                constructing.append(ref)
                self.workers.append(member)
                continue
            pg, index = locations[bundle]
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
            options: dict[str, Any] = {}
            kwargs = dict(init_kwargs)
            if self._python_executable is not None:
                from posttrain.distributed.isolated_env import isolated_runtime_env

                options["runtime_env"] = isolated_runtime_env(self._python_executable, env)
            elif in_runtime_env:
                options["runtime_env"] = {"env_vars": env}  # set before the interpreter starts (CUDA/NCCL read them early)
            else:
                kwargs[MEMBER_ENV_KWARG] = env
            handle = remote_cls.options(**self._actor_resources, scheduling_strategy=strategy, **options).remote(**kwargs)
            self.workers.append(handle)
        return constructing

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def hosted_cpus(self, bundle: int) -> float:
        """CPUs this group's member in a reused process takes on `bundle` (0 when it has none there)."""
        hosted = self._host_pool is not None and bundle in self._start[0]
        return self._actor_resources.get("num_cpus", 0.0) if hosted else 0.0

    def _wait_for_room(self, bundle_indices: list[int]) -> None:
        """Fail fast when the bundles are already taken (e.g. more groups than `max_colocated_worker_groups`).

        Ray would otherwise leave the actors pending forever. Resource views lag a little
        behind actor deaths, so poll for up to the cluster's placement timeout. Members in reused
        processes (`worker_host.py`) reserve nothing with Ray: their share of a bundle is what the
        cluster counts for the open groups (`VirtualCluster.hosted_cpus`).
        """
        import ray

        from posttrain.distributed.cluster import ClusterError

        need = self._actor_resources
        locations = self.cluster.bundle_locations()
        deadline = time.monotonic() + self.cluster.placement_timeout_s
        while True:
            available = ray.available_resources()
            short = []
            for bundle in bundle_indices:
                pg, index = locations[bundle]
                lacking = []
                for resource, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
                    free = available.get(f"{resource}_group_{index}_{pg.id.hex()}", 0.0)
                    if resource == "CPU":
                        free -= self.cluster.hosted_cpus(bundle, besides=self)
                    if key in need and free + RAY_RESOURCE_UNIT < need[key]:
                        lacking.append(f"bundle {bundle}: {resource} free {free:g}, needed {need[key]:g}")
                short += lacking
            if not short:
                return
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"WorkerGroup {self.name!r}: no room on {self.cluster!r}: " + "; ".join(short) + ". "
                    f"More worker groups share these bundles than max_colocated_worker_groups="
                    f"{self.cluster.max_colocated_worker_groups} allows, or an earlier group was not shut down."
                )
            time.sleep(0.2)

    # ------------------------------------------------------------------ calling workers
    def _submit(self, rank: int, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        if not self.workers:
            raise WorkerError(f"WorkerGroup {self.name!r} was shut down")
        if not callable(getattr(self._actor_cls, method, None)):
            raise AttributeError(f"{self._actor_cls.__name__} (WorkerGroup {self.name!r}) has no method {method!r}")
        ref = getattr(self.workers[rank], method).remote(*args, **kwargs)
        self._pending[ref] = (rank, method)
        if self._progress is not None:
            self._progress.started(ref, method)
        return ref

    def run_all_async(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method(*args, **kwargs)` on every worker; returns one future per rank."""
        if self.world_size > 1:  # serialise big arguments once, not once per worker
            args = tuple(self._shared(a) for a in args)
            kwargs = {k: self._shared(v) for k, v in kwargs.items()}
        return [self._submit(rank, method, args, kwargs) for rank in range(self.world_size)]

    def run_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every worker and wait; results in rank order."""
        return self.get(self.run_all_async(method, *args, **kwargs))

    def _shared(self, value: Any) -> Any:
        """`value` put once where every worker reads it (Ray's object store; as is when local)."""
        return value if actors.is_ref(value) else actors.put(value, self.is_local)

    def run_single_async(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` on worker `rank` only; returns its future."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"WorkerGroup {self.name!r} has ranks 0..{self.world_size - 1}, not {rank}")
        return self._submit(rank, method, args, kwargs)

    def run_rank0(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` on rank 0 only and wait for its result."""
        return self.get([self.run_single_async(0, method, *args, **kwargs)])[0]

    def run_sharded_async(
        self, method: str, batch: Batch, *, replicas: int = 1, common_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any
    ) -> list[Any]:
        """Call `method(shard, **common)` on every rank: `batch.shard(world_size / replicas)`, shard s
        to the `replicas` consecutive ranks `s * replicas ...` (default 1: one shard per rank; a
        tensor-parallel group's ranks must all see the same rows).

        Every rank is called, even with an empty shard (when B < world_size), because the method
        may run collectives. Gather the results with `gather` (same `replicas`).
        """
        if self.world_size % replicas:
            raise ValueError(f"WorkerGroup {self.name!r}: replicas={replicas} does not divide {self.world_size} ranks")
        common = {**(common_kwargs or {}), **kwargs}
        if self.world_size > 1:
            common = {k: self._shared(v) for k, v in common.items()}
        shards = batch.shard(self.world_size // replicas)
        if replicas > 1 and self.world_size > 1:
            shards = [self._shared(shard) for shard in shards]  # one object-store copy per shard, not per rank
        return [self._submit(rank, method, (shards[rank // replicas],), common) for rank in range(self.world_size)]

    def run_sharded(
        self, method: str, batch: Batch, *, replicas: int = 1, common_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any
    ) -> Batch:
        """Split `batch` across ranks (`replicas` ranks per shard, see `run_sharded_async`), call
        `method` on each shard, concatenate results in order.

        Results are padded with 0 on dim 1; for another pad value use `run_sharded_async` and
        `gather(refs, pad_values=...)`.
        """
        refs = self.run_sharded_async(method, batch, replicas=replicas, common_kwargs=common_kwargs, **kwargs)
        return self.gather(refs, replicas=replicas)

    def gather(
        self, refs: Sequence[Any], pad_values: Mapping[str, Any] | None = None, timeout: float | None = None,
        replicas: int = 1,
    ) -> Batch:
        """Wait for per-rank Batches and concatenate them in rank order (`Batch.cat`), one result
        per `replicas` ranks (the first of each group; default 1: every rank's)."""
        results = self.get(refs, timeout=timeout)[::replicas]
        for rank, result in enumerate(results):
            if not isinstance(result, Batch):
                raise TypeError(f"WorkerGroup {self.name!r}: rank {rank * replicas} returned {type(result).__name__}, not a Batch")
        return Batch.cat(results, pad_values)

    def get(self, refs: Sequence[Any], timeout: float | None = None) -> list[Any]:
        """Results of `refs`, in order; raises as soon as any call fails or any worker dies.

        Args:
            refs: futures from this group's `run_*_async` (distinct refs).
            timeout: seconds to wait for all of them (default `worker_timeout_s`).

        Raises:
            WorkerError: naming the first failed worker (group, rank, node IP, actor id) and the cause.
            WorkerTimeoutError: naming the ranks still running when the time is up.
        """
        refs = list(refs)
        position = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        for ref, result in self.as_completed(refs, timeout):
            results[position[ref]] = result
        return results

    def as_completed(self, refs: Sequence[Any], timeout: float | None = None) -> Iterator[tuple[Any, Any]]:
        """`(ref, result)` of each of `refs` as soon as it finishes, with `get`'s failure and
        timeout handling (the timeout covers all of them)."""
        refs = list(refs)
        timeout = self.worker_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        waiting = list(refs)
        try:
            while waiting:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    running = ", ".join(self._describe(ref) for ref in waiting)
                    raise WorkerTimeoutError(
                        f"WorkerGroup {self.name!r}: no answer after {timeout:.1f}s (worker_timeout_s) from {running}",
                        group=self.name, ranks=self._ranks(waiting),
                    )
                # num_returns=1: wake up on the first finished (or failed) call, not the last; with
                # heartbeats or progress bounds, at least every beat period, to check on the calls
                # still running, and just after the first of them reaches its bound (a bound of 15 s
                # checked every 10 s beat would otherwise be found at 20 s).
                slice_s = min(remaining, self._beat_period) if self._beat_period else remaining
                due_s = self._progress.due_in(waiting) if self._progress is not None else None
                if due_s is not None:
                    slice_s = min(slice_s, due_s + PROGRESS_CHECK_LAG_S)
                ready, waiting = actors.wait(waiting, num_returns=1, timeout=slice_s)
                if not ready and self._watch is not None:
                    self._check_heartbeats(waiting)
                if not ready and self._progress is not None:
                    self._check_progress(waiting)
                for ref in ready:
                    try:
                        result = actors.get(ref)
                    except Exception as error:
                        self._raise_failure(ref, error, waiting)
                    if self._progress is not None:
                        self._progress.finished(ref)
                    yield ref, result
        except WorkerError:
            self._failed = True  # a member raised, died or stopped answering: its process is not reused
            raise
        finally:
            for ref in refs:
                self._pending.pop(ref, None)
            if self._progress is not None:
                self._progress.forget(refs)

    def _ranks(self, refs: Sequence[Any]) -> list[int]:
        return sorted({self._pending[ref][0] for ref in refs if ref in self._pending})

    def _check_heartbeats(self, waiting: Sequence[Any]) -> None:
        """Raise a WorkerTimeoutError naming the ranks among those running `waiting` whose
        heartbeat has stopped for longer than `heartbeat_timeout_s`."""
        ranks = {actors.actor_id(self.workers[r]): r for r in self._ranks(waiting) if r < len(self.workers)}
        stopped = self._watch.observe(heartbeat.read_beats(ranks))
        if stopped:
            names = ", ".join(f"{self.describe_rank(ranks[actor])}, no heartbeat for {seconds:.0f}s"
                              for actor, seconds in stopped.items())
            raise WorkerTimeoutError(
                f"WorkerGroup {self.name!r}: stopped answering: {names} (cluster.heartbeat_timeout_s="
                f"{self._watch.timeout_s:g})", group=self.name, ranks=sorted(ranks[actor] for actor in stopped),
            )

    def _check_progress(self, waiting: Sequence[Any]) -> None:
        """Raise a WorkerTimeoutError naming the calls among `waiting` past their phase's bound
        (`progress.ProgressWatch`) and where each was stuck (the stacks its worker sends)."""
        late = self._progress.overdue(waiting)
        if not late:
            return
        ids = {ref: actors.actor_id(self.workers[self._pending[ref][0]]) for ref, *_ in late}
        stacks = progress.request_stacks(set(ids.values()))
        names = [progress.describe_overdue(self.describe_rank(self._pending[ref][0]), phase, self._pending[ref][1],
                                           running, bound, why, stacks.get(ids[ref]))
                 for ref, phase, running, bound, why in late]
        raise WorkerTimeoutError(f"WorkerGroup {self.name!r}: no progress: " + "; ".join(names),
                                 group=self.name, ranks=self._ranks([ref for ref, *_ in late]))

    def _raise_failure(self, ref: Any, error: Exception, waiting: list[Any]) -> None:
        """Raise a WorkerError for the failure of `ref`, putting the likely root cause first.

        When one worker dies, its peers fail a moment later inside their collectives
        ("connection reset by peer"); whichever Ray reports first, the dead worker is the story.
        So wait briefly for the other calls and list dead actors before other errors.
        """
        failures = [(ref, error)]
        if waiting:
            done, _ = actors.wait(waiting, num_returns=len(waiting), timeout=FAILURE_GRACE_S)
            for other in done:
                try:
                    actors.get(other)
                except Exception as other_error:
                    failures.append((other, other_error))
        failures.sort(key=lambda failure: not actors.is_actor_death(failure[1]))
        lines = [f"{self._describe(r)} failed: {type(e).__name__}: {e}" for r, e in failures]
        message = f"WorkerGroup {self.name!r}: " + lines[0]
        if len(lines) > 1:
            message += "\nAlso failed:\n" + "\n".join(lines[1:])
        raise WorkerError(message, group=self.name, ranks=self._ranks([r for r, _ in failures])) from failures[0][1]

    def _describe(self, ref: Any) -> str:
        rank, method = self._pending.get(ref, (None, "?"))
        if rank is None:
            return "a worker (unknown rank)"
        actor_id = actors.actor_id(self.workers[rank]) if rank < len(self.workers) else "?"
        return f"rank {rank} ({method}, node {self.node_ips[rank]}, actor {actor_id})"

    # ------------------------------------------------------------------ teardown
    def shutdown(self, timeout_s: Optional[float] = None) -> None:
        """Ask workers to leave the process group (waiting up to `timeout_s`, default
        `SHUTDOWN_TIMEOUT_S`: 5.0), then kill them; or, when their processes are reused
        (`worker_host.py`) and every member left in time and the group saw no failure, give the
        processes back to their pool. Idempotent."""
        timeout_s = SHUTDOWN_TIMEOUT_S if timeout_s is None else timeout_s
        if not self.is_local:
            self.cluster.group_ended(self)
        if not self.workers:
            return
        goodbyes = []
        for worker in self.workers:
            try:
                goodbyes.append(worker.shutdown.remote())
            except Exception as error:  # actor already gone
                logger.debug("shutdown call failed: %s", error)
        said = []
        if goodbyes:
            # A worker stuck in a collective never answers; the kill below ends it anyway.
            said, _ = actors.wait(goodbyes, num_returns=len(goodbyes), timeout=timeout_s)
        kept = self._host_pool.take_back(self.workers, said, timeout_s) if (
            self._host_pool is not None and not self._failed and len(said) == len(self.workers)) else []
        for worker in [worker for worker in self.workers if not any(worker is k for k in kept)]:
            try:
                actors.kill(worker)
            except Exception as error:
                logger.debug("killing the actor failed: %s", error)
        if self._watch is not None:
            ids = [actors.actor_id(worker) for worker in self.workers]
            self._watch.forget(ids)
            heartbeat.forget(ids)
        self.workers = []
        self._pending.clear()

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
