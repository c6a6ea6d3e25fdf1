"""Logger (JSONL + TensorBoard), truncation on resume, Timer, ProgressBar."""

import json
import sys
import types

import numpy as np
import pytest
import torch

from posttrain.config.schema import LoggerConfig
from posttrain.utils.logger import Logger, ProgressBar, read_metrics_jsonl
from posttrain.utils.timer import Timer


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_lines_and_tensorboard_events(tmp_path):
    cfg = LoggerConfig(log_dir=str(tmp_path / "run"), tensorboard_enabled=True)
    with Logger(cfg) as logger:
        logger.log_metrics({"train/reward": 0.5, "train/loss": torch.tensor(1.25)}, step=1)
        logger.log_metrics({"generation": np.float64(2.0), "total_step_time": 3}, step=1, prefix="timing/train/")
        logger.log_metrics({"train/reward": 0.75, "train/gen_kl_error": float("nan")}, step=2)
        logger.log_hyperparams({"grpo": {"num_generations_per_prompt": 4}, "policy": {"model_name": "tiny"}})

    records = lines(tmp_path / "run" / "metrics.jsonl")
    assert records == [
        {"step": 1, "train/reward": 0.5, "train/loss": 1.25},
        {"step": 1, "timing/train/generation": 2.0, "timing/train/total_step_time": 3.0},
        {"step": 2, "train/reward": 0.75, "train/gen_kl_error": None},  # NaN -> null keeps JSON valid
    ]
    assert read_metrics_jsonl(tmp_path / "run" / "metrics.jsonl") == {
        1: {"train/reward": 0.5, "train/loss": 1.25, "timing/train/generation": 2.0, "timing/train/total_step_time": 3.0},
        2: {"train/reward": 0.75, "train/gen_kl_error": None},
    }

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_files = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert event_files
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/reward")] == [(1, 0.5), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("timing/train/generation")] == [(1, 2.0)]
    assert "train/gen_kl_error" not in events.Tags()["scalars"]  # NaN skipped


def test_non_numeric_metric_is_a_clear_error(tmp_path):
    with Logger(LoggerConfig(log_dir=str(tmp_path), tensorboard_enabled=False)) as logger:
        with pytest.raises(TypeError, match="'train/name'"):
            logger.log_metrics({"train/name": "abc"}, step=1)
        with pytest.raises(TypeError, match="single number"):
            logger.log_metrics({"train/vec": torch.ones(3)}, step=1)


def test_resume_truncates_later_steps(tmp_path):
    cfg = LoggerConfig(log_dir=str(tmp_path), tensorboard_enabled=False)
    with Logger(cfg) as logger:
        for step in range(1, 6):
            logger.log_metrics({"train/reward": step / 10}, step=step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "train/rew')  # torn line of a crash

    # The run resumes from the checkpoint of step 3 and logs steps 4.. again.
    with Logger(cfg, resume_step=3) as logger:
        assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]
        logger.log_metrics({"train/reward": 0.9}, step=4)
        assert logger.truncate_after(3) == 1  # also callable directly; the file stays appendable
        logger.log_metrics({"train/reward": 0.8}, step=4)
    assert lines(tmp_path / "metrics.jsonl") == [
        {"step": 1, "train/reward": 0.1},
        {"step": 2, "train/reward": 0.2},
        {"step": 3, "train/reward": 0.3},
        {"step": 4, "train/reward": 0.8},
    ]


def test_read_metrics_jsonl_names_the_bad_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"a": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics_jsonl(path)


def test_wandb_enabled_but_missing_is_a_clear_error_at_config_load(tmp_path, monkeypatch):
    from pydantic import ValidationError

    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails like an absent package
    with pytest.raises(ValidationError, match="logger.wandb.enabled=true needs the 'wandb' package"):
        LoggerConfig(log_dir=str(tmp_path), tensorboard_enabled=False, wandb={"enabled": True})
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ValidationError, match="logger.mlflow.enabled=true needs the 'mlflow' package"):
        LoggerConfig(log_dir=str(tmp_path), mlflow={"enabled": True})


def test_wandb_and_mlflow_calls(tmp_path, monkeypatch):
    """Wiring check with recording stand-ins (neither package is a dependency of the project)."""
    calls = []

    class Run:
        config = types.SimpleNamespace(update=lambda c, allow_val_change: calls.append(("wandb.config", c)))

        def log(self, metrics, step):
            calls.append(("wandb.log", metrics, step))

        def finish(self):
            calls.append(("wandb.finish",))

    wandb = types.SimpleNamespace(init=lambda **kw: calls.append(("wandb.init", kw["project"], kw["mode"])) or Run())
    mlflow = types.SimpleNamespace(
        set_tracking_uri=lambda uri: calls.append(("mlflow.uri", uri)),
        set_experiment=lambda name: calls.append(("mlflow.experiment", name)),
        start_run=lambda run_name: calls.append(("mlflow.start", run_name)),
        log_metrics=lambda metrics, step: calls.append(("mlflow.log", metrics, step)),
        log_params=lambda params: calls.append(("mlflow.params", params)),
        end_run=lambda: calls.append(("mlflow.end",)),
    )
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    cfg = LoggerConfig(
        log_dir=str(tmp_path),
        tensorboard_enabled=False,
        wandb={"enabled": True, "project": "p"},
        mlflow={"enabled": True, "tracking_uri": "file:///x", "run_name": "r"},
    )
    with Logger(cfg) as logger:
        logger.log_metrics({"train/reward": 1.0, "train/bad": float("inf")}, step=7)
        logger.log_hyperparams({"a": {"b": 1}})
    assert calls == [
        ("wandb.init", "p", "offline"),
        ("mlflow.uri", "file:///x"),
        ("mlflow.experiment", "posttrain"),
        ("mlflow.start", "r"),
        ("wandb.log", {"train/reward": 1.0}, 7),
        ("mlflow.log", {"train/reward": 1.0}, 7),
        ("wandb.config", {"a": {"b": 1}}),
        ("mlflow.params", {"a.b": "1"}),
        ("wandb.finish",),
        ("mlflow.end",),
    ]


def test_timer_sections_and_reductions(monkeypatch):
    clock = iter([0.0, 1.0, 1.5, 4.0, 10.0, 10.25, 11.0, 11.5])
    monkeypatch.setattr("posttrain.utils.timer.time.perf_counter", lambda: next(clock))
    timer = Timer()
    with timer.time("total_step_time"):  # 0.0 .. 4.0
        with timer.time("generation"):  # 1.0 .. 1.5
            pass
    with timer.time("generation"):  # 10.0 .. 10.25
        pass
    assert timer.get_timing_metrics() == {"generation": 0.75, "total_step_time": 4.0}
    assert timer.get_timing_metrics("mean") == {"generation": 0.375, "total_step_time": 4.0}
    assert timer.get_timing_metrics("max")["generation"] == 0.5
    assert timer.get_timing_metrics("count") == {"generation": 2.0, "total_step_time": 1.0}
    timer.start("refit")  # 11.0
    with pytest.raises(RuntimeError, match="already running"):
        timer.start("refit")
    assert timer.stop("refit") == 0.5
    with pytest.raises(ValueError, match="reduction"):
        timer.get_timing_metrics("median")
    timer.reset()
    assert timer.get_timing_metrics() == {}


def test_progress_bar_postfix_and_plain_lines(capsys):
    bar = ProgressBar(total=10, enabled=True, initial=2)  # stderr is not a TTY under pytest
    bar.update({"train/reward": 0.5, "train/loss": 0.123456, "timing/train/total_step_time": 2.0})
    bar.update({"validation/accuracy": 0.25, "train/reward": 0.75})
    assert bar.postfix() == {"reward": "0.75", "val_acc": "0.25", "loss": "0.1235", "step_s": "2"}
    bar.close()
    assert capsys.readouterr().err.splitlines() == [
        "train step 3/10 reward=0.5 loss=0.1235 step_s=2",
        "train step 4/10 reward=0.75 val_acc=0.25 loss=0.1235 step_s=2",
    ]
    silent = ProgressBar(total=3, enabled=False)
    silent.update({"train/reward": 1.0})
    assert capsys.readouterr().err == ""


def test_resume_purges_tensorboard_points_after_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggerConfig(log_dir=str(tmp_path))
    crashed = Logger(cfg)
    for step in range(1, 6):
        crashed.log_metrics({"x": float(step)}, step)
    crashed.close()
    resumed = Logger(cfg)
    resumed.truncate_after(2)  # as restore_training_state does after loading step 2
    resumed.close()  # even before the resumed run logs anything, steps 3-5 are gone
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(1, 1.0), (2, 2.0)]


def test_validation_samples_go_to_the_console_and_a_tensorboard_table(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    samples = [{"prompt": "12+34=", "response": "46<|end|>", "reward": 1.0},
               {"prompt": "line one\nwhat | now?", "response": "x" * 300, "reward": 0.0}]
    with Logger(LoggerConfig(log_dir=str(tmp_path))) as logger:
        logger.log_samples(samples, step=25)

    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[posttrain] validation/samples at step 25:"
    assert out[1] == "  reward 1.00 | '12+34=' -> '46<|end|>'"
    assert out[2].startswith("  reward 0.00 | 'line one\\nwhat | now?' -> 'xxx") and out[2].endswith("x…'")
    assert len(out) == 3 and len(out[2]) < 200  # short: one line per sample, long responses clipped

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (event,) = events.Tensors("validation/samples/text_summary")  # add_text names the tag so
    table = event.tensor_proto.string_val[0].decode()
    assert event.step == 25
    assert table.splitlines() == [
        "| prompt | response | reward |",
        "|---|---|---|",
        "| 12+34= | 46&lt;\\|end\\|&gt; | 1 |",
        "| line one<br>what \\| now? | " + "x" * 300 + " | 0 |",
    ]


def test_samples_are_shown_by_default():
    assert LoggerConfig().num_val_samples_to_print == 3
