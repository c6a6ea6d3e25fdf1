"""Named wall-clock sections for step-time breakdowns.

    timer = Timer()
    with timer.time("total_step_time"):
        with timer.time("generation"):
            ...
    metrics = {f"timing/train/{k}": v for k, v in timer.get_timing_metrics().items()}
    timer.reset()

Sections are flat names, not a tree: a section may run inside another (as above), and each
name just accumulates its own elapsed seconds. The caller adds the `timing/train/` prefix and
calls `reset()` once per step.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Literal

Reduction = Literal["sum", "mean", "max", "min", "count"]


class Timer:
    """Accumulates elapsed seconds per section name (`time.perf_counter`)."""

    def __init__(self) -> None:
        self._durations: dict[str, list[float]] = {}
        self._started: dict[str, float] = {}

    def start(self, name: str) -> None:
        if name in self._started:
            raise RuntimeError(f"timer section {name!r} is already running")
        self._started[name] = time.perf_counter()

    def stop(self, name: str) -> float:
        """End section `name`; returns the seconds it ran."""
        if name not in self._started:
            raise RuntimeError(f"timer section {name!r} was not started")
        elapsed = time.perf_counter() - self._started.pop(name)
        self._durations.setdefault(name, []).append(elapsed)
        return elapsed

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Time the body of a `with` block as section `name` (recorded even if the body raises)."""
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def add(self, name: str, seconds: float) -> None:
        """Record `seconds` measured elsewhere (e.g. inside a worker) as one run of `name`."""
        self._durations.setdefault(name, []).append(float(seconds))

    def get_timing_metrics(self, reduction: Reduction = "sum") -> dict[str, float]:
        """Seconds per finished section, reduced over its runs since the last `reset`.

        Args:
            reduction: `sum` (default: total time in the step), `mean`, `max`, `min`, or
                `count` (number of runs).
        """
        reducers = {"sum": sum, "mean": lambda d: sum(d) / len(d), "max": max, "min": min, "count": len}
        if reduction not in reducers:
            raise ValueError(f"unknown reduction {reduction!r}; expected one of {sorted(reducers)}")
        return {name: float(reducers[reduction](runs)) for name, runs in self._durations.items()}

    def reset(self) -> None:
        """Forget finished and running sections (call once per step)."""
        self._durations.clear()
        self._started.clear()
