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


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Best wall time of `repeats` calls of `fn` (after one warm-up call) and the last result,
    with CUDA synchronised around each timed call where a GPU is present."""
    import torch

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    result = fn()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best, result


def best_interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> tuple[dict[str, float], dict]:
    """Each function once (warm-up), then `repeats` rounds calling each in turn: the best seconds of
    each and its last result (interleaved, so a change in the machine's speed hits all alike)."""
    results = {name: fn() for name, fn in fns.items()}
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            results[name] = fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best, results
