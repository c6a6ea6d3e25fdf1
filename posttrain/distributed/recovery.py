"""Recovery from dead workers: what failed, why (in one line), and how many restarts a run has left.

The parts that rebuild live with what they rebuild: a `WorkerGroup` restarts its members
(`WorkerGroup.restart`: a new process group on the same bundles, placed again after a lost node),
the `Policy` reloads its state from the last checkpoint, the generation engine takes the policy's
weights by a refit, and `EnvironmentActors` starts a dead environment again. This module holds
what they share and what can be tested without Ray: a `Fault` (who failed and why), the cause of
an actor's death in words (`death_cause`), and the run's `RestartBudget` (`cluster.max_restarts`),
kept across reruns in `<checkpointing.checkpoint_dir>/recovery.json` (`load_record`, `save_record`).
The run's recovery (`posttrain.algorithms.run_recovery`) puts them together; the training loop only
sees "this step failed, replay it" and the restart counts.

Recovery needs the Ray backend: with `cluster.backend: local` every worker is a thread of the
controller's process, so a killed worker is the whole run (rerun it to resume from its last
checkpoint).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Iterable, Optional

KINDS = ("policy", "critic", "teacher", "generation", "environment")  # what a run rebuilds
BASE_KINDS = ("policy", "generation", "environment")  # what every on-policy run has
# The kinds whose members hold trained state that only a checkpoint restores: rebuilding one sends
# the run back to its last checkpoint.
TRAINED_KINDS = ("policy", "critic")
# Beside the checkpoints (`checkpointing.checkpoint_dir`): the run's restarts and failures so far,
# so that `cluster.max_restarts` bounds the run across reruns of its command.
RECORD_FILE = "recovery.json"


class Replay(Enum):
    """What a training loop does after a recovered failure."""

    STEP = "step"  # the policy is as before the step: draw the step's prompts again and rerun it
    FROM_CHECKPOINT = "checkpoint"  # the policy was rebuilt: go back to the last checkpoint and rerun from there


@dataclass(frozen=True)
class Fault:
    """One failed member of a run.

    Args:
        kind: one of `KINDS` ("policy", "critic", "teacher", "generation", "environment").
        who: the member in words, e.g. "policy worker rank 1 (node 10.0.0.2)" or "environment 'math'".
        cause: why, in words, e.g. "its process died (killed, out of memory or crashed)".
        lost_node: the IP of the node that was lost with it, when that is why (else None).
        name: the environment's name for an environment, the teacher's key ("teacher",
            "teachers.<task>") for a teacher (else "").
    """

    kind: str
    who: str
    cause: str
    lost_node: Optional[str] = None
    name: str = ""

    def __str__(self) -> str:
        return f"{self.who} {self.cause}"


def death_cause(reason: str, *, oom: bool = False, node_ip: str = "", message: str = "") -> tuple[str, bool]:
    """What killed an actor, in words, from Ray's record of its death; and whether its node was lost.

    Args:
        reason: the name of Ray's `ActorDiedErrorContext.Reason` (`WORKER_DIED`, `NODE_DIED`,
            `RAY_KILL`, ...), or "" when Ray gave none.
        oom: Ray's memory monitor killed it.
        node_ip: the node it ran on (named when the node was lost).
        message: Ray's own message, used when the reason says nothing.
    """
    if oom:
        return "was killed by Ray's memory monitor (its node ran out of memory)", False
    if reason == "NODE_DIED":
        return f"was lost with its node {node_ip or '?'}", True
    if reason == "WORKER_DIED":
        return "died: its process exited (killed by a signal, out of memory, or crashed)", False
    if reason == "RAY_KILL":
        return "was killed (ray.kill)", False
    if reason in ("OWNER_DIED", "OUT_OF_SCOPE", "REF_DELETED"):
        return f"was stopped by Ray ({reason.lower().replace('_', ' ')})", False
    first = message.strip().splitlines()[0] if message.strip() else "no reason given"
    return f"died ({first})", False


class RestartBudget:
    """The restarts one run may make: at most `max_restarts` recoveries (`cluster.max_restarts`),
    each counted once in all and once for every kind of member it rebuilt.

    `recovery/restarts` (cumulative) and `recovery/restarts/<kind>` for each of `kinds` (the run's:
    default `BASE_KINDS`; PPO adds "critic", distillation "teacher") go to every logged step;
    `failures` holds each failure in one line ("step 3: generation worker rank 0 ... died: ..."),
    also those that stopped the run. `state_dict` / `load_state_dict` carry all of it to a rerun
    (`earlier`: the restarts made by earlier runs).
    """

    def __init__(self, max_restarts: int, kinds: Iterable[str] = BASE_KINDS) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"a run rebuilds members of {KINDS}, got {sorted(unknown)}")
        self.max_restarts = max_restarts
        self.total = 0
        self.per_kind = {kind: 0 for kind in KINDS if kind in set(kinds)}
        self.failures: list[str] = []
        self.earlier = 0

    def exhausted(self) -> bool:
        """No restart left."""
        return self.total >= self.max_restarts

    def record(self, kinds: Iterable[str]) -> int:
        """Count one recovery that rebuilt members of `kinds`; returns its number (1, 2, ...)."""
        if self.exhausted():
            raise RuntimeError(f"no restart left (max_restarts={self.max_restarts})")
        kinds = set(kinds)
        unknown = kinds - set(self.per_kind)
        if not kinds or unknown:
            raise ValueError(f"a restart of this run rebuilds members of {tuple(self.per_kind)}, got {sorted(kinds)}")
        self.total += 1
        for kind in kinds:
            self.per_kind[kind] += 1
        return self.total

    def metrics(self) -> dict[str, float]:
        return {"recovery/restarts": float(self.total),
                **{f"recovery/restarts/{kind}": float(n) for kind, n in self.per_kind.items()}}

    def state_dict(self) -> dict[str, Any]:
        return {"restarts": self.total, "per_kind": dict(self.per_kind), "failures": list(self.failures)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from an earlier run's counts (kinds this run does not have are dropped)."""
        self.total = self.earlier = int(state.get("restarts", 0))
        for kind, count in dict(state.get("per_kind", {})).items():
            if kind in self.per_kind:
                self.per_kind[kind] = int(count)
        self.failures = [str(line) for line in state.get("failures", [])]


def load_record(checkpoint_dir: str | os.PathLike) -> Optional[dict[str, Any]]:
    """The restart record an earlier run left in `checkpoint_dir` (None: a fresh directory).
    Raises `UserError` (one line, before any step) naming the file when it is not a record."""
    from posttrain.errors import UserError

    path = Path(checkpoint_dir) / RECORD_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        return record
    except ValueError as error:
        raise UserError(f"{path}: not a restart record ({error}); delete it to count restarts from 0") from None


def save_record(checkpoint_dir: str | os.PathLike, record: dict[str, Any]) -> Path:
    """Write `record` to `checkpoint_dir`/recovery.json atomically (a temporary file renamed)."""
    directory = Path(checkpoint_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RECORD_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def describe(faults: list[Fault]) -> str:
    """The faults in one line: "policy worker rank 1 died: ...; environment 'math' died: ..."."""
    return "; ".join(str(fault) for fault in faults)
