"""Several teachers in one distillation: a teacher per task of the blend (NeMo-RL's multi-teacher
on-policy distillation).

`teachers: {<task>: <teacher section>}` names a task's teacher; `teacher` teaches the tasks
`teachers` does not name (the only teacher when `teachers` is empty, today's single-teacher run).
Every teacher is its own forward-only worker group; each step's rows are split by task, each
part scored by its task's teacher (`get_topk_logits`), and the top-k put back in the rows' order,
so the loss (`DistillationLoss`) is the same per token whichever teacher scored it.

The routing (`assign_teachers`, `route_rows`, `teachers_topk`) is pure: the teachers are any
objects with `get_topk_logits(batch, k, temperature)`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from posttrain.errors import UserError


def assign_teachers(cfg: Any, tasks: Iterable[str]) -> dict[str, str]:
    """`{task: teacher key}` for the training `tasks` (`teachers.<task>`, else `teacher`).

    Raises `UserError` naming the key where a task has no teacher (`teacher: null` and no
    `teachers.<task>`) or `teachers` names a task the training data does not have."""
    tasks = sorted(set(tasks))
    unknown = sorted(set(cfg.teachers) - set(tasks))
    if unknown:
        raise UserError(f"teachers.{unknown[0]}: the training data has no task {unknown[0]!r} "
                        f"(its tasks: {', '.join(tasks)})")
    assignment = {}
    for task in tasks:
        if task in cfg.teachers:
            assignment[task] = f"teachers.{task}"
        elif cfg.teacher is not None:
            assignment[task] = "teacher"
        else:
            raise UserError(f"teachers: task {task!r} has no teacher and teacher=null: add teachers.{task}, "
                            "or set teacher (the teacher of the tasks teachers does not name)")
    return assignment


def route_rows(task_names: Sequence[str], assignment: Mapping[str, str]) -> dict[str, list[int]]:
    """The rows (indices, in order) each teacher key scores, keys in first-seen order."""
    rows: dict[str, list[int]] = {}
    for i, task in enumerate(task_names):
        if task not in assignment:
            raise KeyError(f"row {i} has task {task!r}, which no teacher is assigned to ({sorted(assignment)})")
        rows.setdefault(assignment[task], []).append(i)
    return rows


def teachers_topk(batch: Any, task_names: Sequence[str], assignment: Mapping[str, str], teachers: Mapping[str, Any],
                  k: int, temperature: float) -> dict[str, torch.Tensor]:
    """`{"topk_logits", "topk_indices"}` `[B, S, k]` of `batch` (a `Batch`), each row's from its task's
    teacher. One teacher scoring every row gets the whole batch (no copy); otherwise each gets
    its rows (`Batch.select`), and its answer is written back at those rows (positions past a
    part's own length, if a teacher trims, stay 0: they are padding under `token_mask`)."""
    routes = route_rows(task_names, assignment)
    if len(routes) == 1:
        (key, _), = routes.items()
        return teachers[key].get_topk_logits(batch, k, temperature)
    out: dict[str, torch.Tensor] = {}
    for key, rows in routes.items():
        part = teachers[key].get_topk_logits(batch.select(rows), k, temperature)
        index = torch.tensor(rows)
        for name in ("topk_logits", "topk_indices"):
            values = part[name]
            if name not in out:
                out[name] = values.new_zeros((len(task_names), batch["input_ids"].shape[1], *values.shape[2:]))
            out[name][index, :values.shape[1]] = values
    return out


def teacher_task_index(task_names: Sequence[str], tasks: Sequence[str]) -> torch.Tensor:
    """`[B]` int64: each row's position in `tasks` (what `DistillationLoss` splits its per-task KL by)."""
    position = {task: i for i, task in enumerate(tasks)}
    return torch.tensor([position[t] for t in task_names], dtype=torch.long)


def per_task_kl(train_metrics: Mapping[str, float], tasks: Sequence[str]) -> dict[str, float]:
    """`distill_loss/<task>`: each task's token-mean KL over the step, from the loss's per-task sums
    (`kl_sum_task<i>` / `kl_tokens_task<i>`, both summed over micro-batches and averaged over the
    optimizer steps alike, so the ratio is the exact token mean); absent for a task with no tokens."""
    metrics = {}
    for i, task in enumerate(tasks):
        tokens = train_metrics.get(f"kl_tokens_task{i}", 0.0)
        if tokens > 0:
            metrics[f"distill_loss/{task}"] = train_metrics[f"kl_sum_task{i}"] / tokens
    return metrics
