"""Releasing a thread's idle OpenMP team, so that the threads still computing keep spinning briefly.

GNU OpenMP (the runtime of torch's Linux wheels) gives each thread that starts a parallel region a
team of worker threads of its own, kept until that thread ends. The local backend runs every worker
and environment on a thread of its own (`posttrain.distributed.actors`), so a synchronous job holds
one team per worker thread, idle or not. Once a process has more OpenMP threads than cores, GNU
OpenMP cuts every waiting thread's spin to its throttled count (none with passive waiting), and each
of the hundreds of small parallel regions of a decode step pays a thread wake-up: a 135M model's
step took 52 ms beside another thread's idle team against 36 ms alone (`posttrain/__init__.py` sets
the spin). `omp_pause_resource_all` (OpenMP 5.0) ends the calling thread's team; the next parallel
region on that thread starts a new one, for the cost of creating a thread.

Other OpenMP runtimes (LLVM's libomp on macOS, Intel's) keep one pool for the whole process, where a
pause would stop the threads of every caller: this does nothing there.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Callable, Optional

OMP_PAUSE_SOFT = 1  # omp_pause_soft: end the threads, keep what a restart needs
_pause: Optional[Callable[[int], int]] = None
_looked_up = False


def _gnu_openmp_pause() -> Optional[Callable[[int], int]]:
    """`omp_pause_resource_all` of the GNU OpenMP library loaded in this process, or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # an older GNU OpenMP (before GCC 10) has no pause
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause
    return None


def release_thread_team() -> bool:
    """End the calling thread's idle GNU OpenMP team (call it outside any parallel region, i.e. from
    Python code). Returns whether a pause ran; a no-op before torch is loaded and with other runtimes."""
    global _pause, _looked_up
    if "torch._C" not in sys.modules:
        return False  # torch's libraries (OpenMP with them) are not loaded: no team exists yet
    if not _looked_up:
        _pause, _looked_up = _gnu_openmp_pause(), True
    return _pause is not None and _pause(OMP_PAUSE_SOFT) == 0
