"""The memory plan's data: what one device holds per phase (`DevicePlan`), a job's devices
(`Plan`), and the SFT warm starts that run before it (`WarmStart`). `jobs.py` fills them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from posttrain.plan.shape import ModelShape

# Every phase a job may have, in the order the tables print them (a job has some: `job_phases`).
PHASES = ("generation", "refit", "logprobs", "training", "validation", "teacher eval", "evaluation")


@dataclass
class DevicePlan:
    """Bytes one device (a GPU, or a CPU worker process) holds: `rows[item][phase]`, for the
    job's `phases`."""

    name: str
    phases: tuple[str, ...] = PHASES
    rows: dict[str, dict[str, int]] = field(default_factory=dict)
    # Rows of models that take turns on the device (distillation's teachers score one after the
    # other, their accuracy engines run one at a time): item -> (group, member). A phase counts
    # each group's largest member, not the sum of its members.
    turns: dict[str, tuple[str, str]] = field(default_factory=dict)

    def add(self, item: str, nbytes: float, phases: Optional[tuple[str, ...]] = None,
            turn: Optional[tuple[str, str]] = None) -> None:
        """Count `nbytes` of `item` in `phases` (default: all of the device's); a phase the job
        does not have is skipped. `turn` (group, member): the item is `member`'s in a group whose
        members take turns (`turns`)."""
        for phase in self.phases if phases is None else phases:
            if phase in self.phases:
                self.rows.setdefault(item, {})[phase] = self.rows.get(item, {}).get(phase, 0) + int(nbytes)
        if turn is not None and item in self.rows:
            self.turns[item] = turn

    def phase_total(self, phase: str) -> int:
        members: dict[str, dict[str, int]] = {}
        for item, (group, member) in self.turns.items():
            share = members.setdefault(group, {})
            share[member] = share.get(member, 0) + self.rows[item].get(phase, 0)
        alone = sum(row.get(phase, 0) for item, row in self.rows.items() if item not in self.turns)
        return alone + sum(max(share.values()) for share in members.values())

    def taking_turns(self) -> set[str]:
        """The rows of groups with more than one member (the table marks them)."""
        groups: dict[str, set[str]] = {}
        for group, member in self.turns.values():
            groups.setdefault(group, set()).add(member)
        return {item for item, (group, _) in self.turns.items() if len(groups[group]) > 1}

    def peak(self) -> tuple[str, int]:
        """(phase, bytes) of the phase that needs the most (the first of equals)."""
        return max(((p, self.phase_total(p)) for p in self.phases), key=lambda pair: pair[1])


@dataclass
class Plan:
    """The devices of one job (one of each kind: every policy device holds the same) and the
    memory each has (None: unknown); `warm_starts` are the jobs that run before it."""

    devices: list[DevicePlan]
    device_bytes: Optional[int]
    on_gpu: bool
    process_counts: list[int]  # how many of each device kind the job has
    num_nodes: int = 1
    row_tokens: Optional[int] = None  # the longest row planned for (`longest_row_tokens`)
    longest_prompt: Optional[int] = None  # tokens of the longest prompt, when known
    row_bound: str = "policy.max_total_sequence_length"  # what bounds `row_tokens`, in words
    job: str = "grpo"  # the job's name as the tables print it
    phases: tuple[str, ...] = PHASES
    warm_starts: list["WarmStart"] = field(default_factory=list)
    teacher_shapes: dict[str, ModelShape] = field(default_factory=dict)  # distillation's, by teacher key

    def node_peak(self) -> int:
        """This job's peak (not its warm starts'): GPU: the largest device peak; CPU: the sum of
        the peaks of one node's processes (a kind's processes spread evenly over `num_nodes`)."""
        if self.on_gpu:
            return max(d.peak()[1] for d in self.devices)
        return sum(d.peak()[1] * self._per_node(count) for d, count in zip(self.devices, self.process_counts))

    def phase_peak(self, phase: str) -> int:
        """What `phase` needs: per GPU the largest device's, on CPU one node's processes together."""
        if self.on_gpu:
            return max(d.phase_total(phase) for d in self.devices)
        return sum(d.phase_total(phase) * self._per_node(count) for d, count in zip(self.devices, self.process_counts))

    def peak_phase(self) -> str:
        """The phase that sets this job's peak (its largest device's; on CPU the first process kind's)."""
        return max(self.devices, key=lambda d: d.peak()[1]).peak()[0] if self.on_gpu else self.devices[0].peak()[0]

    def _per_node(self, count: int) -> int:
        return math.ceil(count / self.num_nodes)

    def phase_peaks(self) -> list[tuple[str, str, int]]:
        """(job, phase, bytes) of every phase of the warm starts, then of this job, in the order they run."""
        warm = [peak for w in self.warm_starts if w.plan is not None for peak in w.plan.phase_peaks()]
        return warm + [(self.job, phase, self.phase_peak(phase)) for phase in self.phases]

    def run_peak(self) -> tuple[str, str, int]:
        """(job, phase, bytes) of the job that needs the most of the run's jobs (this job or a warm
        start that will run), its phase that sets the peak, and that peak."""
        jobs = [self] + [w.plan for w in self.warm_starts if w.plan is not None]
        top = max(jobs, key=lambda plan: plan.node_peak())
        return top.job, top.peak_phase(), top.node_peak()


@dataclass
class WarmStart:
    """An SFT warm start of the run (`key`: `sft_warmup` or `teacher_warmup`), its own job before
    the run's: its config and shape, and its plan (None when its export is cached: it will not run)."""

    key: str
    cfg: Any
    shape: Optional[ModelShape]
    plan: Optional[Plan]
    export_dir: Any = None
