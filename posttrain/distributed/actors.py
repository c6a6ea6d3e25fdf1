"""Actors and futures for both backends: Ray's, and local ones that live in the controller's process.

`cluster.backend: local` runs a job that fits one process (one node, one worker per group, native
generation) without Ray: each worker and each environment is a `LocalActor`, an object on a thread
of its own. Starting Ray and one interpreter per worker costs ~10 s on a 2-core machine (Ray's own
processes ~3 s, then each worker imports torch and transformers for ~5 s), more than many small
runs train; in one process those imports happen once.

A `LocalActor` keeps Ray's actor semantics where callers rely on them: calls run one at a time in
the order they were made, each returns a future (`LocalRef`), an exception in a call comes back
from that future, a constructor that raises makes every call fail with its error, and a killed
actor fails its pending calls. What differs: arguments and results are passed by reference, not
copied, so neither side may modify what it passed or received (Ray's zero-copy reads of numpy
arrays make the same demand); a call cannot be interrupted (`kill` stops the actor after the call
in progress; its thread is a daemon, so it never holds up the process's exit).

The module-level functions (`wait`, `get`, `put`, `kill`, `is_ref`, `is_actor_death`) take refs and
handles of either kind, so code above this layer (worker groups, environments, refit) is written
once for both backends.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import sys
import threading
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any, Mapping, Optional, Sequence

from posttrain.utils.cpu_share import apply_on_this_thread
from posttrain.utils.openmp import release_thread_team

_actor_ids = itertools.count()
_identity = threading.local()  # the rank variables of the local actor whose thread this is
_live_actors: "weakref.WeakSet[LocalActor]" = weakref.WeakSet()
STOP_WAIT_S = 10.0  # how long `kill` (and the process's exit) waits for an actor's thread to end


class LocalActorDiedError(RuntimeError):
    """A call on a local actor that was killed (or whose constructor raised)."""


class LocalRef:
    """The future result of one call on a `LocalActor` (Ray's `ObjectRef` counterpart)."""

    __slots__ = ("future", "actor", "method")

    def __init__(self, actor: "LocalActor", method: str) -> None:
        self.future: Future = Future()
        self.actor, self.method = actor, method

    def __repr__(self) -> str:
        return f"LocalRef({self.actor.name}.{self.method})"


class _RemoteMethod:
    """`actor.method.remote(*args, **kwargs)`, as on a Ray actor handle."""

    __slots__ = ("actor", "method")

    def __init__(self, actor: "LocalActor", method: str) -> None:
        self.actor, self.method = actor, method

    def remote(self, *args: Any, **kwargs: Any) -> LocalRef:
        return self.actor.submit(self.method, args, kwargs)


class LocalActor:
    """An instance of `cls`, built and called on a daemon thread of its own.

    Args:
        cls: the class (a plain class, not `ray.remote`-decorated).
        args, kwargs: its constructor's arguments.
        name: shown in errors and thread names.
        identity: variables the actor's code reads as its environment (`worker_identity`), e.g.
            `RANK` / `WORLD_SIZE` for a worker-group member (default none).
    """

    def __init__(
        self,
        cls: type,
        args: Sequence[Any] = (),
        kwargs: Optional[Mapping[str, Any]] = None,
        *,
        name: str = "",
        identity: Optional[Mapping[str, str]] = None,
    ) -> None:
        self.cls = cls
        self.name = name or cls.__name__
        self.actor_id = f"local-{next(_actor_ids)}"
        self._calls: "queue.SimpleQueue[Optional[tuple[LocalRef, tuple, dict]]]" = queue.SimpleQueue()
        self._dead: Optional[BaseException] = None
        self._instance: Any = None
        self._thread = threading.Thread(
            target=self._run, args=(tuple(args), dict(kwargs or {}), dict(identity or {})),
            name=f"posttrain-{self.name}", daemon=True,
        )
        self._thread.start()
        _live_actors.add(self)

    def __getattr__(self, method: str) -> _RemoteMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _RemoteMethod(self, method)

    def submit(self, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> LocalRef:
        """Queue `method(*args, **kwargs)`; returns its future."""
        ref = LocalRef(self, method)
        if self._dead is not None:
            ref.future.set_exception(self._death_error(method))
        else:
            self._calls.put((ref, tuple(args), dict(kwargs)))
        return ref

    def kill(self, wait_s: float = STOP_WAIT_S) -> None:
        """Fail every queued call, stop the thread after the call in progress and wait up to `wait_s`
        seconds for it to end (idempotent)."""
        if self._dead is None:
            self._dead = LocalActorDiedError(f"local actor {self.name} ({self.actor_id}) was killed")
        self._calls.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=wait_s)

    def _death_error(self, method: str) -> LocalActorDiedError:
        error = LocalActorDiedError(f"{self.name}.{method}: the actor is dead: {self._dead}")
        error.__cause__ = self._dead
        return error

    def _run(self, args: tuple, kwargs: dict, identity: dict) -> None:
        _identity.values = identity
        try:
            self._instance = self.cls(*args, **kwargs)
        except BaseException as error:  # every later call reports the constructor's error
            self._dead = error
        while (item := self._calls.get()) is not None:
            self._call(*item)
            # Drop the call's arguments here and now: freeing large tensors releases the GIL, which a
            # daemon thread must not do once the interpreter is shutting down (it is then ended
            # mid-free, and the C++ below it aborts the process).
            del item
            if self._calls.empty():
                # Idle from here on: end this thread's OpenMP team, so that the threads still
                # computing are not throttled by it (posttrain.utils.openmp says why).
                release_thread_team()
        self._instance = None  # the worker (its model) is freed on its own thread, before the exit
        while True:  # killed: fail whatever is still queued
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].future.set_exception(self._death_error(item[0].method))

    def _call(self, ref: LocalRef, args: tuple, kwargs: dict) -> None:
        if self._dead is not None:
            ref.future.set_exception(self._death_error(ref.method))
            return
        if not ref.future.set_running_or_notify_cancel():
            return
        try:
            apply_on_this_thread()  # fewer threads while other processes hold the cores (utils/cpu_share.py)
            # As Ray does, a future passed as a top-level argument is replaced by its result.
            args = tuple(_resolved(a) for a in args)
            kwargs = {k: _resolved(v) for k, v in kwargs.items()}
            result = getattr(self._instance, ref.method)(*args, **kwargs)
        except BaseException as error:
            ref.future.set_exception(error)
        else:
            ref.future.set_result(result)


class LocalCluster:
    """The local backend's stand-in for a `VirtualCluster`: this process, one worker slot.

    Worker groups placed on it (`WorkerGroup`) are one `LocalActor` each, sharing the slot as
    colocated groups share a Ray bundle. `cpus` is what its workers may use (torch threads).

    Args:
        cpus: CPU cores for the workers' math (default None: every core this process may use).
        use_gpus: the workers use this process's GPU (default False).
        name: shown in logs and errors.
    """

    bundles_per_node = [1]
    placement_timeout_s = 0.0

    def __init__(self, cpus: Optional[float] = None, use_gpus: bool = False, name: str = "") -> None:
        self.cpus_per_bundle = float(cpus) if cpus else float(available_cpus())
        self.use_gpus = use_gpus
        self.name = name or "local"
        self.max_colocated_worker_groups = 1

    def world_size(self) -> int:
        return 1

    def bundle_node_ids(self) -> list[str]:
        return ["local"]

    def actor_resources(self) -> dict[str, float]:
        return {"num_cpus": self.cpus_per_bundle}

    def shutdown(self) -> None:
        """Nothing to release: the workers are stopped by their groups."""

    def __repr__(self) -> str:
        return f"LocalCluster(name={self.name!r}, cpus={self.cpus_per_bundle:g}, use_gpus={self.use_gpus})"


def available_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's or taskset's share)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@atexit.register
def _stop_live_actors() -> None:
    """At the process's exit (a job that failed before shutting its workers down), stop every actor
    while the interpreter can still run their threads: one ended during its shutdown in the middle
    of freeing tensors aborts the process."""
    for actor in list(_live_actors):
        actor.kill()


def _resolved(value: Any) -> Any:
    return value.future.result() if isinstance(value, LocalRef) else value


def worker_identity() -> Optional[dict[str, str]]:
    """The rank variables of the local actor running this code, or None outside one (a Ray worker
    reads them from its environment instead)."""
    return getattr(_identity, "values", None)


# ----------------------------------------------------------------- either backend
def _ray():
    import ray

    return ray


def is_ref(value: Any) -> bool:
    """A future of either backend (`LocalRef` or Ray `ObjectRef`)."""
    if isinstance(value, LocalRef):
        return True
    return "ray" in sys.modules and isinstance(value, sys.modules["ray"].ObjectRef)


def _all_local(refs: Sequence[Any]) -> bool:
    kinds = {isinstance(ref, LocalRef) for ref in refs}
    if len(kinds) > 1:
        raise TypeError("cannot wait on local and Ray futures together")
    return kinds == {True}


def wait(refs: Sequence[Any], num_returns: int = 1, timeout: Optional[float] = None) -> tuple[list, list]:
    """`ray.wait` for either kind: `(ready, not_ready)` once `num_returns` refs are done or
    `timeout` seconds have passed, each list in the input order."""
    refs = list(refs)
    if not refs or not _all_local(refs):
        return _ray().wait(refs, num_returns=num_returns, timeout=timeout) if refs else ([], [])
    deadline = None if timeout is None else time.monotonic() + timeout
    release_thread_team()  # this thread waits: its OpenMP team must not slow the actors'
    while True:
        done = [ref for ref in refs if ref.future.done()]
        remaining = None if deadline is None else deadline - time.monotonic()
        if len(done) >= num_returns or (remaining is not None and remaining <= 0):
            break
        wait_futures([ref.future for ref in refs if not ref.future.done()], timeout=remaining,
                     return_when=FIRST_COMPLETED)
    ready = done[:num_returns]
    chosen = set(map(id, ready))
    return ready, [ref for ref in refs if id(ref) not in chosen]


class GetTimeoutError(TimeoutError):
    """`get(..., timeout)` ran out of time on a local future (Ray raises its own GetTimeoutError)."""


def get(refs: Any, timeout: Optional[float] = None) -> Any:
    """`ray.get` for either kind: the result of one ref, or the results of a list of refs."""
    if isinstance(refs, LocalRef):
        if not refs.future.done():
            release_thread_team()  # this thread waits: its OpenMP team must not slow the actor's
        try:
            return refs.future.result(timeout=timeout)
        except TimeoutError as error:
            if refs.future.done():
                raise  # the call itself raised a TimeoutError
            raise GetTimeoutError(f"{refs}: no result after {timeout}s") from error
    if isinstance(refs, (list, tuple)) and not refs:
        return []  # nothing to wait for: `ray.get([])` would start a Ray instance under the local backend
    if isinstance(refs, (list, tuple)) and _all_local(refs):
        deadline = None if timeout is None else time.monotonic() + timeout
        return [get(ref, None if deadline is None else max(0.0, deadline - time.monotonic())) for ref in refs]
    return _ray().get(refs, timeout=timeout)


def is_get_timeout(error: BaseException) -> bool:
    """`error` is a `get` that ran out of time (either backend)."""
    if isinstance(error, GetTimeoutError):
        return True
    return "ray" in sys.modules and isinstance(error, sys.modules["ray"].exceptions.GetTimeoutError)


def put(value: Any, local: bool) -> Any:
    """`ray.put(value)`, or `value` itself for the local backend (nothing to share)."""
    return value if local else _ray().put(value)


def kill(handle: Any) -> None:
    """Stop an actor of either kind (`ray.kill(handle, no_restart=True)` for Ray's)."""
    if isinstance(handle, LocalActor):
        handle.kill()
    else:
        _ray().kill(ray_handle(handle), no_restart=True)


def ray_handle(handle: Any) -> Any:
    """The Ray actor handle behind `handle`: a worker hosted in a reused process
    (`worker_host.HostedWorker`) stands for its host actor."""
    return handle if isinstance(handle, _ray().actor.ActorHandle) else handle.host


def actor_id(handle: Any) -> str:
    """A printable id of an actor of either kind."""
    if isinstance(handle, LocalActor):
        return handle.actor_id
    return ray_handle(handle)._actor_id.hex()


def is_actor_death(error: BaseException) -> bool:
    """`error` says the actor itself is gone (killed, crashed, or its constructor raised), not
    that one call failed."""
    if isinstance(error, LocalActorDiedError):
        return True
    return "ray" in sys.modules and isinstance(error, sys.modules["ray"].exceptions.RayActorError)


def actor_death(handle: Any) -> Optional[tuple[str, Optional[str]]]:
    """Why the actor is dead, in words (`recovery.death_cause`), and the IP of its node when the
    node was lost with it; None while it lives (or still starts). Read from Ray's record of the
    actor, which answers at once however busy the actor is. A local actor is never dead on its
    own: it dies with this process."""
    if isinstance(handle, LocalActor):
        return None
    import ray._private.state as ray_state

    from posttrain.distributed.recovery import death_cause

    info = ray_state.actors(actor_id=actor_id(handle)) or {}
    if info.get("State") != "DEAD":
        return None
    reason, oom, message = "", False, ""
    record = info.get("DeathCause")
    if record is not None:
        oom = record.HasField("oom_context")
        if record.HasField("actor_died_error_context"):
            context = record.actor_died_error_context
            reason, message = type(context).Reason.Name(context.reason), context.error_message
        elif record.HasField("creation_task_failure_context"):
            message = "its constructor failed"
    ip = (info.get("Address") or {}).get("IPAddress", "")
    cause, node_lost = death_cause(reason, oom=oom, node_ip=ip, message=message)
    return cause, (ip if node_lost else None)


def is_actor_failure(error: BaseException) -> bool:
    """`error`, or an error it was raised from, says an actor is gone or unreachable (Ray's
    `RayActorError`: died, or temporarily unavailable, as while its node is being lost)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if is_actor_death(error):
            return True
        error = error.__cause__ or error.__context__
    return False
