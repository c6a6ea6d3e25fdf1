"""Threads for this process's math on cores that other processes keep busy too.

torch's threads meet after every parallel operation. On a core that another process also wants, the
thread that arrives first waits for a peer the OS has descheduled, for up to a time slice, and the
small operations of a tiny model pay that wait hundreds of times a step. The embedded default's SFT
step (benchmarks/busy_machine.py, 2 cores, beside a busy loop on each core) took 0.31 s with 2
threads and 0.15-0.18 s with 1, against 0.08-0.10 s quiet, even with OpenMP's passive waiting after
a short spin (`posttrain.utils.openmp`).

With `cluster.adapt_threads_to_load`, the local backend, which computes in this process with every
core it may use, computes with the cores the rest of the machine leaves to it: a sampler thread
reads `/proc/stat` once a second (the busy time of this process's CPUs, minus this process's own CPU
time, is what the others use) and each local worker applies the count on its own thread before a
call (`torch.set_num_threads` is per thread under OpenMP). Never more than the configured count,
never fewer than one. It is off by default because float sums depend on the thread count (a tiny
model's gradients moved by 3e-9 between 1 and 2 threads): a run would depend on the machine's load
in its last bits, and seeded reruns and resumed runs would no longer repeat it exactly. Off, the
sampler still runs and says once, after a few seconds of others' load, what the option would do.
Nothing runs where `/proc/stat` is missing (not Linux) or `cluster.cpus_per_worker` fixes the count.

Free of torch at import: `posttrain.distributed.actors`, which must stay light, imports it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

from posttrain.utils.openmp import release_thread_team
from posttrain.utils.progress import write_stderr

log = logging.getLogger(__name__)

SAMPLE_PERIOD_S = 1.0
# Weight of the newest sample in the moving average of the others' load: a busy loop that starts
# counts fully after about 3 s, a one-second burst (a child process, a log flush) does not flip it.
SMOOTHING = 0.5
# A core counts as free while the others leave at least 70% of it (a quiet machine's daemons, and this
# run's own answer checkers in child processes, take a few percent; a third of a core taken already
# costs the threads a time slice at many of their meetings).
FREE_CORE_SHARE = 0.7
ADVICE_AFTER_SAMPLES = 5  # seconds of others' load before the run says what adapting would do
PROC_STAT = "/proc/stat"


def threads_for(max_threads: int, num_cpus: int, others_cores: float) -> int:
    """The threads to compute with when other processes keep `others_cores` of this process's
    `num_cpus` CPUs busy: one per core they leave (mostly) free, between 1 and `max_threads`."""
    free = num_cpus - others_cores
    return max(1, min(max_threads, int(free + (1.0 - FREE_CORE_SHARE))))


def busy_seconds(stat_text: str, cpus: set[int], ticks_per_s: float) -> float:
    """CPU seconds spent busy so far on `cpus`, from the text of `/proc/stat` (per-CPU lines
    `cpuN user nice system idle iowait irq softirq steal ...`; steal, time a hypervisor gave to
    another machine, counts as busy: it is not ours either)."""
    total = 0
    for line in stat_text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        if int(name[3:]) not in cpus:
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = (int(f) for f in fields[:8])
        total += user + nice + system + irq + softirq + steal
    return total / ticks_per_s


class CpuShare:
    """The others' load on this process's CPUs, sampled, and the thread count it leaves us.

    Args:
        max_threads: the most threads to use (the configured count).
        adapt: use the count the others' load leaves (`threads`); otherwise keep `max_threads` and only
            say once what adapting would do.
        cpus: the CPUs this process may run on (default: its affinity mask).
        read_stat: returns `/proc/stat`'s text (a test passes its own).
        own_cpu_s: this process's CPU seconds so far, every thread (default `time.process_time`).
        clock: wall seconds (default `time.monotonic`).
    """

    def __init__(self, max_threads: int, adapt: bool = True, cpus: Optional[set[int]] = None,
                 read_stat: Optional[Callable[[], str]] = None, own_cpu_s: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = max(1, int(max_threads))
        self.adapt = adapt
        self.suggested = self.max_threads  # what the others' load leaves
        self._crowded_samples = 0
        self.cpus = set(cpus) if cpus is not None else set(os.sched_getaffinity(0))
        self._read_stat = read_stat or _read_proc_stat
        self._own_cpu_s, self._clock = own_cpu_s, clock
        self._ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
        self.others_cores = 0.0
        self._last = self._measure()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _measure(self) -> tuple[float, float, float]:
        return self._clock(), busy_seconds(self._read_stat(), self.cpus, self._ticks_per_s), self._own_cpu_s()

    @property
    def threads(self) -> int:
        """The count the workers compute with: `suggested` when adapting, else the configured one."""
        return self.suggested if self.adapt else self.max_threads

    def sample(self) -> int:
        """Measure the others' load since the last sample, fold it into the average and return the
        thread count it leaves (`suggested`)."""
        now, busy, own = self._measure()
        then, busy_before, own_before = self._last
        self._last = (now, busy, own)
        if now <= then:
            return self.suggested
        others = max(0.0, (busy - busy_before) - (own - own_before)) / (now - then)
        self.others_cores = SMOOTHING * min(others, len(self.cpus)) + (1 - SMOOTHING) * self.others_cores
        suggested = threads_for(self.max_threads, len(self.cpus), self.others_cores)
        busy_cores = f"other processes keep {self.others_cores:.1f} of this process's {len(self.cpus)} cores busy"
        if self.adapt and suggested != self.suggested:
            log.debug("%s: computing with %d of %d threads", busy_cores, suggested, self.max_threads)
            if suggested < self.max_threads:
                _say_once("adapted", f"[posttrain] {busy_cores}: computing with {suggested} of {self.max_threads} "
                                     f"threads while they do (cluster.adapt_threads_to_load)")
        self._crowded_samples = self._crowded_samples + 1 if suggested < self.max_threads else 0
        if not self.adapt and self._crowded_samples == ADVICE_AFTER_SAMPLES:
            _say_once("advice", f"[posttrain] {busy_cores}, and this run's {self.max_threads} threads wait for each "
                                f"other at every operation: cluster.adapt_threads_to_load=true would compute with "
                                f"{suggested} (about 2x faster beside two busy loops on 2 cores; the run then depends on "
                                f"the load in its last bits)")
        self.suggested = suggested
        return suggested

    def start(self, period_s: float = SAMPLE_PERIOD_S) -> "CpuShare":
        def run() -> None:
            while not self._stop.wait(period_s):
                try:
                    self.sample()
                except (OSError, ValueError):  # /proc gone or unreadable: keep the last count
                    return

        self._thread = threading.Thread(target=run, name="posttrain-cpu-share", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


_said: set[str] = set()


def _say_once(what: str, line: str) -> None:
    """Print `line` the first time this process has `what` to say (a job's warm start and its main
    run each start a sampler; the user needs the line once)."""
    if what not in _said:
        _said.add(what)
        write_stderr(line)  # with the run's other progress lines, above a progress bar


def _read_proc_stat() -> str:
    with open(PROC_STAT) as f:
        return f.read()


_share: Optional[CpuShare] = None
_applied = threading.local()


def share_cores(max_threads: int, adapt: bool) -> Optional[CpuShare]:
    """Sample the others' load on this process's cores; with `adapt`, this process's local workers
    compute with at most `max_threads` threads, fewer while other processes keep its cores busy (this
    module's docstring). One sampler per process: a later call replaces the earlier one. None (and
    nothing changes) where `/proc/stat` cannot be read."""
    global _share
    stop_sharing()
    if max_threads <= 1:
        return None
    try:
        _share = CpuShare(max_threads, adapt=adapt).start()
    except (OSError, ValueError, AttributeError):  # no /proc/stat, or no sched_getaffinity (not Linux)
        return None
    return _share


def stop_sharing() -> None:
    """Stop the sampler; threads keep the count they last applied until `torch.set_num_threads`."""
    global _share
    if _share is not None:
        _share.stop()
        _share = None


def apply_on_this_thread() -> None:
    """Set this thread's torch thread count to the sampler's, if one runs and the count changed (a
    local worker calls it before each call: OpenMP keeps the count per thread)."""
    share = _share
    if share is None:
        return
    threads = share.threads
    before = getattr(_applied, "threads", None)
    if before != threads:
        import torch

        if before is None or threads < before:
            # The team of the larger count would stay, idle, and GNU OpenMP throttles every thread's
            # wait once a process has more threads than cores (posttrain.utils.openmp).
            release_thread_team()
        torch.set_num_threads(threads)
        _applied.threads = threads
