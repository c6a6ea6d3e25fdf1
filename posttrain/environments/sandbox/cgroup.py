"""A memory and process cap for a whole sandbox, through a cgroup where this machine lets us make one.

`SandboxCgroup.create(memory_bytes, processes)` makes a child of this process's own cgroup (cgroup
v2, or the v1 `memory` and `pids` hierarchies) with `memory.max` / `memory.limit_in_bytes` (swap
included where it can be set) and `pids.max`; the sandbox is started inside it (`wrap`), so every
process of it counts against one budget. Its counters (`oom_kill` of `memory.events`, v1
`memory.oom_control`; `max` of `pids.events`) tell the sandbox that a test hit a limit even when the program
caught the failure and exited 0. `available()` says once per process which enforcement applies.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger(__name__)
_PREFIX = "posttrain-sandbox-"


def _own_cgroup_dirs() -> dict[str, str]:
    """{"v2" | controller name: the directory of this process's cgroup in that hierarchy}."""
    mounts: dict[str, str] = {}  # "v2" or v1 controller -> mount point
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, fs = left.split(), right.split()
                if not fs:
                    continue
                if fs[0] == "cgroup2":
                    mounts.setdefault("v2", fields[4])
                elif fs[0] == "cgroup":
                    for option in fs[-1].split(","):
                        if option in ("memory", "pids"):
                            mounts.setdefault(option, fields[4])
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return {}
    dirs = {}
    for _, controllers, path in lines:
        for name in (controllers.split(",") if controllers else ["v2"]):
            if name in mounts:
                dirs[name] = os.path.join(mounts[name], path.lstrip("/"))
    return dirs


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@dataclass
class SandboxCgroup:
    """One sandbox's cgroup directories (one for v2; memory and pids for v1) and its counter files."""

    dirs: list[str]
    # "memory" | "pids" -> (file, the key of its "limit hit" count)
    counter_files: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def create(cls, memory_bytes: int, processes: int) -> "SandboxCgroup":
        """A fresh cgroup capped at `memory_bytes` and `processes`; OSError when this machine refuses."""
        own = _own_cgroup_dirs()
        name = _PREFIX + uuid.uuid4().hex[:12]
        made: list[str] = []
        try:
            if "v2" in own and "memory" in _read(os.path.join(own["v2"], "cgroup.subtree_control")).split():
                path = os.path.join(own["v2"], name)
                os.mkdir(path)
                made.append(path)
                _write(os.path.join(path, "memory.max"), str(memory_bytes))
                _try_write(os.path.join(path, "memory.swap.max"), "0")
                counters = {"memory": (os.path.join(path, "memory.events"), "oom_kill")}
                if os.path.exists(os.path.join(path, "pids.max")):
                    _write(os.path.join(path, "pids.max"), str(processes))
                    counters["pids"] = (os.path.join(path, "pids.events"), "max")
                return cls(made, counters)
            if "memory" not in own:
                raise OSError("no memory cgroup controller this process may use")
            path = os.path.join(own["memory"], name)
            os.mkdir(path)
            made.append(path)
            _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_bytes))
            _try_write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(memory_bytes))
            counters = {"memory": (os.path.join(path, "memory.oom_control"), "oom_kill")}
            if "pids" in own:
                try:
                    pids_path = os.path.join(own["pids"], name)
                    os.mkdir(pids_path)
                    made.append(pids_path)
                    _write(os.path.join(pids_path, "pids.max"), str(processes))
                    counters["pids"] = (os.path.join(pids_path, "pids.events"), "max")
                except OSError:
                    pass  # the memory cap still applies; RLIMIT_NPROC caps processes
            return cls(made, counters)
        except OSError:
            cls(made).remove()
            raise

    def wrap(self, command: list[str]) -> list[str]:
        """`command` started inside this cgroup (a shell joins it, then execs the command). As root the
        sandbox's own processes are shielded from its OOM killer, so that a test's processes die first."""
        joins = " && ".join(f"echo $$ > {shlex.quote(os.path.join(d, 'cgroup.procs'))}" for d in self.dirs)
        script = f"{joins} && {{ echo -1000 > /proc/self/oom_score_adj; }} 2>/dev/null; exec \"$@\""
        return ["/bin/sh", "-c", script, "sh", *command]

    def open_counters(self) -> dict[str, list]:
        """Read-only fds of the counter files, to pass into the sandbox ({"memory": [fd, key], ...})."""
        return {name: [os.open(path, os.O_RDONLY), key] for name, (path, key) in self.counter_files.items()}

    def remove(self) -> None:
        """Delete the cgroup once its processes are gone (they are killed with the sandbox; wait a moment)."""
        for path in reversed(self.dirs):
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        log.warning("code sandbox: could not remove cgroup %s (processes still in it?)", path)
                        break
                    time.sleep(0.05)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _try_write(path: str, value: str) -> None:
    try:
        _write(path, value)
    except OSError:
        pass  # swap accounting off: nothing to cap


_lock = threading.Lock()
_available: Optional[str] = None  # "" = not available


def available() -> Optional[str]:
    """Which cgroup enforcement works here ("cgroup v2" / "cgroup v1"), or None; probed once."""
    global _available
    with _lock:
        if _available is None:
            try:
                probe = SandboxCgroup.create(64 * 2**20, 8)
                try:  # can a process join it?
                    joined = subprocess.run(probe.wrap(["true"]), capture_output=True, timeout=30).returncode == 0
                except subprocess.SubprocessError:
                    joined = False
                probe.remove()
                if not joined:
                    raise OSError("a process cannot join the cgroup")
                _available = "cgroup v2" if probe.counter_files["memory"][0].endswith("memory.events") else "cgroup v1"
            except OSError as e:
                log.debug("code sandbox: no cgroup: %s", e)
                _available = ""
        return _available or None
