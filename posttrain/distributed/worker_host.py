"""Worker processes that outlive their worker groups: `WorkerHost`, `HostedWorker`, `HostPool`.

A Ray worker process spends seconds of CPU before it does anything useful (importing torch,
transformers and posttrain's worker modules: ~4.5 s each on the 2-core test machines). A
controller that makes and shuts down many short-lived worker groups on the same bundles (a test
module comparing parallel layouts, say) pays that for every member of every group. With
`VirtualCluster(reuse_worker_processes=True)` a member instead lives inside a `WorkerHost`, a
generic actor that builds the worker object on request and drops it again; after a clean shutdown
of its group the host waits in its cluster's `HostPool`, and the next group placed on that bundle
builds its member in the same, already warm, process.

A host goes back to the pool only when its group shut down cleanly: every member said goodbye
(left its process group) in time and `release` freed the worker object. A group that saw any
failure (a call that raised, a timeout, a dead or frozen member) or was restarted kills its hosts
instead, as does the cluster's shutdown (`WorkerGroup.shutdown`, `VirtualCluster.shutdown`).

What a reused process must not carry from one member to the next, `construct` and `release` reset:
the member's environment variables (rank, rendezvous address, thread count), torch's global RNG
(a fresh process's state), the heartbeat thread (`heartbeat.stop_beating`), the memory the last
member freed (`gc`, `malloc_trim`) and the peak-RSS mark (`posttrain.utils.memory.reset_peak_rss`).
Torch's thread count is set again by each member's `DistributedWorker.__init__`, its process group
by `init_process_group` after the last member's `destroy_process_group`. What a process keeps
regardless (imported modules and what they registered, caches keyed by what they cache, warnings
shown once) does not depend on which member came first. GPU workers are not hosted (untested).
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence


class ConstructorFailedError(RuntimeError):
    """A call reached a `WorkerHost` whose member's constructor had raised (that error is its
    cause): the member never existed, as a Ray actor whose constructor raised is dead."""


class WorkerHost:
    """A Ray actor that hosts one worker object at a time (built by `construct`, dropped by
    `release`); `call` runs a method of it. Started by `WorkerGroup` on a placement-group bundle
    with the resources its worker actor would have asked for."""

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

    def release(self) -> bool:
        """Drop the worker (after its group's clean shutdown) and make the process as the next
        member expects to find it; True when the worker object was freed (else the host must not
        be used again: something still holds the last member's state)."""
        from posttrain.distributed import heartbeat
        from posttrain.utils import memory

        worker, self._worker = self._worker, None
        try:
            freed = weakref.ref(worker) if worker is not None else None
        except TypeError:  # a class without weak references: trust gc
            freed = None
        del worker
        heartbeat.stop_beating()
        gc.collect()
        memory.release_freed_memory()
        if self._environ_before is not None:
            for name in set(os.environ) - set(self._environ_before):
                del os.environ[name]
            os.environ.update(self._environ_before)
            self._environ_before = None
        memory.reset_peak_rss()  # the next member's peak is its own
        return freed is None or freed() is None

    def __repr__(self) -> str:  # Ray shows it in errors and logs
        return f"WorkerHost({type(self._worker).__name__ if self._worker is not None else 'idle'})"


@functools.cache
def remote_host_class() -> Any:
    """`ray.remote(WorkerHost)`, made once per process."""
    import ray

    return ray.remote(WorkerHost)


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
    the member beats under (`heartbeat.py`)."""

    def __init__(self, host: Any, bundle: Optional[int], resources: Mapping[str, float]) -> None:
        self.host = host
        # The cluster's bundle index (rank order), its place in the pool; None for a process in no
        # placement group (an environment actor's, `cluster_reuse.hosted_environment`).
        self.bundle = bundle
        self.resources = dict(resources)
        self.construction: Any = None  # the last `construct` call's future

    def construct(self, cls: type, kwargs: Mapping[str, Any], env: Mapping[str, str]) -> Any:
        self.construction = self.host.construct.remote(cls, kwargs, env)
        return self.construction

    def __getattr__(self, method: str) -> _HostedMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _HostedMethod(self.host, method)

    def __repr__(self) -> str:
        return f"HostedWorker(bundle {self.bundle}, actor {self.host._actor_id.hex()})"


def _pool_key(bundle: Optional[int], resources: Mapping[str, float]) -> tuple:
    return bundle, tuple(sorted(resources.items()))


class HostPool:
    """A cluster's idle `WorkerHost`s, per bundle and the resources they hold (a host is reused
    only by a member that would have asked for the same); a lock keeps its lists whole should groups
    start and end on several threads."""

    def __init__(self) -> None:
        self._idle: dict[tuple, list[Any]] = {}
        self._lock = threading.Lock()
        self.closed = False  # its cluster was shut down: nothing waits any more

    def take(self, bundle: Optional[int], resources: Mapping[str, float]) -> Optional[Any]:
        """An idle live host on `bundle` holding `resources` (None when there is none)."""
        from posttrain.distributed import actors

        while True:
            with self._lock:
                hosts = self._idle.get(_pool_key(bundle, resources))
                if not hosts:
                    return None
                host = hosts.pop()
            if actors.actor_death(host) is None:  # one that died while idle (OOM killer) is skipped
                return host

    def take_back(self, workers: Sequence[HostedWorker], goodbyes: Sequence[Any], timeout_s: float) -> bool:
        """Keep the hosts of a group's `workers` for the next members, if every one said goodbye
        (`goodbyes`: their `shutdown` calls, finished) and then freed its worker (`WorkerHost.release`)
        within `timeout_s`; False (nothing kept: the caller kills them) otherwise, or when the
        cluster was shut down meanwhile."""
        from posttrain.distributed import actors

        try:
            if self.closed or not all(result is True for result in actors.get(list(goodbyes), timeout=timeout_s)):
                return False
            releases = [worker.host.release.remote() for worker in workers]
            done, _ = actors.wait(releases, num_returns=len(releases), timeout=timeout_s)
            if len(done) < len(releases) or not all(actors.get(done)):
                return False
        except Exception:  # noqa: BLE001 - any doubt: new processes next time
            return False
        with self._lock:
            if self.closed:
                return False
            for worker in workers:
                self._idle.setdefault(_pool_key(worker.bundle, worker.resources), []).append(worker.host)
        return True

    def count(self, bundle: Optional[int], resources: Optional[Mapping[str, float]] = None) -> int:
        """Idle hosts on `bundle` (holding `resources`; default None: any)."""
        with self._lock:
            return sum(len(hosts) for key, hosts in self._idle.items()
                       if key[0] == bundle and (resources is None or key == _pool_key(bundle, resources)))

    def close(self) -> None:
        """Kill every idle host and keep none given back later (the cluster's shutdown)."""
        with self._lock:
            self.closed = True
        self.kill()

    def kill(self, bundle: Optional[int] = None) -> int:
        """Kill the idle hosts on `bundle` (default None: all of them), freeing what they hold;
        returns how many."""
        from posttrain.distributed import actors

        with self._lock:
            doomed = [host for key in [key for key in self._idle if bundle is None or key[0] == bundle]
                      for host in self._idle.pop(key)]
        for host in doomed:
            try:
                actors.kill(host)
            except Exception:  # already gone (Ray shut down, or it died)
                pass
        return len(doomed)
