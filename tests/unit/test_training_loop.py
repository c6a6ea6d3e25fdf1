"""The one loop skeleton (`algorithms.loop.TrainingLoop`): validation schedule, checkpoints ranked
by the latest validation, resume of step / history / algorithm state, and the summary line, with a
fake policy and loader (no workers)."""

from __future__ import annotations

import json

import pytest

from posttrain.algorithms import loop as loop_module
from posttrain.algorithms.loop import NO_SIGNAL_STEPS, SIGNAL_METRIC, TrainingLoop, train_offline
from posttrain.config import load_config
from posttrain.utils.logger import read_metrics_jsonl


class FakeLoader:
    def __init__(self):
        self.position = 0

    def next_batch(self):
        self.position += 1
        return [self.position]

    def steps_for_epochs(self, epochs):
        return 10**9

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class FakePolicy:
    """Saves its weights, and an optimizer directory as `PolicyWorker.save_checkpoint` does."""

    def __init__(self):
        self.weights = 0

    def save_checkpoint(self, path, save_optimizer=True):
        path.mkdir(parents=True)
        (path / "weights.json").write_text(json.dumps(self.weights))
        if save_optimizer:
            (path / "optim").mkdir()
            (path / "optim" / ".metadata").write_text("")

    def load_checkpoint(self, path):
        self.weights = json.loads((path / "weights.json").read_text())


def cfg_for(tmp_path, *extra):
    return load_config("sft", overrides=[
        f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
        "logger.tensorboard_enabled=false", "logger.progress_bar=false", "logger.report=false",
        "sft.max_num_steps=5", "sft.val_period=2", "sft.val_at_start=true", "sft.val_at_end=true",
        "checkpointing.save_period=2", "checkpointing.keep_top_k=2", *extra,
    ])


def make_loop(cfg, policy, loader):
    return TrainingLoop(cfg, cfg.sft, name="SFT", section="sft", policy=policy, loader=loader)


def test_schedule_checkpoints_and_resume(tmp_path, capsys):
    cfg = cfg_for(tmp_path)
    policy, loader = FakePolicy(), FakeLoader()
    accuracy = {0: 0.1, 2: 0.9, 4: 0.3, 5: 0.5}  # by step: the best checkpoint is not the last one

    def step_fn(step, timer):
        with timer.time("policy_training"):
            policy.weights += 1
        loop.state["seen"] = loop.state.get("seen", 0) + len(loader.next_batch())
        return {"train/loss": 1.0 / step}

    def validate():
        return {"validation/accuracy": accuracy[loop.step], "validation/loss": 1 - accuracy[loop.step]}

    loop = make_loop(cfg, policy, loader)
    assert loop.resume() is False and loop.step == 0
    loop.run(step_fn, validate)
    loop.finish()
    loop.close()
    out = capsys.readouterr().out
    assert ("SFT finished at step 5" in out and "validation accuracy 10.0% (step 0) -> 50.0% (step 5), "
            "+40.0 percentage points" in out and "validation at step 5: loss 0.5000" in out)

    rows = read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert [s for s in sorted(rows) if "validation/accuracy" in rows[s]] == [0, 2, 4, 5]
    assert "timing/train/policy_training" in rows[1] and "timing/train/total_step_time" in rows[1]
    assert "timing/validation/total_validation_time" in rows[2]
    # Saved at 2, 4 and the last step 5; keep_top_k=2 by the latest validation keeps 2 (0.9) and 5 (0.5).
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_2", "step_5"]

    # A new process resumes: weights, loader position, step, validation history, algorithm state.
    policy2, loader2 = FakePolicy(), FakeLoader()
    loop = make_loop(cfg_for(tmp_path, "sft.max_num_steps=6"), policy2, loader2)
    assert loop.resume() is True
    assert (loop.step, policy2.weights, loader2.position, loop.state) == (5, 5, 5, {"seen": 5})
    assert [s for s, _ in loop.history] == [0, 2, 4, 5] and loop.headline_change() == (0.1, 0.5)
    assert loop.done_message() is None
    accuracy[6] = 0.7
    policy = policy2
    loader = loader2
    loop.run(step_fn, validate)
    loop.close()
    assert loop.step == 6 and loop.state == {"seen": 6}
    info = json.loads((tmp_path / "ckpt" / "step_6" / "training_info.json").read_text())
    assert info["metrics"]["validation/accuracy"] == 0.7 and info["state"] == {"seen": 6}


def test_checkpoint_is_ranked_by_the_latest_validation_even_between_validations(tmp_path):
    cfg = cfg_for(tmp_path, "sft.val_period=3", "sft.val_at_start=false", "sft.max_num_steps=4",
                  "checkpointing.save_period=4")
    policy, loader = FakePolicy(), FakeLoader()
    loop = make_loop(cfg, policy, loader)
    loop.run(lambda step, timer: {}, lambda: {"validation/accuracy": 0.25 * loop.step})
    loop.close()
    info = json.loads((tmp_path / "ckpt" / "step_4" / "training_info.json").read_text())
    assert info["metrics"] == {"validation/accuracy": 1.0}  # val_at_end at step 4


def test_without_validation_data_and_the_offline_runner(tmp_path, capsys):
    cfg = cfg_for(tmp_path, "checkpointing.enabled=false")
    batches = []

    def train_step(datums, timer):
        batches.append(datums)
        return {"loss": 0.5}

    metrics = train_offline(cfg, cfg.sft, name="SFT", section="sft", policy=FakePolicy(), loader=FakeLoader(),
                            train_step=train_step, validate=dict)
    assert batches == [[1], [2], [3], [4], [5]] and metrics["train/loss"] == 0.5
    assert "SFT finished at step 5" in capsys.readouterr().out and not (tmp_path / "ckpt").exists()
    assert "no validation" in make_loop(cfg, FakePolicy(), FakeLoader()).summary()


def test_resumed_at_the_last_step_trains_nothing(tmp_path, capsys):
    cfg = cfg_for(tmp_path, "sft.max_num_steps=2", "sft.val_at_start=false")
    loop = make_loop(cfg, FakePolicy(), FakeLoader())
    loop.run(lambda step, timer: {}, dict)
    loop.close()
    loop = make_loop(cfg, FakePolicy(), FakeLoader())
    assert loop.resume() and "this run is complete" in loop.done_message()


def test_save_optimizer_false_checkpoints_without_optimizer_state(tmp_path, capsys):
    """`checkpointing.save_optimizer` reaches the policy's save (it was never read before), and a
    resume from such a checkpoint says its optimizer starts afresh."""
    for save_optimizer in ("true", "false"):
        cfg = cfg_for(tmp_path / save_optimizer, "sft.max_num_steps=2", "sft.val_at_start=false",
                      f"checkpointing.save_optimizer={save_optimizer}")
        loop = make_loop(cfg, FakePolicy(), FakeLoader())
        loop.run(lambda step, timer: {}, dict)
        loop.close()
        policy_dir = tmp_path / save_optimizer / "ckpt" / "step_2" / "policy"
        assert (policy_dir / "optim").exists() == (save_optimizer == "true")
        capsys.readouterr()
        resumed = make_loop(cfg, FakePolicy(), FakeLoader())
        assert resumed.resume()
        resumed.close()
        notice = "the checkpoint has no optimizer state (saved with checkpointing.save_optimizer=false)"
        assert (notice in capsys.readouterr().out) == (save_optimizer == "false")


def test_summary_of_a_reward_that_is_not_a_fraction(tmp_path):
    """A reward model's mean score is the 'accuracy' of GRPO's validation: no percentages then."""
    loop = make_loop(cfg_for(tmp_path), FakePolicy(), FakeLoader())
    loop.history = [(0, {"validation/accuracy": 2.418}), (40, {"validation/accuracy": 2.494})]
    assert loop.summary() == "validation accuracy 2.4180 (step 0) -> 2.4940 (step 40), +0.0760"
    loop.history = [(0, {"validation/accuracy": 0.25}), (40, {"validation/accuracy": 0.5})]
    assert loop.summary() == "validation accuracy 25.0% (step 0) -> 50.0% (step 40), +25.0 percentage points"
    loop.close()


def test_a_generation_accuracy_is_the_headline_under_its_own_name(tmp_path, capsys):
    """GRPO, SFT and distillation log `validation/accuracy_greedy` (or `_sampled`); the summary and
    the ranking of checkpoints (metric_name `validation/accuracy`) follow it."""
    cfg = cfg_for(tmp_path, "sft.max_num_steps=4", "checkpointing.keep_top_k=1",
                  "checkpointing.metric_name=validation/accuracy", "checkpointing.higher_is_better=true")
    loop = make_loop(cfg, FakePolicy(), FakeLoader())
    accuracy = {0: 0.25, 2: 0.75, 4: 0.5}
    loop.run(lambda step, timer: {}, lambda: {"validation/accuracy_greedy": accuracy[loop.step]})
    loop.finish()
    loop.close()
    assert loop.headline_change() == (0.25, 0.5)
    assert "validation accuracy (greedy) 25.0% (step 0) -> 50.0% (step 4), +25.0 percentage points" in (
        capsys.readouterr().out)
    # keep_top_k=1 keeps the best by the greedy accuracy (step 2) and the latest.
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_2", "step_4"]


def test_the_summary_names_the_validation_loss(tmp_path):
    """DPO's and RM's closing line shows the validation loss, not the training loss of the step lines."""
    loop = make_loop(cfg_for(tmp_path), FakePolicy(), FakeLoader())
    loop.history = [(0, {"validation/accuracy": 0.5, "validation/loss": 0.69}),
                    (60, {"validation/accuracy": 0.9, "validation/loss": 0.2})]
    assert loop.summary() == ("validation accuracy 50.0% (step 0) -> 90.0% (step 60), +40.0 percentage points; "
                              "validation at step 60: loss 0.2000")
    loop.close()


def test_config_is_saved_once_a_step_is_trained(tmp_path):
    cfg = cfg_for(tmp_path, "sft.max_num_steps=2", "sft.val_at_start=false")
    loop = make_loop(cfg, FakePolicy(), FakeLoader())

    def step_fn(step, timer):
        saved = [(tmp_path / d / "config.yaml").exists() for d in ("logs", "ckpt")]
        assert saved == ([False, False] if step == 1 else [True, True])  # saved after the first step
        return {}

    loop.run(step_fn, dict)
    loop.close()
    for directory in ("logs", "ckpt"):
        assert "max_num_steps: 2" in (tmp_path / directory / "config.yaml").read_text()


def test_an_interrupt_says_where_a_rerun_resumes(tmp_path):
    cfg = cfg_for(tmp_path, "sft.val_at_start=false", "sft.max_num_steps=9")

    def step_fn(step, timer):
        if step == 4:
            raise KeyboardInterrupt
        return {}

    loop = make_loop(cfg, FakePolicy(), FakeLoader())
    with pytest.raises(KeyboardInterrupt) as info:
        loop.run(step_fn, dict)
    loop.close()
    assert info.value.args == (f"SFT stopped after step 3; a rerun of the same command resumes from step 2 "
                               f"({tmp_path / 'ckpt' / 'step_2'})",)

    # Before the first checkpoint, and without checkpoints: a rerun starts again.
    for extra, expected in (("checkpointing.save_period=5", "before its first checkpoint (checkpointing.save_period=5)"),
                            ("checkpointing.enabled=false", "checkpointing.enabled=false: a rerun starts again")):
        loop = make_loop(cfg_for(tmp_path / extra, "sft.val_at_start=false", "sft.max_num_steps=9", extra),
                         FakePolicy(), FakeLoader())
        with pytest.raises(KeyboardInterrupt) as info:
            loop.run(step_fn, dict)
        loop.close()
        assert expected in info.value.args[0] and "at step 1" in info.value.args[0]


def test_cli_prints_where_a_rerun_resumes(monkeypatch, capsys):
    from posttrain import cli

    def interrupted(cfg):
        raise KeyboardInterrupt("SFT stopped after step 3; a rerun of the same command resumes from step 2 (c/step_2)")

    monkeypatch.setattr("posttrain.algorithms.sft.run", interrupted)
    monkeypatch.setattr("posttrain.preflight.preflight", lambda cfg: None)
    assert cli.main(["sft", "sft.max_num_steps=3"]) == 130
    assert capsys.readouterr().err.strip().endswith(
        "posttrain: interrupted: SFT stopped after step 3; a rerun of the same command resumes from step 2 (c/step_2)")


def test_no_learning_signal_is_warned_once(tmp_path, capsys):
    """GRPO logs the share of prompt groups whose rewards differ; NO_SIGNAL_STEPS steps in a row
    without any warn once (a step with signal starts the count again)."""
    steps = 2 * NO_SIGNAL_STEPS + 5
    shares = {NO_SIGNAL_STEPS // 2: 0.25}  # one step with signal early on; every other step has none
    cfg = cfg_for(tmp_path, f"sft.max_num_steps={steps}", "sft.val_at_start=false", "sft.val_period=0",
                  "checkpointing.enabled=false")
    loop = make_loop(cfg, FakePolicy(), FakeLoader())
    loop.run(lambda step, timer: {SIGNAL_METRIC: shares.get(step, 0.0), "train/reward": 0.0}, dict)
    loop.close()
    warnings = [line for line in capsys.readouterr().out.splitlines() if "no learning signal" in line]
    assert len(warnings) == 1
    assert f"for {NO_SIGNAL_STEPS} steps (to step {NO_SIGNAL_STEPS // 2 + NO_SIGNAL_STEPS})" in warnings[0]
    assert "train/reward 0" in warnings[0]


def test_the_startup_line_is_written_above_the_progress_bar(tmp_path, monkeypatch):
    """A plain print would land inside a drawn tqdm bar: the loop writes through the bar."""
    written = []
    monkeypatch.setattr(loop_module.ProgressBar, "write", lambda self, line: written.append(line), raising=False)
    monkeypatch.setattr(loop_module.startup.CLOCK, "report", lambda seconds: {"config": 0.5, "first_step": seconds})
    monkeypatch.setattr(loop_module.startup, "summary_line", lambda phases: "[posttrain] started in 0.5s")
    cfg = cfg_for(tmp_path, "sft.max_num_steps=1", "sft.val_at_start=false", "logger.progress_bar=true")
    loop = make_loop(cfg, FakePolicy(), FakeLoader())
    loop.run(lambda step, timer: {}, dict)
    loop.close()
    assert written == ["[posttrain] started in 0.5s"]


def test_step_callbacks_see_each_step_and_can_stop_the_run(tmp_path, capsys):
    """A callback registered for the loop's section gets every step's metrics; one returning True
    stops the run after that step, which is checkpointed (save_period 2 would not save step 3) so a
    rerun resumes from it. Callbacks of another section (a warm start's) are not called."""
    cfg = cfg_for(tmp_path)
    policy, loader = FakePolicy(), FakeLoader()
    seen, other = [], []

    class StopAtThree:
        def on_step_end(self, step, metrics):
            seen.append((step, metrics["train/loss"], "validation/accuracy" in metrics))
            return step == 3

    def step_fn(step, timer):
        policy.weights += 1
        return {"train/loss": float(step)}

    loop = make_loop(cfg, policy, loader)
    with loop_module.step_callbacks([StopAtThree(), lambda step, metrics: None], section="sft"), \
            loop_module.step_callbacks([lambda step, metrics: other.append(step) or True], section="grpo"):
        loop.run(step_fn, lambda: {"validation/accuracy": 0.5})
    assert seen == [(1, 1.0, False), (2, 2.0, True), (3, 3.0, False)] and other == []
    assert loop.step == 3 and policy.weights == 3
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_2", "step_3"]
    assert "SFT stopped after step 3: a step callback asked to stop" in capsys.readouterr().out
    assert loop_module._STEP_CALLBACKS == []  # unregistered on leaving

    resumed = make_loop(cfg, FakePolicy(), FakeLoader())
    assert resumed.resume() and resumed.step == 3
    resumed.run(step_fn, lambda: {})
    assert resumed.step == 5  # without the callback the run goes on to sft.max_num_steps


def test_stop_at_validation_ends_the_run_at_the_first_validation_at_its_targets(tmp_path, capsys):
    """Validations at steps 2, 4, 6...: accuracy 0.3, 0.6 (at the target, loss not yet), 0.7 with
    the loss at its target: the run stops at step 6 of 10, checkpointed there though save_period
    is 4, and a rerun of the same command trains nothing."""
    targets = "sft.stop_at_validation={validation/accuracy: 0.6, validation/score: 0.5}"
    cfg = cfg_for(tmp_path, "sft.max_num_steps=10", "sft.val_at_start=false", "checkpointing.save_period=4",
                  targets)
    accuracy = {2: 0.3, 4: 0.6, 6: 0.7, 8: 0.9}
    score = {2: 0.1, 4: 0.4, 6: 0.5, 8: 0.9}
    trained = []

    def validate():
        return {"validation/accuracy": accuracy[loop.step], "validation/score": score[loop.step]}

    loop = make_loop(cfg, FakePolicy(), FakeLoader())
    loop.run(lambda step, timer: trained.append(step) or {}, validate)
    loop.close()
    assert trained == [1, 2, 3, 4, 5, 6] and loop.step == 6
    assert ("SFT reached sft.stop_at_validation at step 6 (validation/accuracy 0.7 >= 0.6, validation/score 0.5 "
            ">= 0.5): stopping") in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_4", "step_6"]
    assert sorted(read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl")) == [1, 2, 3, 4, 5, 6]
    rerun = make_loop(cfg, FakePolicy(), FakeLoader())
    assert rerun.resume() and rerun.step == 6
    assert rerun.done_message().startswith("[posttrain] the checkpoint is at step 6, where the run reached "
                                           "sft.stop_at_validation: this run is complete")


def test_stop_at_validation_naming_a_metric_the_validation_lacks_is_refused_in_one_line(tmp_path):
    from posttrain.errors import UserError

    cfg = cfg_for(tmp_path, "sft.val_at_start=false", "sft.stop_at_validation={validation/accuracy_greedy: 0.5}")
    loop = make_loop(cfg, FakePolicy(), FakeLoader())
    with pytest.raises(UserError) as refused:
        loop.run(lambda step, timer: {}, lambda: {"validation/accuracy": 0.9, "validation/loss": 0.1})
    assert str(refused.value) == ("sft.stop_at_validation names validation/accuracy_greedy, which this run's "
                                  "validation does not report; it reports: validation/accuracy, validation/loss")
    assert loop.step == 2  # the first validation


@pytest.mark.parametrize("override, problem", [
    ("sft.stop_at_validation={accuracy: 0.5}", "stop_at_validation names 'accuracy', not a validation metric"),
    ("sft.val_period=0", "stop_at_validation is checked at each validation, and val_period=0 validates only"),
])
def test_stop_at_validation_config_mistakes(tmp_path, override, problem):
    from posttrain.errors import UserError

    with pytest.raises(UserError, match=problem):
        cfg_for(tmp_path, "sft.stop_at_validation={validation/accuracy: 0.5}", override)
