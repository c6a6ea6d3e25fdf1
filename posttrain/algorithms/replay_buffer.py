"""The replay buffer of async GRPO: per-prompt groups with bounded staleness.

The trajectory collector puts scored groups in; the trainer takes `num_prompts_per_step` of them
per step, oldest first. A group generated with the weights of policy step `v` and trained at the
step whose weights are `w` (completed steps before it) is `w - v` steps old; groups older than
`max_age` are evicted when the trainer looks, and counted. The buffer holds at most
`capacity` groups (`num_prompts_per_step x max_age`): a collector with a full buffer waits, so
it never runs further ahead than the age limit allows and never generates groups only to evict
them.

Nothing here blocks forever. `take` waits at most `timeout` seconds and checks the producer's
health every `poll_s`: a dead collector stops the trainer at once with the collector's error
(NeMo-RL issue #3488: the trainer polled forever after its collector died), and a group that
is late (a straggler) never holds the others back, because the trainer takes whichever groups
are ready (NeMo-RL #3238: one straggler wedged the buffer).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Optional


class AsyncRolloutError(RuntimeError):
    """Async GRPO cannot go on: the collector died, or no trajectories came within the timeout."""


class ReplayBuffer:
    """Thread-safe FIFO of scored prompt groups (anything with a `weight_version` attribute).

    Args:
        capacity: groups held at most; `put` waits for room.
        max_age: oldest group, in policy steps, that `take` hands out.
    """

    def __init__(self, capacity: int, max_age: int):
        if capacity < 1 or max_age < 0:
            raise ValueError(f"ReplayBuffer: capacity={capacity} must be >= 1 and max_age={max_age} >= 0")
        self.capacity, self.max_age = capacity, max_age
        self._groups: deque = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.evicted = 0  # groups dropped for age, since the start
        self.last_ages: list[int] = []  # ages of the groups the last `take` returned

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def put(self, group: Any, stop: Optional[threading.Event] = None, poll_s: float = 0.5) -> bool:
        """Append `group`, waiting for room; False (and nothing added) when `stop` is set or the
        buffer was closed first."""
        with self._cond:
            while len(self._groups) >= self.capacity and not self._closed:
                if stop is not None and stop.is_set():
                    return False
                self._cond.wait(poll_s)
            if self._closed:
                return False
            self._groups.append(group)
            self._cond.notify_all()
            return True

    def take(
        self, num_groups: int, current_version: int, *, timeout: float,
        producer_error: Callable[[], Optional[str]] = lambda: None, poll_s: float = 0.2,
    ) -> list[Any]:
        """The `num_groups` oldest groups at most `max_age` steps older than `current_version`.

        Evicts older groups first. Raises `AsyncRolloutError` after `timeout` seconds without
        enough groups, or as soon as `producer_error()` returns a reason (the collector died).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._evict(current_version)
                if len(self._groups) >= num_groups:
                    taken = [self._groups.popleft() for _ in range(num_groups)]
                    self.last_ages = [current_version - g.weight_version for g in taken]
                    self._cond.notify_all()  # room for the collector
                    return taken
                problem = producer_error()
                if problem:
                    raise AsyncRolloutError(f"async GRPO: the trajectory collector stopped: {problem}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AsyncRolloutError(
                        f"async GRPO: only {len(self._groups)} of {num_groups} prompt groups ready after "
                        f"{timeout:.0f}s (grpo.async_grpo.buffer_timeout_s)"
                    )
                self._cond.wait(min(poll_s, remaining))

    def _evict(self, current_version: int) -> None:
        fresh = deque(g for g in self._groups if current_version - g.weight_version <= self.max_age)
        self.evicted += len(self._groups) - len(fresh)
        if len(fresh) != len(self._groups):
            self._groups = fresh
            self._cond.notify_all()

    def close(self) -> None:
        """Wake and release every waiting `put`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        with self._cond:
            return {"groups": list(self._groups), "evicted": self.evicted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._cond:
            self._groups = deque(state["groups"][: self.capacity])
            self.evicted = int(state.get("evicted", 0))
