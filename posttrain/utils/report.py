"""One-page PNG summary of a run from its `metrics.jsonl`.

Panels (each drawn only when its metric was logged): training reward (`train/reward`),
validation accuracy (`validation/accuracy_greedy`, `validation/accuracy_sampled`, or DPO's and RM's
preference accuracy `validation/accuracy`; with several tasks, one thin line per task
`<metric>/<task>` beside the thick overall one; the same metric of another validation set,
`data.validation_sets`, dashed in the same colours), training loss (`train/loss`), validation loss
(`validation/loss`: SFT, DPO, RM), and a stacked bar chart of where each step's time went
(`timing/train/{generation,refit,logprobs,policy_training,reward}`, the rest of
`timing/train/total_step_time` as "other", and the total as a reference line). Steps are whole
numbers on every axis; an odd last panel spans the page's width rather than leave a blank cell.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from posttrain.utils.logger import read_metrics_jsonl

# (metric, title, y label) of the line panels, in display order.
CURVES = [
    ("train/reward", "Training reward", "mean reward"),
    ("validation/accuracy_greedy", "Validation accuracy, greedy", "accuracy"),
    ("validation/accuracy_sampled", "Validation accuracy, sampled", "accuracy"),
    ("validation/accuracy", "Validation accuracy", "accuracy"),
    ("train/loss", "Training loss", "loss"),
    ("validation/loss", "Validation loss", "loss"),
]
TIMING_PREFIX = "timing/train/"
TIMING_PARTS = ["generation", "refit", "logprobs", "policy_training", "reward"]
TOTAL_STEP_TIME = TIMING_PREFIX + "total_step_time"


def _series(records: dict[int, dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for step, record in records.items():
        value = record.get(name)
        if isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(step)
            values.append(float(value))
    return steps, values


def per_task_series(records: dict[int, dict[str, Any]], name: str) -> dict[str, tuple[list[int], list[float]]]:
    """`task -> (steps, values)` of the per-task metrics `<name>/<task>` (a blend's tasks), by task name."""
    prefix = name + "/"
    tasks = sorted({key[len(prefix):] for record in records.values() for key in record if key.startswith(prefix)})
    return {task: _series(records, prefix + task) for task in tasks}


def extra_validation_sets(records: dict[int, dict[str, Any]], name: str) -> list[str]:
    """The other validation sets (`data.validation_sets`: `validation_<set>/...`) that logged the
    metric `name` (a `validation/...` one) as well; [] for other metrics."""
    if not name.startswith("validation/"):
        return []
    suffix = name[len("validation"):]
    return sorted({key.split("/")[0] for record in records.values() for key in record
                   if key.startswith("validation_") and key.endswith(suffix) and key.count("/") == 1})


def write_report(metrics_jsonl_path: str | os.PathLike, out_png: str | os.PathLike, title: str | None = None) -> Path:
    """Draw the report of `metrics_jsonl_path` into `out_png`; returns the PNG path.

    Args:
        metrics_jsonl_path: a run's `metrics.jsonl` (see `posttrain.utils.logger`).
        out_png: where to write the PNG (parent folders are created).
        title: figure title. Defaults to the name of the run's log directory.
    """
    import matplotlib.pyplot as plt

    fig = build_report_figure(metrics_jsonl_path, title)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def build_report_figure(metrics_jsonl_path: str | os.PathLike, title: str | None = None):
    """The report as a matplotlib Figure (one axis per panel with data); see `write_report`."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; also safe inside Ray workers
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metrics_jsonl_path = Path(metrics_jsonl_path)
    records = read_metrics_jsonl(metrics_jsonl_path)
    curves = [(name, t, y, *_series(records, name)) for name, t, y in CURVES]
    curves = [curve for curve in curves if curve[3]]
    timing = {part: dict(zip(*_series(records, TIMING_PREFIX + part))) for part in TIMING_PARTS}
    timing = {part: values for part, values in timing.items() if values}
    total = dict(zip(*_series(records, TOTAL_STEP_TIME)))

    num_panels = len(curves) + (1 if timing or total else 0)
    ncols = 1 if num_panels <= 1 else 2
    nrows = max(1, math.ceil(num_panels / ncols))
    fig = plt.figure(figsize=(6.5 * ncols, 4.0 * nrows))
    grid = fig.add_gridspec(nrows, ncols)
    flat_axes = [fig.add_subplot(grid[i // ncols, :] if i == num_panels - 1 and num_panels % ncols
                                 else grid[i // ncols, i % ncols]) for i in range(num_panels)]
    for ax in flat_axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 0.5 on short runs

    for ax, (name, panel_title, ylabel, steps, values) in zip(flat_axes, curves):
        per_task = per_task_series(records, name)
        ax.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3,
                linewidth=2.5 if per_task else 1.5, color="black" if per_task else None,
                label="all tasks" if per_task else None)
        colors = {}
        for task, (task_steps, task_values) in per_task.items():
            (line,) = ax.plot(task_steps, task_values, marker="o" if len(task_steps) <= 30 else None, markersize=2,
                              linewidth=1.0, label=task)
            colors[task] = line.get_color()
        for other in extra_validation_sets(records, name):  # e.g. held-out phrasings: dashed, same colours
            other_name = other + name[len("validation"):]
            other_steps, other_values = _series(records, other_name)
            if other_steps:
                ax.plot(other_steps, other_values, linestyle="--", linewidth=2.0, color="black",
                        label=f"all tasks, {other}")
            for task, (task_steps, task_values) in per_task_series(records, other_name).items():
                ax.plot(task_steps, task_values, linestyle="--", linewidth=0.8, color=colors.get(task))
        if per_task:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.set_title(f"{panel_title} ({name})")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)

    if timing or total:
        ax = flat_axes[len(curves)]
        steps = sorted(set(total).union(*[set(v) for v in timing.values()]))
        bottoms = [0.0] * len(steps)
        colors = plt.get_cmap("tab10").colors
        for color, (part, values) in zip(colors, timing.items()):
            heights = [values.get(step, 0.0) for step in steps]
            ax.bar(steps, heights, bottom=bottoms, width=0.8, color=color, label=part)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        if total:
            other = [max(0.0, total.get(step, b) - b) for step, b in zip(steps, bottoms)]
            if any(other):
                ax.bar(steps, other, bottom=bottoms, width=0.8, color="lightgray", label="other")
            total_steps = sorted(total)
            ax.plot(total_steps, [total[s] for s in total_steps], color="black", marker="_", linestyle="none",
                    markersize=10, label="total_step_time")
        ax.set_title("Step time breakdown (timing/train/*)")
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.grid(alpha=0.3, axis="y")

    if num_panels == 0:
        ax = fig.add_subplot(1, 1, 1)
        ax.axis("off")
        ax.text(0.5, 0.5, f"no reward, accuracy, loss or timing metrics in {metrics_jsonl_path}",
                ha="center", va="center", wrap=True)

    fig.suptitle(title or metrics_jsonl_path.parent.name)
    failures = recovery_failures(records)
    if failures:  # below the panels, one line each (clipped: the full lines are in metrics.jsonl)
        lines = [f"recovered failures ({len(failures)}):", *(_clip_line(line) for line in failures)]
        height = 0.25 * len(lines) / fig.get_figheight()
        fig.text(0.01, 0.01, "\n".join(lines), fontsize="small", va="bottom", family="monospace")
        fig.tight_layout(rect=(0.0, height + 0.01, 1.0, 1.0))
    else:
        fig.tight_layout()
    return fig


def recovery_failures(records: dict[int, dict[str, Any]]) -> list[str]:
    """Every failure the run recovered from or stopped at, one line each: the last
    `recovery/failures` logged (each step logged after a failure carries the list so far)."""
    lists = [record["recovery/failures"] for record in records.values() if "recovery/failures" in record]
    return [str(line) for line in lists[-1]] if lists else []


def _clip_line(line: str, limit: int = 160) -> str:
    return line if len(line) <= limit else line[: limit - 3] + "..."
