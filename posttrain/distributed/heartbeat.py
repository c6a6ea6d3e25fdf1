"""Heartbeats: how the controller tells a worker that stopped answering from one that is busy.

A Ray actor runs one call at a time, so a worker in a long call cannot answer a ping, and a
process that is frozen (stopped, swapped out, deadlocked holding the GIL) still looks alive to
Ray. So each worker process beats from a thread of its own: every `period` seconds it writes a
counter to Ray's key-value store (in the GCS). While the controller waits for a call it reads the
counters of the workers it waits for (`WorkerGroup.as_completed`); one whose counter has not
moved for `cluster.heartbeat_timeout_s` of the controller's own clock (other nodes' clocks do not
matter) has stopped answering, and the wait ends with a `WorkerTimeoutError` naming it within
seconds, not after `cluster.worker_timeout_s`. A worker waiting in a collective for a peer keeps
beating (its thread runs while the collective waits): a dead peer is reported by Ray at once, and
a collective that never completes because a live peer is stuck elsewhere ends at its phase's
progress bound (`progress.py`), else at `cluster.worker_timeout_s`.

A worker that has not beaten yet (still importing torch, say) is not judged: a process that hangs
before its first beat is caught by `cluster.worker_timeout_s`, which covers start-up.

The same thread answers the controller's request for the Python stacks of the worker's threads
(`progress.serve_stacks`), which says where a call that makes no progress is stuck (`progress.py`).
Environment actors beat too (`registry.create_env`).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Mapping, Optional

HEARTBEAT_ENV = "POSTTRAIN_HEARTBEAT_S"  # the beat period in seconds, set for each worker by WorkerGroup
NAMESPACE = "posttrain-heartbeat"


def period_for(timeout_s: float) -> float:
    """Seconds between beats for a `timeout_s` deadline: a sixth of it, between 0.5 and 10 s, so a
    few missed beats (a busy machine) never add up to the deadline."""
    return min(10.0, max(0.5, timeout_s / 6))


def key(actor_id: str) -> bytes:
    return f"beat/{actor_id}".encode()


STACKS_POLL_S = 1.0  # how often the thread looks for a request for stacks (between beats)


class _Beating:
    """The one beating thread of this process and the period it beats at (0: it ends). A process
    that hosts one worker after another (`worker_host.py`) starts beating once per member."""

    lock = threading.Lock()
    period_s = 0.0
    thread: Optional[threading.Thread] = None
    changed = threading.Event()  # wakes the thread for a new period (or its end) at once


def start_beating(period_s: float) -> None:
    """In a Ray worker: beat every `period_s` seconds from a daemon thread, until `stop_beating`
    (or for as long as the process runs), and answer requests for its stacks
    (`progress.serve_stacks`) within a second. Called again, the one thread beats at the new
    period from then on."""
    import ray

    if period_s <= 0:
        raise ValueError(f"a heartbeat period must be positive, got {period_s}")
    actor_id = ray.get_runtime_context().get_actor_id()
    with _Beating.lock:
        _Beating.period_s = period_s
        if _Beating.thread is None:
            _Beating.thread = threading.Thread(target=_beat, args=(actor_id,), name="posttrain-heartbeat", daemon=True)
            _Beating.thread.start()
    _Beating.changed.set()


def stop_beating(wait_s: float = 5.0) -> None:
    """End this process's beating thread (no-op when none runs), waiting up to `wait_s` seconds
    for its last beat to be written, so that none comes after the controller forgot the actor."""
    with _Beating.lock:
        thread, _Beating.period_s = _Beating.thread, 0.0
    _Beating.changed.set()
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=wait_s)


def _beat(actor_id: str) -> None:
    from ray.experimental import internal_kv

    from posttrain.distributed.progress import serve_stacks

    my_key = key(actor_id)
    count, next_beat, period_s = 0, 0.0, 0.0
    while True:
        with _Beating.lock:
            if _Beating.period_s <= 0:
                _Beating.thread = None
                return
            if _Beating.period_s != period_s:  # a new period: beat now, then at the new pace
                period_s, next_beat = _Beating.period_s, 0.0
            _Beating.changed.clear()
        try:
            if time.monotonic() >= next_beat:
                count += 1
                internal_kv._internal_kv_put(my_key, str(count).encode(), overwrite=True, namespace=NAMESPACE)
                next_beat = time.monotonic() + period_s
            serve_stacks(actor_id)
        except Exception:  # the GCS is briefly unreachable: the next round tries again
            pass
        _Beating.changed.wait(min(period_s, STACKS_POLL_S))


def read_beats(actor_ids: Iterable[str]) -> dict[str, Optional[bytes]]:
    """The last beat of each actor (None: none yet), read from the GCS."""
    from ray.experimental import internal_kv

    return {actor_id: internal_kv._internal_kv_get(key(actor_id), namespace=NAMESPACE) for actor_id in actor_ids}


def forget(actor_ids: Iterable[str]) -> None:
    """Delete the beats of actors that were shut down (best effort)."""
    from ray.experimental import internal_kv

    for actor_id in actor_ids:
        try:
            internal_kv._internal_kv_del(key(actor_id), namespace=NAMESPACE)
        except Exception:
            pass


class HeartbeatWatch:
    """The controller's view of its workers' beats: the last value seen of each and when it last
    changed, by `clock` (default `time.monotonic`).

    Args:
        timeout_s: how long a beat may stay unchanged before its worker counts as stopped.
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._seen: dict[str, tuple[bytes, float]] = {}  # actor -> (last value, when it was first seen)

    def observe(self, beats: Mapping[str, Optional[bytes]]) -> dict[str, float]:
        """Record `beats` (actor -> its current value, None before its first beat); returns the
        actors whose beat has not changed for more than `timeout_s`, with the seconds since."""
        now = self.clock()
        stopped = {}
        for actor, value in beats.items():
            if value is None:
                continue
            last = self._seen.get(actor)
            if last is None or last[0] != value:
                self._seen[actor] = (value, now)
            elif now - last[1] > self.timeout_s:
                stopped[actor] = now - last[1]
        return stopped

    def forget(self, actors: Iterable[str]) -> None:
        for actor in actors:
            self._seen.pop(actor, None)
