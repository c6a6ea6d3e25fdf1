"""Where a job's start-up goes: seconds from the process's start to each milestone.

A job marks the end of each start-up phase (`mark("config")`, ...), and says what each phase does
when it begins (`begin("starting Ray")`, or both at once: `with phase("backend", "starting Ray")`):
a phase that lasts longer than a few seconds prints that as a line on stderr
(`posttrain.utils.progress`), so a slow start-up is never silent. When its training loop has run
its first step, `report()` gives each phase's duration (from the previous mark) and the time from
the command to the first step; the loop logs them as `timing/startup/<phase>` and prints one line.
Only the first report of a process counts: a job that runs another job first (GRPO's SFT warm
start) reports once, for the whole start-up.

The clock starts when the process started (Linux: `/proc/self/stat`; a `./run.sh` wrapper execs
the interpreter in the same process, so that is when the command was typed), else when this module
was imported. When `./run.sh` installed its environment first, it says when it finished
(`POSTTRAIN_INSTALL_DONE_AT`) and that time is the phase "install".
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Iterator, Optional

from posttrain.utils.progress import Announcer

_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """Wall-clock time (`time.time()` scale) when this process started."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        started_ticks = int(fields[19])  # field 22 of proc(5): starttime, in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


INSTALL_DONE_ENV = "POSTTRAIN_INSTALL_DONE_AT"


def _float_or_none(text: Optional[str]) -> Optional[float]:
    try:
        return float(text) if text else None
    except ValueError:
        return None


class StartupClock:
    """Milestones of one process's start-up, in order."""

    def __init__(self, start: Optional[float] = None, announcer: Optional[Announcer] = None) -> None:
        self.start = process_start_time() if start is None else start
        self.marks: list[tuple[str, float]] = []  # (phase that just ended, seconds since start)
        self.reported = False
        self.nested_depth = 0
        self.announcer = announcer or Announcer()
        self.begun = False  # a phase was begun since the last mark
        self.unannounced: list[str] = []  # marks that ended a phase nobody began: it ran silently
        installed_at = _float_or_none(os.environ.get(INSTALL_DONE_ENV))
        if installed_at is not None and self.start <= installed_at <= time.time():  # this process's install
            self.marks.append(("install", installed_at - self.start))

    def begin(self, description: str) -> None:
        """The job now does `description` ("loading the tokenizer gpt2"), said on stderr if it
        lasts (`progress.ANNOUNCE_AFTER_S`); the next `begin`, `mark`, `end` or `report` ends it.
        Several may come before one mark (its phase's steps); nested jobs' count too. Prefer
        `doing` or `phase`, which end it when their block fails: a phase left running would go on
        printing into whatever runs next in the process."""
        self.begun = True
        self.announcer.begin(description)

    def end(self) -> None:
        """What was begun is over, without a mark (a job that failed, or ran no first step)."""
        self.announcer.end()

    def mark(self, phase: str) -> None:
        """`phase` ends now (a phase marked twice adds up)."""
        self.announcer.end()
        if not self.begun:
            self.unannounced.append(phase)
        self.begun = False
        if not self.reported and not self.nested_depth:
            self.marks.append((phase, time.time() - self.start))

    @contextmanager
    def doing(self, description: str) -> Iterator[None]:
        """`begin(description)`, then `end()` when the block is done or fails (a step of a phase
        that a later mark ends)."""
        self.begin(description)
        try:
            yield
        finally:
            self.end()

    @contextmanager
    def phase(self, name: str, description: str) -> Iterator[None]:
        """`begin(description)`, then `mark(name)` when the block is done (`end()` if it fails)."""
        self.begin(description)
        try:
            yield
        except BaseException:
            self.end()
            raise
        self.mark(name)

    @contextmanager
    def nested(self) -> Iterator[None]:
        """A job run as a phase of another (GRPO's SFT warm start): its marks and report are
        ignored; the outer job's next mark covers it."""
        self.nested_depth += 1
        try:
            yield
        finally:
            self.nested_depth -= 1

    def report(self, first_step_seconds: float) -> Optional[dict[str, float]]:
        """Once per process: `{phase: seconds}` in order, plus `to_first_step` (the command to the
        start of the first training step) and `first_step`; None after the first call."""
        self.announcer.end()
        if self.reported or self.nested_depth:
            return None
        self.reported = True
        now = time.time() - self.start
        phases: dict[str, float] = {}
        previous = 0.0
        for phase, at in self.marks:
            phases[phase] = phases.get(phase, 0.0) + max(0.0, at - previous)
            previous = at
        to_first_step = now - first_step_seconds
        phases["other"] = phases.get("other", 0.0) + max(0.0, to_first_step - previous)
        phases["to_first_step"] = to_first_step
        phases["first_step"] = first_step_seconds
        return phases


CLOCK = StartupClock()


def mark(phase: str) -> None:
    """End `phase` of this process's start-up (see `StartupClock.mark`)."""
    CLOCK.mark(phase)


def begin(description: str) -> None:
    """Say what this process's start-up does now, if it lasts (see `StartupClock.begin`)."""
    CLOCK.begin(description)


def end() -> None:
    """What was begun is over (see `StartupClock.end`)."""
    CLOCK.end()


def doing(description: str):
    """`with doing("loading the tokenizer gpt2"): ...` (see `StartupClock.doing`)."""
    return CLOCK.doing(description)


def phase(name: str, description: str):
    """`with phase("workers", "starting 2 policy workers"): ...` (see `StartupClock.phase`)."""
    return CLOCK.phase(name, description)


def summary_line(phases: dict[str, float]) -> str:
    """`[posttrain] started in 3.9s (interpreter 0.1, config 0.3, ...); first step 0.4s`."""
    parts = ", ".join(f"{name.replace('_', ' ')} {seconds:.1f}" for name, seconds in phases.items()
                      if name not in ("to_first_step", "first_step") and seconds >= 0.05)
    return (f"[posttrain] started in {phases['to_first_step']:.1f}s ({parts}); "
            f"first step {phases['first_step']:.1f}s")
