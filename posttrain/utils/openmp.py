"""How OpenMP threads wait: a short bounded spin, and idle threads releasing their team.

OpenMP threads that spin while they wait for work make every parallel region wait for a thread the
OS has not scheduled when other processes hold the cores: a 2-thread training step went from 0.32 s
to 5.1 s beside a CPU hog, and stays at 0.74 s with passive waiting. Sleeping at once costs too: a
decode step of a 135M model is hundreds of small parallel regions, and waking a sleeping thread for
each made it 1.6x slower (58 ms against 36). So threads wait passively after a short bounded spin
of GNU OpenMP's (`OMP_WAIT_DEFAULTS`, which `posttrain/__init__.py` sets; GOMP_SPINCOUNT=10000 is
about 0.1 ms). docs/performance.md, "A busy machine, and how OpenMP threads wait";
benchmarks/busy_machine.py and openmp_wait.py.

GNU OpenMP (the runtime of torch's Linux wheels) gives each thread that starts a parallel region a
team of worker threads of its own, kept until that thread ends. The local backend runs every worker
and environment on a thread of its own (`posttrain.distributed.actors`), so a synchronous job holds
one team per worker thread, idle or not. Once a process has more OpenMP threads than cores, GNU
OpenMP cuts every waiting thread's spin to its throttled count (none with passive waiting), and each
of the hundreds of small parallel regions of a decode step pays a thread wake-up: a 135M model's
step took 52 ms beside another thread's idle team against 36 ms alone.
`omp_pause_resource_all` (OpenMP 5.0) ends the calling thread's team; the next parallel region on
that thread starts a new one, for the cost of creating a thread.

Imported by `posttrain/__init__.py` before anything else: it must stay free of posttrain imports
and of torch.

Other OpenMP runtimes (LLVM's libomp on macOS, Intel's) keep one pool for the whole process, where a
pause would stop the threads of every caller: this does nothing there.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Callable, Optional

OMP_WAIT_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}


def environment_with_wait(settings: dict[str, str]) -> dict[str, str]:
    """This process's environment for a child that waits as `settings` say ({} for posttrain's defaults):
    both variables are dropped first, since posttrain adds its own only when neither is set."""
    return {k: v for k, v in os.environ.items() if k not in OMP_WAIT_DEFAULTS} | settings


OMP_PAUSE_SOFT = 1  # omp_pause_soft: end the threads, keep what a restart needs
_pause: Optional[Callable[[int], int]] = None
_looked_up = False


def _gnu_openmp_pause() -> Optional[Callable[[int], int]]:
    """`omp_pause_resource_all` of the GNU OpenMP library loaded in this process, or None."""
    try:
        with open("/proc/self/maps") as maps:
            # Fields: address, perms, offset, device, inode, then the path (which may hold spaces).
            paths = {fields[5].strip() for fields in (line.split(None, 5) for line in maps if "libgomp" in line)
                     if len(fields) == 6 and fields[5].startswith("/")}
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
