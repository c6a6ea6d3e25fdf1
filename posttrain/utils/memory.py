"""Host memory of this process, read from Linux's `/proc/self` (no-ops elsewhere).

`reset_peak_rss` writes 5 to `/proc/self/clear_refs`, which sets the kernel's high-water mark of
the resident set (`VmHWM`) back to the current resident set; `peak_rss_bytes` then reads the
highest resident set since. The two around a phase measure the most host memory it took beyond
what was resident before it, whoever allocated it (torch, numpy, Ray's shared memory, gloo).
"""

from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


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
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Start a new high-water mark at the current resident set; False where the kernel refuses."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False
