"""`posttrain eval`'s table: one row per task (environment) of a blend, one column per metric, and
beside it the previous evaluation of the same data in the same log directory, so two checkpoints
compare at a glance (a named validation set, `data.validation_sets`, is a column of its own):

    task             n  accuracy_greedy  previous  change
    calc            30            0.267     0.100  +0.167
    ...
    all            210            0.314     0.262  +0.052
"""

from __future__ import annotations

from typing import Optional


def task_columns(metrics: dict[str, float]) -> tuple[list[str], list[str]]:
    """(metric names that have per-task values `<metric>/<task>`, the tasks), both sorted as found."""
    names, tasks = [], []
    for key in metrics:
        name, _, task = key.rpartition("/")
        if not name or "_count" in name or f"{name}_count/{task}" not in metrics:
            continue
        if name not in names:
            names.append(name)
        if task not in tasks:
            tasks.append(task)
    return names, sorted(tasks)


def _column(name: str) -> str:
    """A metric's column header: `accuracy_greedy`, or a validation set's `unseen_phrasing/accuracy_greedy`."""
    head, _, metric = name.rpartition("/")
    return metric if head in ("validation", "") else f"{head.removeprefix('validation_')}/{metric}"


def format_task_table(metrics: dict[str, float], previous: Optional[dict[str, float]] = None,
                      previous_model: Optional[str] = None) -> Optional[str]:
    """The table of a multi-task evaluation (None for a single task). `previous` (the metrics of an
    earlier evaluation of the same tasks) adds its value of the first metric and the change."""
    names, tasks = task_columns(metrics)
    if not tasks:
        return None
    first = names[0]
    compare = previous is not None and all(f"{first}/{task}" in previous for task in tasks)
    short = [_column(name) for name in names]
    width = max(len("task"), *(len(task) for task in tasks))
    header = f"{'task':<{width}} {'n':>5}" + "".join(f" {s:>{max(len(s), 8)}}" for s in short)
    if compare:
        header += f" {'previous':>9} {'change':>7}"
    lines = [header]

    def row(label: str, count: Optional[float], key_of) -> str:
        line = f"{label:<{width}} {'' if count is None else int(count):>5}"
        for name, s in zip(names, short):
            value = metrics.get(key_of(name))
            line += f" {'' if value is None else f'{value:.3f}':>{max(len(s), 8)}}"
        if compare:
            now, before = metrics.get(key_of(first)), previous.get(key_of(first))
            if now is not None and before is not None:
                line += f" {before:>9.3f} {now - before:>+7.3f}"
        return line

    for task in tasks:
        lines.append(row(task, metrics.get(f"{first}_count/{task}"), lambda name: f"{name}/{task}"))
    total = sum(metrics.get(f"{first}_count/{task}", 0.0) for task in tasks)
    lines.append(row("all", total, lambda name: name))
    if compare and previous_model:
        lines.append(f"(previous: {previous_model})")
    return "\n".join(lines)
