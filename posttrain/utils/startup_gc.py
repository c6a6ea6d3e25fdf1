"""Python's cycle collector while a process imports torch and transformers.

Importing torch, transformers and posttrain's worker modules leaves about a million objects that
live as long as the process. CPython before 3.14 runs a full collection each time its oldest
generation has grown by a quarter, and each one walks every object there: six full collections,
~0.6 s of CPU, in every worker process's start (measured on a policy worker's imports and a tiny
model: 4.3 s -> 3.75 s of CPU without them; nine in a `posttrain grpo` driver, 1.6 s). Those
objects are never garbage, so the walks find nothing.

So posttrain defers full collections from the moment it is imported (`defer_full_collections`, from
`posttrain/__init__.py`) until the process begins its work (`imports_done`): when the CLI has
imported its job (`cli.run_job`), at any job's start (`job.start_backend`), before a Ray worker is
built (`WorkerHost.construct`, `DistributedWorker`, the vLLM worker once vLLM is imported) and in an
environment actor's constructor. Young generations are collected throughout, so short-lived cycles
are freed as before. `imports_done` restores the thresholds and, in processes posttrain started for
itself, freezes (`gc.freeze`) what exists then, so that later full collections skip the imported
modules too (a worker's full collections then take milliseconds instead of ~0.15 s). A process
that never calls it (a vLLM tensor-parallel worker, a script that only imports posttrain) keeps
running full collections, a hundred times less often.
"""

from __future__ import annotations

import gc
from typing import Optional

# Collections of the oldest generation wait for this many of the middle one (CPython's default: 10).
DEFERRED_OLDEST_THRESHOLD = 1000

_thresholds_before: Optional[tuple[int, int, int]] = None
_done = False


def defer_full_collections() -> None:
    """Make full collections a hundred times rarer until `imports_done` (once per process; a
    no-op after `imports_done` or when the collector is off)."""
    global _thresholds_before
    if _done or _thresholds_before is not None or not gc.isenabled():
        return
    _thresholds_before = gc.get_threshold()
    young, middle, _ = _thresholds_before
    gc.set_threshold(young, middle, DEFERRED_OLDEST_THRESHOLD)


def imports_done(*, freeze: bool) -> None:
    """The process's imports are over: restore the collector's thresholds. Only the first call
    does anything.

    Args:
        freeze: also move every object that exists now out of all later collections
            (`gc.freeze`), so that full collections stop walking the imported modules. Only in a
            process posttrain started for itself (the CLI, a worker, an environment actor): in
            another program's process, its objects would be frozen too, and a cycle among them
            that becomes garbage later would never be freed.
    """
    global _thresholds_before, _done
    if _done:
        return
    _done = True
    if _thresholds_before is not None:
        gc.set_threshold(*_thresholds_before)
        _thresholds_before = None
        if freeze:
            gc.freeze()


def state() -> dict:
    """This process's collector: whether full collections are deferred, the thresholds and how many
    objects are frozen (diagnostics)."""
    return {"deferring": _thresholds_before is not None, "thresholds": gc.get_threshold(),
            "frozen": gc.get_freeze_count()}
