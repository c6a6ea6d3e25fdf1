"""Peak memory of a worker per phase of an RL step: generation, refit, logprobs, training.

A worker method that is (part of) a phase is decorated with `measured_phase(name)`. At its start
the peak is restarted (on CUDA the allocator's cache is emptied first, so each phase begins with
what it really holds and the colocated engine gets the memory back); at its end the peak is read
and kept, the highest of the phase's calls since the last `take_phase_memory`. The driver calls
`take_phase_memory` on every worker once a step and keeps the highest over workers
(`merge_peaks`), logged as

    memory/<phase>/allocated_gb, memory/<phase>/reserved_gb   (CUDA: torch.cuda's peak counters)
    memory/<phase>/peak_rss_gb                               (CPU: the process's peak resident set)

in GiB. A validation's phases are logged apart, as `memory/validation/<stat>` (`as_one_phase`). On CPU the peak is the process's (`utils/memory.py`: the kernel's high-water mark of the
resident set), whoever allocated it; with the local backend every worker shares one process, and
the phases run one after another, so each phase still reads its own peak. Costs: on CPU two small
reads and a write of `/proc/self`; on CUDA an `empty_cache` at each phase boundary.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, TypeVar

import torch

from posttrain.utils import memory

PHASES = ("generation", "refit", "logprobs", "training")
GIB = 2**30

# Phases measured in this process right now. A phase called inside another (the reference
# logprobs call the logprobs forward) is part of the outer one: only the outermost measures, so
# an inner restart cannot hide the outer phase's peak.
_open_phases = 0

F = TypeVar("F", bound=Callable[..., Any])


def _on_cuda(device: Any) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def begin_phase(device: Any) -> None:
    """Start measuring a phase on `device` (a phase boundary: on CUDA the cache is emptied)."""
    if _on_cuda(device):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        memory.release_freed_memory()
        memory.restart_peak_rss()


def end_phase(device: Any) -> dict[str, float]:
    """The peak since `begin_phase` in GiB (`allocated_gb`, `reserved_gb` on CUDA, `peak_rss_gb`
    on CPU); a phase boundary: on CUDA the cache is emptied after reading."""
    if _on_cuda(device):
        peaks = {"allocated_gb": torch.cuda.max_memory_allocated(device) / GIB,
                 "reserved_gb": torch.cuda.max_memory_reserved(device) / GIB}
        torch.cuda.empty_cache()
        return peaks
    return {"peak_rss_gb": memory.kernel_peak_rss_bytes() / GIB}


def measured_phase(phase: str) -> Callable[[F], F]:
    """Decorate a worker method (its object has `self.device`) as part of `phase`: its peak memory
    joins the phase's in `self.take_phase_memory()` (`MeasuresPhases`)."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; phases: {PHASES}")

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def measured(self, *args, **kwargs):
            global _open_phases
            if _open_phases:
                return method(self, *args, **kwargs)
            _open_phases += 1
            begin_phase(self.device)
            try:
                return method(self, *args, **kwargs)
            finally:
                _open_phases -= 1
                self._record_phase_peak(phase, end_phase(self.device))
        return measured  # type: ignore[return-value]
    return decorate


def as_one_phase(peaks: dict[str, float], name: str) -> dict[str, float]:
    """`memory/<name>/<stat>`: the highest of each stat over the phases of `peaks` (`memory/<phase>/<stat>`),
    e.g. validation's generation and the refit before it as one peak of `name` = validation."""
    merged: dict[str, float] = {}
    for key, value in peaks.items():
        stat = f"memory/{name}/{key.rsplit('/', 1)[-1]}"
        if key.split("/")[1] in PHASES:
            merged[stat] = max(merged.get(stat, value), value)
    return merged


def merge_peaks(reports: Iterable[dict[str, float]]) -> dict[str, float]:
    """The highest value of each metric over `reports` (workers, worker groups)."""
    merged: dict[str, float] = {}
    for report in reports:
        for name, value in (report or {}).items():
            merged[name] = max(merged.get(name, value), value)
    return merged


class MeasuresPhases:
    """Mixin of the workers whose methods are `measured_phase`s."""

    def _record_phase_peak(self, phase: str, peaks: dict[str, float]) -> None:
        kept = self.__dict__.setdefault("_phase_peaks", {})
        kept[phase] = merge_peaks([kept.get(phase, {}), peaks])

    def take_phase_memory(self) -> dict[str, float]:
        """`{"memory/<phase>/<stat>": GiB}` of the phases run since the last call, and forget them."""
        kept = self.__dict__.pop("_phase_peaks", {})
        return {f"memory/{phase}/{stat}": value for phase, peaks in kept.items() for stat, value in peaks.items()}
