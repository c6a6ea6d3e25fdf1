"""Progress: how the controller tells a worker call that is stuck from one that is slow.

A heartbeat (`heartbeat.py`) says that a worker's process runs; it does not say that the call it
runs gets anywhere. A Python-level deadlock, an endless loop, or a collective waiting for a peer
that is alive but stuck elsewhere all beat on. So the controller also bounds each call by its
phase (the worker method it calls, e.g. `train`, `generate`; `env_step` for an environment's step,
`env_finish` for its `finish`):

- the bound the user set for the phase (`cluster.progress_timeout_s.<phase>`), else
- `cluster.progress_timeout_factor` times the slowest call of that phase finished so far in the
  run, at least `cluster.progress_timeout_floor_s`; before the first one finished, only
  `cluster.worker_timeout_s` (start-up and a first compilation may take long).

A call past its bound has made no progress: the controller asks the worker for the Python stacks
of its threads (the worker's heartbeat thread answers through Ray's key-value store, so a worker
stuck in any Python code, even holding no lock it needs, still answers), names in one line where
the call was stuck, and the wait ends with a `WorkerTimeoutError`, which a run recovers from as
from a dead worker. `ProgressLimits` and `ProgressWatch` are pure (tested without Ray);
`serve_stacks` runs in the worker, `request_stacks` in the controller.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

NAMESPACE = "posttrain-progress"
STACK_WAIT_S = 10.0  # how long the controller waits for a stuck worker's stacks before naming it without


@dataclass(frozen=True)
class ProgressLimits:
    """The bounds of the calls' phases (`cluster.progress_timeout_*`).

    Args:
        per_phase_s: phase -> its bound in seconds, set by the user (0 or absent: derived).
        factor: a derived bound is this many times the slowest finished call of the phase (0: no
            derived bounds, only those of `per_phase_s`).
        floor_s: a derived bound is at least this.
    """

    per_phase_s: Mapping[str, float] = field(default_factory=dict)
    factor: float = 0.0
    floor_s: float = 0.0

    @classmethod
    def from_config(cls, cluster: Any) -> "ProgressLimits":
        return cls(dict(cluster.progress_timeout_s), cluster.progress_timeout_factor, cluster.progress_timeout_floor_s)

    @property
    def enabled(self) -> bool:
        return self.factor > 0 or any(bound > 0 for bound in self.per_phase_s.values())

    def as_dict(self) -> dict[str, Any]:
        """Plain values (for a spec that crosses processes)."""
        return {"per_phase_s": dict(self.per_phase_s), "factor": self.factor, "floor_s": self.floor_s}


class ProgressWatch:
    """The calls of one worker group (or the environments) in flight and the slowest finished call
    of each phase, by `clock` (default `time.monotonic`)."""

    def __init__(self, limits: ProgressLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self.slowest: dict[str, float] = {}  # phase -> seconds of its slowest finished call
        self._running: dict[Any, tuple[str, float]] = {}  # key (a future) -> (phase, when it started)

    def started(self, key: Any, phase: str) -> None:
        self._running[key] = (phase, self.clock())

    def finished(self, key: Any) -> None:
        """`key`'s call returned: its time counts for its phase's bound."""
        phase, start = self._running.pop(key, (None, 0.0))
        if phase is not None:
            self.slowest[phase] = max(self.slowest.get(phase, 0.0), self.clock() - start)

    def forget(self, keys: Iterable[Any]) -> None:
        """Calls nobody waits for any more (failed, or their workers were shut down)."""
        for key in keys:
            self._running.pop(key, None)

    def bound(self, phase: str) -> tuple[Optional[float], str]:
        """`(seconds, why in words)` of `phase`'s bound; None when it has none yet."""
        set_by_user = self.limits.per_phase_s.get(phase, 0.0)
        if set_by_user > 0:
            return set_by_user, f"cluster.progress_timeout_s.{phase}={set_by_user:g}"
        slowest = self.slowest.get(phase)
        if self.limits.factor <= 0 or slowest is None:
            return None, ""
        bound = max(self.limits.floor_s, self.limits.factor * slowest)
        return bound, (f"{self.limits.factor:g}x the slowest {phase} so far, {slowest:.1f}s, at least "
                       f"cluster.progress_timeout_floor_s={self.limits.floor_s:g}")

    def due_in(self, keys: Iterable[Any]) -> Optional[float]:
        """Seconds until the first of `keys` still running reaches its bound (0 when one is past
        it; None when none of them has a bound): when to look again, rather than a beat later."""
        now, due = self.clock(), None
        for key in keys:
            if key in self._running:
                phase, start = self._running[key]
                bound, _ = self.bound(phase)
                if bound is not None:
                    left = max(0.0, start + bound - now)
                    due = left if due is None else min(due, left)
        return due

    def overdue(self, keys: Iterable[Any]) -> list[tuple[Any, str, float, float, str]]:
        """`(key, phase, seconds running, bound, why)` of each of `keys` running past its bound,
        and of the others of `keys` running in the same phase (the other ranks of one call: they
        started with it, and whether a microsecond separates them from their bound is chance)."""
        now, running = self.clock(), {key: self._running[key] for key in keys if key in self._running}
        late_phases = {}
        for phase, start in running.values():
            bound, why = self.bound(phase)
            if bound is not None and now - start > bound:
                late_phases[phase] = (bound, why)
        return [(key, phase, now - start, *late_phases[phase]) for key, (phase, start) in running.items()
                if phase in late_phases]


# ------------------------------------------------------------------------------ stacks
def request_key(actor_id: str) -> bytes:
    return f"ask/{actor_id}".encode()


def stacks_key(actor_id: str) -> bytes:
    return f"stacks/{actor_id}".encode()


def format_stacks(frames: Optional[Mapping[int, Any]] = None, skip: Iterable[int] = ()) -> str:
    """Every thread's Python stack (`sys._current_frames()`), innermost call last, threads by name;
    the threads of `skip` (the one answering) left out."""
    frames = sys._current_frames() if frames is None else frames
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    skip = set(skip)
    parts = []
    for ident, frame in frames.items():
        if ident in skip:
            continue
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{names.get(ident, ident)}":\n{stack}')
    return "\n".join(parts)


def where_stuck(stacks: str, method: str) -> str:
    """Where a call of `method` was stuck, in a few words from its worker's `format_stacks`: the
    innermost frames (at most 3) of the thread running it (the one whose stack passes through
    `method`, else the main thread)."""
    threads = [block for block in stacks.split('\nThread "') if block.strip()]
    chosen = next((b for b in threads if f", in {method}\n" in b), None)
    chosen = chosen or next((b for b in threads if "MainThread" in b.splitlines()[0]), threads[0] if threads else "")
    frames = []
    for line in chosen.splitlines():
        line = line.strip()
        if line.startswith("File "):  # File "/path/x.py", line 12, in f
            try:
                path, rest = line[len('File "'):].split('", line ', 1)
                number, function = rest.split(", in ", 1)
            except ValueError:
                continue
            frames.append(f"{function} ({path.rsplit('/', 1)[-1]}:{number})")
    return " <- ".join(reversed(frames[-3:])) if frames else "its stacks were empty"


def serve_stacks(actor_id: str) -> None:
    """In a worker (its heartbeat thread, each beat): answer the controller's request for stacks."""
    from ray.experimental import internal_kv

    if internal_kv._internal_kv_get(request_key(actor_id), namespace=NAMESPACE) is None:
        return
    internal_kv._internal_kv_put(stacks_key(actor_id), format_stacks(skip=[threading.get_ident()]).encode(),
                                 overwrite=True, namespace=NAMESPACE)
    internal_kv._internal_kv_del(request_key(actor_id), namespace=NAMESPACE)


def request_stacks(actor_ids: Iterable[str], wait_s: Optional[float] = None) -> dict[str, Optional[str]]:
    """Ask workers for their stacks and wait up to `wait_s` (default `STACK_WAIT_S`) for them
    (None: no answer, e.g. a frozen process or one without a heartbeat thread)."""
    from ray.experimental import internal_kv

    wait_s = STACK_WAIT_S if wait_s is None else wait_s
    actor_ids = list(actor_ids)
    for actor_id in actor_ids:
        internal_kv._internal_kv_del(stacks_key(actor_id), namespace=NAMESPACE)
        internal_kv._internal_kv_put(request_key(actor_id), b"1", overwrite=True, namespace=NAMESPACE)
    stacks: dict[str, Optional[str]] = dict.fromkeys(actor_ids)
    deadline = time.monotonic() + wait_s
    while True:
        for actor_id in [a for a, found in stacks.items() if found is None]:
            value = internal_kv._internal_kv_get(stacks_key(actor_id), namespace=NAMESPACE)
            if value is not None:
                stacks[actor_id] = value.decode(errors="replace")
                internal_kv._internal_kv_del(stacks_key(actor_id), namespace=NAMESPACE)
        if all(found is not None for found in stacks.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for actor_id, found in stacks.items():
        if found is None:
            internal_kv._internal_kv_del(request_key(actor_id), namespace=NAMESPACE)
    return stacks


def describe_overdue(who: str, phase: str, method: str, running_s: float, bound: float, why: str,
                     stacks: Optional[str]) -> str:
    """One overdue call in words: who, how long against which bound, and where it was stuck."""
    where = f"stuck in {where_stuck(stacks, method)}" if stacks else "its stacks did not come (a frozen process?)"
    return f"{who}, no progress in {phase} for {running_s:.0f}s (bound {bound:g}s: {why}), {where}"
