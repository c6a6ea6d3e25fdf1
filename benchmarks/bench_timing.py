"""Timing shared by the benchmark scripts (importable as `bench_timing`: a script's own folder is on
its `sys.path` when run as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import time
from typing import Callable


def best_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
