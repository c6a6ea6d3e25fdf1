"""Host memory of this process, read from Linux's `/proc/self` (no-ops elsewhere).

`reset_peak_rss` writes 5 to `/proc/self/clear_refs`, which sets the kernel's high-water mark of
the resident set (`VmHWM`) back to the current resident set; `peak_rss_bytes` then reads the
highest resident set since. The two around a phase measure the most host memory it took beyond
what was resident before it, whoever allocated it (torch, numpy, Ray's shared memory, gloo).

Per-phase measurements (`posttrain.utils.phase_memory`) restart the kernel's mark many times a step;
they call `restart_peak_rss`, which remembers the mark it clears, so `peak_rss_bytes` still reports
the highest resident set since the process started or the last `reset_peak_rss`.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
# The highest mark `restart_peak_rss` cleared since the last `reset_peak_rss` (bytes).
_peak_before_restarts = 0


def _status_kib(field: str) -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_bytes() -> int:
    """Resident set size of this process now (0 where /proc is missing)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Highest resident set size since the process started or the last `reset_peak_rss`."""
    return max(_peak_before_restarts, kernel_peak_rss_bytes())


def kernel_peak_rss_bytes() -> int:
    """The kernel's high-water mark: the highest resident set since the last reset or restart."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Start a new high-water mark at the current resident set; False where the kernel refuses."""
    global _peak_before_restarts
    _peak_before_restarts = 0
    return _clear_high_water_mark()


def restart_peak_rss() -> bool:
    """Start a new kernel high-water mark for a phase (read it with `kernel_peak_rss_bytes`),
    keeping the cleared one for `peak_rss_bytes`; False where the kernel refuses."""
    global _peak_before_restarts
    _peak_before_restarts = max(_peak_before_restarts, kernel_peak_rss_bytes())
    return _clear_high_water_mark()


def _clear_high_water_mark() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


@functools.cache
def _malloc_trim():
    # glibc only (musl and macOS have none): None where the symbol is missing.
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Give the kernel back the memory the C allocator holds after frees (glibc's `malloc_trim(0)`);
    False where there is no glibc.

    PyTorch's CPU tensors come from malloc, and glibc keeps freed chunks resident inside its heaps,
    so each phase's peak carried what the phases before it had freed. Trimming at each phase
    boundary returns those pages (`madvise`): the Gemma 3 recipe's generation and refit peaks fell
    from 6.3-6.8 to 5.1 GiB. (The step-to-step growth under bfloat16 was oneDNN's kernel cache, not
    this: `utils/onednn.py`.) A call with nothing to release takes about 0.05 ms; released pages
    cost a page fault each when they are used again.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
