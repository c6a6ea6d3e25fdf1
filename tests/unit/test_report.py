"""PNG report from metrics.jsonl."""

import math

import pytest

from posttrain.config.schema import LoggerConfig
from posttrain.utils.logger import Logger
from posttrain.utils.report import build_report_figure, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(log_dir, steps=12, with_validation=True, with_timing=True):
    with Logger(LoggerConfig(log_dir=str(log_dir), tensorboard_enabled=False)) as logger:
        for step in range(1, steps + 1):
            logger.log_metrics({"train/reward": 1 - math.exp(-step / 4), "train/loss": 1 / step}, step)
            if with_timing:
                parts = {"generation": 1.0, "refit": 0.1, "logprobs": 0.3, "policy_training": 0.8, "reward": 0.05}
                logger.log_metrics({**parts, "total_step_time": 2.5}, step, prefix="timing/train/")
            if with_validation and step % 4 == 0:
                logger.log_metrics({"validation/accuracy": step / 40}, step)
    return log_dir / "metrics.jsonl"


def test_full_report(tmp_path):
    metrics = write_run(tmp_path / "run")
    out = write_report(metrics, tmp_path / "plots" / "report.png")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 20_000  # four drawn panels, not an empty canvas

    fig = build_report_figure(metrics)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [
        "Training reward (train/reward)",
        "Validation accuracy (validation/accuracy)",
        "Training loss (train/loss)",
        "Step time breakdown (timing/train/*)",
    ]
    reward_line = fig.axes[0].get_lines()[0]
    assert list(reward_line.get_xdata()) == list(range(1, 13))
    assert list(fig.axes[1].get_lines()[0].get_xdata()) == [4, 8, 12]
    assert list(fig.axes[1].get_lines()[0].get_ydata()) == [0.1, 0.2, 0.3]
    timing = fig.axes[3]
    # 5 parts + "other" (2.5 - 2.25 = 0.25 s per step), 12 bars each.
    assert len(timing.patches) == 6 * 12
    labels = timing.get_legend_handles_labels()[1]
    assert labels == ["total_step_time", "generation", "refit", "logprobs", "policy_training", "reward", "other"]
    other_heights = [p.get_height() for p in timing.containers[5]]
    assert other_heights == pytest.approx([0.25] * 12)


def test_missing_metrics_are_skipped(tmp_path):
    metrics = write_run(tmp_path / "run", with_validation=False, with_timing=False)
    fig = build_report_figure(metrics)
    assert [ax.get_title() for ax in fig.axes] == ["Training reward (train/reward)", "Training loss (train/loss)"]
    assert write_report(metrics, tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC


def test_empty_metrics_still_write_a_png(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "train/other": 1.0}\n')
    fig = build_report_figure(metrics)
    assert len(fig.axes) == 1 and "no reward" in fig.axes[0].texts[0].get_text()
    assert write_report(metrics, tmp_path / "r.png").stat().st_size > 1000


def test_short_runs_get_whole_step_ticks_and_no_blank_cell(tmp_path):
    """A 4-step DPO run: whole-number steps on every axis, its validation loss drawn, and three
    panels fill the page (the last one spans both columns) rather than leave an empty cell."""
    with Logger(LoggerConfig(log_dir=str(tmp_path / "dpo"), tensorboard_enabled=False)) as logger:
        for step in range(0, 5):
            if step:
                logger.log_metrics({"train/loss": 0.69 - step / 100}, step)
            if step % 2 == 0:
                logger.log_metrics({"validation/accuracy": 0.5 + step / 10, "validation/loss": 0.7 - step / 50}, step)
    fig = build_report_figure(tmp_path / "dpo" / "metrics.jsonl")
    assert [ax.get_title() for ax in fig.axes] == [
        "Validation accuracy (validation/accuracy)", "Training loss (train/loss)", "Validation loss (validation/loss)",
    ]
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    first, last = fig.axes[0].get_position(), fig.axes[2].get_position()
    assert last.width > 1.8 * first.width  # spans the row

    # A GRPO-style run: the greedy accuracy under its own name.
    with Logger(LoggerConfig(log_dir=str(tmp_path / "grpo"), tensorboard_enabled=False)) as logger:
        for step in (0, 2):
            logger.log_metrics({"validation/accuracy_greedy": 0.4 + step / 10}, step)
    fig = build_report_figure(tmp_path / "grpo" / "metrics.jsonl")
    assert [ax.get_title() for ax in fig.axes] == ["Validation accuracy, greedy (validation/accuracy_greedy)"]


def test_a_blend_gets_one_accuracy_line_per_task(tmp_path):
    """The recipe's plot: per-environment accuracy over steps beside the overall one (counts not drawn)."""
    with Logger(LoggerConfig(log_dir=str(tmp_path / "run"), tensorboard_enabled=False)) as logger:
        for step in (0, 10, 20):
            logger.log_metrics({"validation/accuracy_greedy": step / 100, "validation/accuracy_greedy/math": step / 50,
                                "validation/accuracy_greedy/quiz": 0.1, "validation/accuracy_greedy_count/quiz": 30.0},
                               step)
    fig = build_report_figure(tmp_path / "run" / "metrics.jsonl")
    (panel,) = fig.axes
    assert panel.get_legend_handles_labels()[1] == ["all tasks", "math", "quiz"]
    lines = {line.get_label(): list(line.get_ydata()) for line in panel.get_lines()}
    assert lines["math"] == [0.0, 0.2, 0.4] and lines["quiz"] == [0.1, 0.1, 0.1]


def test_another_validation_set_is_dashed_in_the_same_colours(tmp_path):
    """`data.validation_sets` (the recipe's held-out phrasings): its overall line and per-task lines,
    dashed, each task in the colour of its line on the main set."""
    with Logger(LoggerConfig(log_dir=str(tmp_path / "run"), tensorboard_enabled=False)) as logger:
        for step in (0, 10):
            logger.log_metrics({"validation/accuracy_greedy": 0.5, "validation/accuracy_greedy/math": step / 20,
                                "validation_unseen_phrasing/accuracy_greedy": 0.25,
                                "validation_unseen_phrasing/accuracy_greedy/math": step / 40,
                                "validation_unseen_phrasing/accuracy_greedy_count/math": 80.0}, step)
    fig = build_report_figure(tmp_path / "run" / "metrics.jsonl")
    (panel,) = fig.axes
    assert panel.get_legend_handles_labels()[1] == ["all tasks", "math", "all tasks, validation_unseen_phrasing"]
    dashed = [line for line in panel.get_lines() if line.get_linestyle() == "--"]
    assert [list(line.get_ydata()) for line in dashed] == [[0.25, 0.25], [0.0, 0.25]]
    (math_line,) = [line for line in panel.get_lines() if line.get_label() == "math"]
    assert dashed[1].get_color() == math_line.get_color()


def test_the_failures_a_run_recovered_from_are_listed_under_the_panels(tmp_path):
    log_dir = tmp_path / "run"
    with Logger(LoggerConfig(log_dir=str(log_dir), tensorboard_enabled=False)) as logger:
        failures = ["step 2: environment 'math' died: its process exited", "step 3: policy workers hung: " + "x" * 300]
        logger.log_metrics({"train/reward": 0.5, "recovery/restarts": 1}, 2, records={"recovery/failures": failures[:1]})
        logger.log_metrics({"train/reward": 0.6, "recovery/restarts": 2}, 3, records={"recovery/failures": failures})
        logger.log_metrics({"train/reward": 0.7, "recovery/restarts": 2}, 4)
    fig = build_report_figure(log_dir / "metrics.jsonl")
    [text] = [t.get_text() for t in fig.texts if "recovered" in t.get_text()]
    lines = text.splitlines()
    assert lines[:2] == ["recovered failures (2):", failures[0]]  # the last list logged: every failure
    assert lines[2].startswith("step 3: policy workers hung: xxx") and lines[2].endswith("...") and len(lines[2]) == 160
    assert not [t for t in build_report_figure(write_run(tmp_path / "clean")).texts if "recovered" in t.get_text()]
