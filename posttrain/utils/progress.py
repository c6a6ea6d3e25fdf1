"""Lines that say what a long phase is doing, so that no start-up phase is silent for long.

    phase = Phase("starting 2 policy workers")   # a line only if it lasts ANNOUNCE_AFTER_S
    ...                                          # the slow work
    phase.end()                                  # no line is written after this

A phase that lasts longer than `after` seconds writes `[posttrain] starting 2 policy workers...`,
then `[posttrain] still starting 2 policy workers (35 s)` every `every` seconds while it lasts (with
its `detail`, e.g. the package pip is on, when one is set); a phase that ends sooner writes
nothing. `Announcer` holds the one phase a process's start-up is in (`posttrain.utils.startup`).

Plain lines, on a terminal too, rather than a spinner redrawn in place: while workers start, Ray
relays their output, and transformers and pip log, onto the same terminal without knowing of a
spinner, which would tear it. Lines go through tqdm's `write` once tqdm is loaded, so a progress
bar on screen (a warm start's training bar) is cleared and redrawn around them, not overwritten.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from typing import Callable, Optional

ANNOUNCE_AFTER_S = 4.0  # shorter phases say nothing: most start-ups stay as quiet as before
REPEAT_EVERY_S = 30.0
PREFIX = "[posttrain] "
AFTER_ENV = "POSTTRAIN_PHASE_LINES_AFTER_S"  # e.g. 0: every phase says itself; inf: none does


def announce_after_s() -> float:
    """`$POSTTRAIN_PHASE_LINES_AFTER_S` if it is a number >= 0, else `ANNOUNCE_AFTER_S`."""
    try:
        value = float(os.environ.get(AFTER_ENV, ""))
    except ValueError:
        return ANNOUNCE_AFTER_S
    return value if value >= 0 else ANNOUNCE_AFTER_S


def write_stderr(line: str) -> None:
    """Print `line` on stderr, above a tqdm bar when one is drawn."""
    if "tqdm" in sys.modules:
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)
        sys.stderr.flush()
    else:
        print(line, file=sys.stderr, flush=True)


class Phase:
    """One phase being watched; see the module doc.

    Args:
        description: what the phase does, as the lines say it ("loading the tokenizer gpt2").
        write: receives each line (default: stderr, `write_stderr`).
        after: seconds before the first line (default `ANNOUNCE_AFTER_S`).
        every: seconds between the later lines (default `REPEAT_EVERY_S`).
        prefix: put in front of each line (default "[posttrain] ").
        announced: the caller already said the first line itself; only the later ones are written.
        clock: seconds, for the elapsed time in the lines (default `time.monotonic`).
        watch: start the thread that writes the lines (default True; False for tests, which call
            `tick`).
    """

    def __init__(self, description: str, *, write: Callable[[str], None] = write_stderr,
                 after: float = ANNOUNCE_AFTER_S, every: float = REPEAT_EVERY_S, prefix: str = PREFIX,
                 announced: bool = False, clock: Callable[[], float] = time.monotonic, watch: bool = True) -> None:
        self.description = description
        self.detail: Optional[str] = None  # what the phase is on now, shown by the later lines
        self.write, self.after, self.every, self.prefix, self.clock = write, after, every, prefix, clock
        self.started = clock()
        self.lines = 1 if announced else 0
        self._ended = threading.Event()
        self._lock = threading.Lock()  # a line is either written whole before `end` returns, or not at all
        self._thread: Optional[threading.Thread] = None
        if after <= 0 and not announced:  # said at once, in order with the caller's own lines
            self.tick()
        if watch:
            self._thread = threading.Thread(target=self._watch, name="posttrain-phase", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        wait = self.after if self.after > 0 else self.every  # after 0: the first line is out already
        while math.isfinite(wait) and not self._ended.wait(wait):  # inf: no (more) lines
            self.tick()
            wait = self.every

    def line(self) -> str:
        """The line the phase would write now."""
        if not self.lines:
            return f"{self.prefix}{self.description}..."
        detail = f"; {self.detail}" if self.detail else ""
        return f"{self.prefix}still {self.description} ({self.clock() - self.started:.0f} s{detail})"

    def tick(self) -> None:
        """Write the phase's next line, unless it has ended."""
        with self._lock:
            if not self._ended.is_set():
                self.write(self.line())
                self.lines += 1

    def end(self) -> None:
        """The phase is over: no more lines."""
        with self._lock:
            self._ended.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> "Phase":
        return self

    def __exit__(self, *exc) -> None:
        self.end()


class Announcer:
    """The phase a process is in, at most one at a time: beginning one ends the last.

    Args:
        write, after, every: as for `Phase` (defaults: stderr, `announce_after_s()`, `REPEAT_EVERY_S`).
    """

    def __init__(self, write: Callable[[str], None] = write_stderr, after: Optional[float] = None,
                 every: float = REPEAT_EVERY_S) -> None:
        self.write, self.after, self.every = write, announce_after_s() if after is None else after, every
        self.current: Optional[Phase] = None
        self._lock = threading.Lock()

    def begin(self, description: str) -> Phase:
        """`description` is what the process does from now on (the last phase ends)."""
        with self._lock:
            if self.current is not None:
                self.current.end()  # first, so that its last line cannot follow the new phase's
            self.current = Phase(description, write=self.write, after=self.after, every=self.every)
            return self.current

    def end(self) -> None:
        """The current phase, if any, is over."""
        with self._lock:
            if self.current is not None:
                self.current.end()
                self.current = None
