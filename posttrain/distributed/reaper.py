"""Leave nothing running after the controller dies, even by `kill -9`.

A local Ray cluster is a set of processes the driver starts (GCS server, raylet, agents, log
monitor), and the raylet starts the worker processes. On a clean exit `ray.shutdown()` stops them;
after SIGKILL nobody does, and Ray's agents notice their dead parent only after about a minute.
So `start_reaper` launches a small watcher in its own session that polls the driver and, once it
is gone, kills the recorded Ray processes and everything below them. The recorded start times
guard against a reused PID.

    python -m posttrain.distributed.reaper DRIVER_PID PID:START_TIME ...
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

POLL_S = 0.2


def start_reaper(driver_pid: int | None = None) -> subprocess.Popen | None:
    """Watch `driver_pid` (default: this process) and kill its current child processes when it
    dies. Call right after starting a local Ray cluster; returns the watcher (None when there is
    nothing to watch)."""
    driver = psutil.Process(driver_pid or os.getpid())
    children = driver.children(recursive=True)
    if not children:
        return None
    targets = [f"{p.pid}:{p.create_time()}" for p in children]
    return subprocess.Popen(
        [sys.executable, "-m", "posttrain.distributed.reaper", str(driver.pid), f"{driver.create_time()}", *targets],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C or kill of the driver's process group does not reach it
        close_fds=True,
    )


def _same_process(pid: int, create_time: float) -> psutil.Process | None:
    """The live process `pid` if it is still the one started at `create_time` (a zombie is dead)."""
    try:
        process = psutil.Process(pid)
        if abs(process.create_time() - create_time) >= 1e-3 or process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process
    except psutil.Error:
        return None


def reap(targets: list[tuple[int, float]]) -> int:
    """SIGKILL each still-running target and all its descendants; returns how many were killed."""
    victims: dict[int, psutil.Process] = {}
    for pid, create_time in targets:
        process = _same_process(pid, create_time)
        if process is None:
            continue
        try:
            for p in [process, *process.children(recursive=True)]:
                victims[p.pid] = p
        except psutil.Error:
            victims[process.pid] = process
    for p in victims.values():
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(victims.values()), timeout=5)
    return len(victims)


def main(argv: list[str]) -> int:
    driver_pid, driver_start = int(argv[0]), float(argv[1])
    targets = [(int(pid), float(t)) for pid, _, t in (a.partition(":") for a in argv[2:])]
    while _same_process(driver_pid, driver_start) is not None:
        time.sleep(POLL_S)
    reap(targets)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
