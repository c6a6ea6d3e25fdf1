"""Worker processes that outlive their worker groups: `WorkerHost`, `HostedWorker`, `HostPool`.

A Ray worker process spends seconds of CPU before it does anything useful (importing torch,
transformers and posttrain's worker modules: ~4.5 s each on the 2-core test machines). A
controller that makes and shuts down many short-lived worker groups (a test module comparing
parallel layouts, jobs run one after another) pays that for every member of every group. With
`VirtualCluster(reuse_worker_processes=True)` a member instead lives inside a `WorkerHost`, a
generic actor that builds the worker object on request and drops it again; after a clean shutdown
of its group the host waits in a `HostPool`, and the next member placed on that machine, of any
group, cluster or class, builds itself in the same, already warm, process.

Hosts reserve no Ray resources: a host is pinned to its member's node and started with
`num_cpus=0`, while the member's share stays reserved by its cluster's placement-group bundle
(the cluster counts what its groups' hosted members take, `VirtualCluster.hosted_cpus`). That is
why a host can outlive the placement group it served (Ray ends the actors placed in a group when
the group is removed) and serve a cluster of another shape: `cluster_reuse.py` keeps one pool per
process for every job's clusters and environments.

A host goes back to the pool only when its group shut down cleanly: every member said goodbye
(left its process group) in time and `release` freed the worker object. A group that saw any
failure (a call that raised, a timeout, a dead or frozen member) or was restarted kills its hosts
instead, as does the release of a cluster its group was never shut down on.

What a reused process must not carry from one member to the next, `construct` and `release` reset:
the member's environment variables (rank, rendezvous address, thread count), torch's global RNG
(a fresh process's state), the heartbeat thread (`heartbeat.stop_beating`), the memory the last
member freed (`gc`, `malloc_trim`), the peak-RSS mark (`posttrain.utils.memory.reset_peak_rss`)
and what torch.distributed cached about the last member's device meshes
(`collective.forget_destroyed_groups`). Torch's thread count is set again by each member's
`DistributedWorker.__init__`, its process group by `init_process_group` after the last member's
`destroy_process_group`. What a process keeps regardless (imported modules and what they
registered, caches keyed by what they cache, warnings shown once) does not depend on which member
came first, except DTensor's caches: they are keyed by device mesh, and two meshes of the same
shape are equal whichever rank the process was and whatever process groups they were built on. A
member given the last member's plans was handed another rank's shards (measured: a
tensor-parallel resume came back with other weights) or ran a collective on a group of the last
member's (a lookup failed; a heap was corrupted). Hence the forgetting, and, in case a later torch
caches meshes where it does not look, a second guard: a process that hosted a member of a group of
several processes serves only members of the same rank and world size afterwards (`ranks`), or
members of one-process groups and environments, which build no device mesh. GPU workers are not
hosted (untested).
"""

from __future__ import annotations

import functools
import gc
import itertools
import os
import threading
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence


class ConstructorFailedError(RuntimeError):
    """A call reached a `WorkerHost` whose member's constructor had raised (that error is its
    cause): the member never existed, as a Ray actor whose constructor raised is dead."""


class WorkerHost:
    """A Ray actor that hosts one worker object at a time (built by `construct`, dropped by
    `release`); `call` runs a method of it. Started by `start_host`: on a given node, reserving no
    Ray resources."""

    def __init__(self) -> None:
        self._worker: Any = None
        self._construct_error: Optional[BaseException] = None  # the last member's constructor raised this
        self._environ_before: Optional[dict[str, str]] = None
        self._fresh_rng: Any = None  # torch's global RNG state as a fresh process has it

    def construct(self, cls: Callable[..., Any], kwargs: Mapping[str, Any], env: Mapping[str, str]) -> None:
        """Build `cls(**kwargs)` (a class, or any callable that builds the member) with `env` put
        into `os.environ` first (where `DistributedWorker` and torch.distributed read a member's
        rank and rendezvous)."""
        import torch

        from posttrain.utils import startup_gc

        startup_gc.imports_done(freeze=True)  # the worker's modules came with `cls`
        if self._worker is not None:
            raise RuntimeError(f"this WorkerHost still hosts a {type(self._worker).__name__}")
        if self._fresh_rng is None:
            self._fresh_rng = torch.get_rng_state()
        torch.set_rng_state(self._fresh_rng)  # whatever draws without a seed sees what a new process would
        self._environ_before = dict(os.environ)
        os.environ.update(env)
        self._construct_error = None
        try:
            self._worker = cls(**kwargs)
        except BaseException as error:
            # Kept for the calls that follow: a caller that does not wait for `construct` (an
            # environment's first step) sees the constructor's own error, not "no worker here".
            self._construct_error = error
            raise

    def call(self, method_name: str, /, *args: Any, **kwargs: Any) -> Any:
        """`worker.method_name(*args, **kwargs)` (positional-only name: a method may take a
        keyword argument `method_name`)."""
        if self._worker is None:
            if self._construct_error is not None:
                raise ConstructorFailedError(f"cannot run {method_name}: the constructor raised "
                                   f"{type(self._construct_error).__name__}: {self._construct_error}") \
                    from self._construct_error
            raise RuntimeError(f"no worker here to run {method_name} (it was released)")
        return getattr(self._worker, method_name)(*args, **kwargs)

    def release(self) -> Optional[str]:
        """Drop the worker (after its group's clean shutdown) and make the process as the next
        member expects to find it. Returns the id of this process's node when the worker object was
        freed, else None (the host must not be used again: something still holds the last member's
        state)."""
        import ray

        from posttrain.distributed import collective, heartbeat
        from posttrain.utils import memory

        worker, self._worker = self._worker, None
        try:
            freed = weakref.ref(worker) if worker is not None else None
        except TypeError:  # a class without weak references: trust gc
            freed = None
        del worker
        heartbeat.stop_beating()
        gc.collect()
        collective.forget_destroyed_groups()
        memory.release_freed_memory()
        if self._environ_before is not None:
            for name in set(os.environ) - set(self._environ_before):
                del os.environ[name]
            os.environ.update(self._environ_before)
            self._environ_before = None
        memory.reset_peak_rss()  # the next member's peak is its own
        if freed is not None and freed() is not None:
            return None
        return ray.get_runtime_context().get_node_id()

    def __repr__(self) -> str:  # Ray shows it in errors and logs
        return f"WorkerHost({type(self._worker).__name__ if self._worker is not None else 'idle'})"


@functools.cache
def _remote_host_class() -> Any:
    import ray

    return ray.remote(WorkerHost)


def start_host(node: Optional[str] = None) -> Any:
    """A new `WorkerHost` actor on Ray node `node` (default None: where Ray likes, for a member that
    may run anywhere: an environment), reserving no resources: what its members use is reserved
    by their cluster's bundles (or, for environments, by nothing, as their own actors would)."""
    options: dict[str, Any] = {"num_cpus": 0}
    if node is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    return _remote_host_class().options(**options).remote()


class _HostedMethod:
    __slots__ = ("host", "method")

    def __init__(self, host: Any, method: str) -> None:
        self.host, self.method = host, method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.host.call.remote(self.method, *args, **kwargs)


class HostedWorker:
    """What `WorkerGroup.workers` holds for a member living in a `WorkerHost`: used like the
    member's own Ray actor handle (`handle.method.remote(...)` runs `method` there). `actors.kill`,
    `actors.actor_id` and `actors.actor_death` act on the host, whose actor id is also the one
    the member beats under (`heartbeat.py`). `pool` is where the host waits once the member is
    gone; `ranks` the (rank, world size) of the last member of a group of several processes it
    hosted (this one, or an earlier one; None: none)."""

    def __init__(self, host: Any, pool: "HostPool", ranks: Optional[tuple[int, int]] = None) -> None:
        self.host = host
        self.pool = pool
        self.ranks = ranks
        self.construction: Any = None  # the last `construct` call's future

    def construct(self, cls: type, kwargs: Mapping[str, Any], env: Mapping[str, str]) -> Any:
        self.construction = self.host.construct.remote(cls, kwargs, env)
        return self.construction

    def __getattr__(self, method: str) -> _HostedMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _HostedMethod(self.host, method)

    def __repr__(self) -> str:
        return f"HostedWorker(actor {self.host._actor_id.hex()})"


class HostPool:
    """Idle `WorkerHost`s, per Ray node and the ranks they last served (`HostedWorker.ranks`), at
    most `max_idle` of them (default None: no limit; beyond it the one idle longest is killed); a
    lock keeps its lists whole should groups start and end on several threads."""

    def __init__(self, max_idle: Optional[int] = None) -> None:
        self.max_idle = max_idle
        # (node id, ranks) -> [(when given back, host)], the last given back last
        self._idle: dict[tuple[str, Optional[tuple[int, int]]], list[tuple[int, Any]]] = {}
        self._given_back = itertools.count()
        self._lock = threading.Lock()
        self.closed = False  # shut down: nothing waits any more

    def host(self, node: Optional[str] = None, ranks: Optional[tuple[int, int]] = None) -> HostedWorker:
        """A process for a member on `node` (None: on any node), of rank and world size `ranks` in a
        group of several processes (None: a one-process group, or an environment): an idle one of
        this pool that may host it (`take`) when there is one, else a new `start_host(node)`."""
        taken = self.take(node, ranks)
        if taken is None:
            return HostedWorker(start_host(node), self, ranks)
        host, last_ranks = taken
        return HostedWorker(host, self, ranks or last_ranks)

    def take(self, node: Optional[str] = None, ranks: Optional[tuple[int, int]] = None) -> Optional[tuple[Any, Any]]:
        """An idle host on `node` (None: on any node) that may host a member of `ranks`, and the
        ranks it last served, taken out of the pool; None when there is none. For `ranks`, a host
        that served the same ranks or none; otherwise any, one that served none first. Hosts that
        died while idle (the OOM killer, a lost node, a Ray started again since) are dropped on the
        way (Ray's record must say the host is alive)."""
        import ray._private.state as ray_state

        def preference(key: tuple) -> Optional[int]:
            if node is not None and key[0] != node:
                return None
            if ranks is not None:
                return 0 if key[1] == ranks else 1 if key[1] is None else None
            return 0 if key[1] is None else 1

        while True:
            with self._lock:
                usable = [(order, key) for key, hosts in self._idle.items()
                          if hosts and (order := preference(key)) is not None]
                if not usable:
                    return None
                key = min(usable, key=lambda item: item[0])[1]
                _, host = self._idle[key].pop()
            if (ray_state.actors(actor_id=host._actor_id.hex()) or {}).get("State") == "ALIVE":
                return host, key[1]

    def take_back(self, workers: Sequence[HostedWorker], goodbyes: Sequence[Any], timeout_s: float) -> list[HostedWorker]:
        """Keep the hosts of a group's `workers` for later members, if every one said goodbye
        (`goodbyes`: their `shutdown` calls, finished) and then freed its worker (`WorkerHost.release`)
        within `timeout_s`; beyond `max_idle` idle hosts, those idle longest are killed. Returns the
        workers whose hosts were kept (the caller kills the others): none when the pool is closed or
        any of them failed."""
        from posttrain.distributed import actors

        try:
            if self.closed or not all(result is True for result in actors.get(list(goodbyes), timeout=timeout_s)):
                return []
            releases = [worker.host.release.remote() for worker in workers]
            done, _ = actors.wait(releases, num_returns=len(releases), timeout=timeout_s)
            if len(done) < len(releases):
                return []
            nodes = actors.get(releases)  # in the workers' order (`done` is in the order they ended)
            if not all(nodes):
                return []
        except Exception:  # noqa: BLE001 - any doubt: new processes next time
            return []
        with self._lock:
            if self.closed:
                return []
            for worker, node in zip(workers, nodes):
                self._idle.setdefault((node, worker.ranks), []).append((next(self._given_back), worker.host))
            evicted = []
            while self.max_idle is not None and self._count() > self.max_idle:
                oldest = min((hosts[0][0], key) for key, hosts in self._idle.items() if hosts)[1]
                evicted.append(self._idle[oldest].pop(0)[1])
        self._kill(evicted)
        return list(workers)

    def _count(self) -> int:
        return sum(len(hosts) for hosts in self._idle.values())

    def count(self) -> int:
        """Idle hosts, on every node."""
        with self._lock:
            return self._count()

    def idle_hosts(self) -> list[Any]:
        """The idle hosts' actor handles (still in the pool)."""
        with self._lock:
            return [host for hosts in self._idle.values() for _, host in hosts]

    def close(self) -> int:
        """Kill every idle host and keep none given back later; returns how many were killed."""
        with self._lock:
            self.closed = True
        return self.kill()

    def kill(self) -> int:
        """Kill every idle host, freeing what they hold; returns how many."""
        with self._lock:
            doomed = [host for hosts in self._idle.values() for _, host in hosts]
            self._idle.clear()
        self._kill(doomed)
        return len(doomed)

    @staticmethod
    def _kill(hosts: Sequence[Any]) -> None:
        from posttrain.distributed import actors

        for host in hosts:
            try:
                actors.kill(host)
            except Exception:  # already gone (Ray shut down, or it died)
                pass
