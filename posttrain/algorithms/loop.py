"""The one training-loop skeleton every algorithm runs (GRPO, SFT, DPO, RM, distillation).

An algorithm supplies a step function and a validation function; `TrainingLoop` owns the rest,
identically for all of them: resume from the latest checkpoint, the validation schedule
(`val_at_start`, every `val_period` steps, `val_at_end`), logging (metrics.jsonl, TensorBoard,
trackers), the progress bar, checkpoints (every `checkpointing.save_period` steps and at the last
step, ranked by the most recent validation), `report.png` and the closing summary line. Given a
recovery (`run_recovery.RunRecovery`), a step that failed because a worker died is replayed: the
loop only sees "replay this step" or "go back to the last checkpoint" and the restart counts.

    loop = TrainingLoop(cfg, cfg.sft, name="SFT", section="sft", policy=policy, loader=loader)
    loop.resume()
    loop.run(step_fn, validate_fn)   # step_fn(step, timer) -> metrics with full names; recovery=... optional
    loop.finish()
    loop.close()

`train_offline` is that sequence for the trainers on a fixed data set.

Step callbacks (`step_callbacks`, used by the Python API's `callbacks=`) see every training step
of the loops of one section; one returning True stops the run after that step.
"""

from __future__ import annotations

import copy
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from posttrain.distributed.recovery import Replay
from posttrain.errors import UserError
from posttrain.utils import startup
from posttrain.utils.checkpoint import CheckpointManager, complete_checkpoints
from posttrain.utils.logger import Logger, ProgressBar
from posttrain.utils.memory import peak_rss_bytes
from posttrain.utils.metric_names import find_accuracy
from posttrain.utils.timer import Timer

LOADER_STATE_FILE = "dataloader.json"
# The share of a step's prompt groups whose rewards differ (GRPO): a group whose rewards all agree
# has zero advantages and teaches nothing. After this many steps in a row without any, the loop
# warns that the run has no learning signal.
SIGNAL_METRIC = "train/groups_with_reward_variance"
NO_SIGNAL_STEPS = 10
# The step at which a run reached its `stop_at_validation` targets, in the loop's saved `state`.
TARGET_REACHED_STATE = "stopped_at_validation_target"

StepFn = Callable[[int, Timer], dict[str, float]]
ValidateFn = Callable[[], dict[str, float]]


def prefixed(metrics: dict, prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()}


# (section, callbacks) registered by `step_callbacks`: this process's loops of that section call them.
_STEP_CALLBACKS: list[tuple[str, Sequence[Any]]] = []


@contextmanager
def step_callbacks(callbacks: Sequence[Any], section: str) -> Iterator[None]:
    """While inside, every `TrainingLoop` of `section` (e.g. "grpo", not its SFT warm start's
    "sft") calls each callback after each training step is logged and checkpointed:
    `callback.on_step_end(step, metrics)`, or `callback(step, metrics)` for a plain function, with
    the step's metrics (`train/...`, `validation/...` when it validated, `timing/...`). A callback
    returning True stops the run after that step: it is checkpointed (when checkpointing is on)
    and the run ends as at its last step; a rerun resumes from there."""
    entry = (section, list(callbacks))
    _STEP_CALLBACKS.append(entry)
    try:
        yield
    finally:
        _STEP_CALLBACKS.remove(entry)


def _call_step_callbacks(section: str, step: int, metrics: dict[str, float]) -> bool:
    """Whether a callback registered for `section` asked to stop after `step`. Every callback is
    called, also after one asked to stop."""
    stop = False
    for registered, callbacks in _STEP_CALLBACKS:
        if registered != section:
            continue
        for callback in callbacks:
            on_step_end = getattr(callback, "on_step_end", callback)
            stop = bool(on_step_end(step, dict(metrics))) or stop
    return stop


class TrainingLoop:
    """Resume, schedule, log, checkpoint and report one run.

    Args:
        cfg: the master config (`logger` and `checkpointing` are read).
        schedule: the algorithm's section (`grpo`, `sft`, ...): `max_num_steps`, `max_num_epochs`
            (the run stops at whichever comes first), `val_period`, `val_at_start`, `val_at_end`,
            `stop_at_validation`.
        name: how the run is called in its progress bar and summary ("GRPO", "SFT", ...).
        section: the section's key, named by messages (`<section>.max_num_steps`).
        policy: the `Policy` being trained (checkpointed with the loader position).
        loader: the `ResumableLoader` the steps draw from.
        headline: the validation metric the summary reports from the first to the last validation
            (default None: the run's accuracy, `validation/accuracy_greedy`, `_sampled` or DPO's and
            RM's `validation/accuracy`, see `posttrain.utils.metric_names`).
    """

    def __init__(self, cfg: Any, schedule: Any, *, name: str, section: str, policy: Any, loader: Any,
                 headline: Optional[str] = None):
        self.cfg, self.schedule, self.name, self.section = cfg, schedule, name, section
        self.policy, self.loader, self.headline = policy, loader, headline
        with startup.doing("opening the run's logs"):  # TensorBoard and trackers (wandb, mlflow) take seconds
            self.logger = Logger(cfg.logger)
            self.logger.log_hyperparams(cfg.model_dump(mode="json"))
        self.checkpointer = CheckpointManager(cfg.checkpointing)
        self.step = 0  # completed training steps
        self.history: list[tuple[int, dict[str, float]]] = []  # (step, validation metrics) of each validation
        self.state: dict[str, Any] = {}  # the algorithm's own resume state, saved with each checkpoint
        # What a checkpoint saves beside the policy, taken together: (loader state, {file name:
        # object for torch.save}). Async GRPO's collector draws prompts ahead of training, so its
        # loader position and replay buffer must come from one snapshot.
        self.checkpoint_extras: Callable[[], tuple[dict, dict[str, Any]]] = lambda: (self.loader.state_dict(), {})
        # Worker groups trained beside the policy (PPO's critic): each is saved and resumed like the
        # policy, under `step_N/<name>/`.
        self.trained_beside: dict[str, Any] = {}
        # For a run with a recovery, what the algorithm keeps beside the loop: `replay_extras`
        # (take, put back) is what a step changes beyond the loader position and `state` (partial
        # rollouts' carry-over), taken before each step and put back before its replay;
        # `on_failure()` runs when a step, validation or checkpoint failed, before anything is
        # rebuilt (async GRPO stops its collector, which draws prompts and calls the workers);
        # `on_rewind(checkpoint)` runs once the loop went back to `checkpoint` (None: the start),
        # to restore what `checkpoint_extras` saved beside it.
        self.replay_extras: Optional[tuple[Callable[[], Any], Callable[[Any], None]]] = None
        self.on_failure: Callable[[], None] = lambda: None
        self.on_rewind: Callable[[Optional[Path]], None] = lambda checkpoint: None
        self.started = time.perf_counter()
        self._start_loader_state: Optional[dict] = None  # where `rewind` goes without a checkpoint (`run`)
        self.config_saved = False  # the run's config is saved once it has trained a step
        self.recovery: Any = None  # the recovery `run` was given (its failures go into the summary)
        self.steps_without_signal = 0  # consecutive steps whose groups all had uniform rewards

    @property
    def last_step(self) -> int:
        """`max_num_steps`, or fewer when `max_num_epochs` passes over the data end first."""
        s = self.schedule
        return min(s.max_num_steps, self.loader.steps_for_epochs(s.max_num_epochs))

    # ------------------------------------------------------------------------------ resume
    def resume(self) -> bool:
        """Restore the latest complete checkpoint (policy and the models `trained_beside` it, loader
        position, step, validation history, `state`) when `checkpointing.enabled`; True when there was one."""
        if not self.cfg.checkpointing.enabled:
            return False
        latest = self.checkpointer.latest()
        if latest is None:
            self.logger.truncate_after(-1)  # a fresh start: forget metrics of a run that never checkpointed
            return False
        with startup.doing(f"loading the checkpoint {latest}"):
            info = self.checkpointer.load_training_info(latest)
            self.policy.load_checkpoint(latest / "policy")
            for name, model in self.trained_beside.items():
                if not (latest / name).is_dir():
                    raise UserError(f"checkpoint {latest} has no {name}/ to resume the {name} from (it was saved by "
                                    f"a run without one); use another checkpointing.checkpoint_dir")
                model.load_checkpoint(latest / name)
        loader_state = latest / LOADER_STATE_FILE
        if loader_state.exists():
            self.loader.load_state_dict(json.loads(loader_state.read_text()))
        self.step = int(info["step"])
        self.history = [(int(step), dict(metrics)) for step, metrics in info.get("val_history", [])]
        self.state = dict(info.get("state", {}))
        self.logger.truncate_after(self.step)
        print(f"[posttrain] resumed from {latest} (step {self.step})", flush=True)
        from posttrain.models.policy.checkpoint import has_optimizer_state

        if not has_optimizer_state(latest / "policy"):
            print("[posttrain] the checkpoint has no optimizer state (saved with checkpointing.save_optimizer=false): "
                  "the optimizer starts afresh, the learning-rate schedule goes on", flush=True)
        return True

    def rewind(self) -> None:
        """Go back to the latest complete checkpoint (`resume`), or to the very start when there is
        none yet: in this process, what a rerun of the command would do (after the policy workers
        were rebuilt). The start keeps the validation before the first step (`val_at_start`): it
        measured the initial weights, which the rebuilt groups start from again, and it is the
        run's "before"."""
        latest = self.checkpointer.latest() if self.cfg.checkpointing.enabled else None
        if latest is not None:
            self.resume()
        else:
            self.step, self.state = 0, {}
            self.history = [(step, metrics) for step, metrics in self.history if step == 0]
            self.logger.truncate_after(0)
            self.loader.load_state_dict(copy.deepcopy(self._start_loader_state))
            print("[posttrain] no checkpoint yet: starting again at step 1", flush=True)
        self.on_rewind(latest)

    def keep_start_position(self) -> None:
        """Remember the loader's position as where `rewind` goes without a checkpoint (`run` does
        it; async GRPO before its collector starts drawing)."""
        if self._start_loader_state is None:
            self._start_loader_state = copy.deepcopy(self.loader.state_dict())

    def done_message(self) -> Optional[str]:
        """What to say when a resumed run is already at or past its last step, or stopped at its
        validation target (else None)."""
        from posttrain.utils.run_dirs import already_done_message

        if not self.step:
            return None
        if TARGET_REACHED_STATE in self.state:
            return (f"[posttrain] the checkpoint is at step {self.step}, where the run reached "
                    f"{self.section}.stop_at_validation: this run is complete, nothing to train; set another "
                    f"logger.log_dir and checkpointing.checkpoint_dir to train a new run")
        return already_done_message(self.step, self.last_step, f"{self.section}.max_num_steps")

    # ------------------------------------------------------------------------------ the loop
    def run(self, step_fn: StepFn, validate_fn: ValidateFn, recovery: Any = None) -> dict[str, float]:
        """Train from `self.step` to `last_step`; returns the last step's metrics (empty when
        there was nothing left to train).

        `step_fn(step, timer)` runs one training step and returns its metrics with full names
        (`train/...`); the parts it times with `timer` are logged as `timing/train/<part>` beside
        `timing/train/total_step_time`. `validate_fn()` returns `validation/...` metrics, or an
        empty dict when there is no validation data. `recovery` (default None: a failure ends the
        run) rebuilds dead workers (`run_recovery.RunRecovery.recover`); the failed step is then
        replayed with the prompts it drew, or the run goes back to its last checkpoint, and every
        logged step carries the restart counts (`recovery/restarts`, `recovery/restarts/<kind>`).
        """
        s = self.schedule
        self.recovery = recovery
        if recovery is not None:
            self.keep_start_position()
        if self.step == 0 and s.val_at_start:
            startup.mark("other")  # so the start-up line shows validation as its own phase
            with startup.phase("validation", "validating before the first step"):
                metrics = self._validate_recovering(validate_fn, recovery)
            if metrics:
                self.logger.log_metrics(metrics, 0)
        bar = ProgressBar(total=self.last_step, initial=self.step, enabled=self.cfg.logger.progress_bar,
                          desc=self.name)
        metrics: dict[str, float] = {}
        if self.step < self.last_step:
            startup.begin(f"running {self.name} step {self.step + 1}")  # off a terminal there is no bar until it ends
        try:
            while self.step < self.last_step:
                bar.go_to(self.step)  # a recovery may have sent the run back to its last checkpoint
                step, timer = self.step + 1, Timer()
                before = self._snapshot() if recovery is not None else None
                try:
                    with timer.time("total_step_time"):
                        metrics = dict(step_fn(step, timer))
                except Exception as error:
                    self._recover(recovery, error, f"step {step}", before)  # raises what it cannot recover from
                    continue
                self.step = step
                if not self.config_saved:
                    self._save_config()
                metrics.update(prefixed(timer.get_timing_metrics(), "timing/train"))
                # This process's high-water mark: with the local backend the whole job's peak memory.
                metrics["memory/controller_peak_rss_gib"] = peak_rss_bytes() / 2**30
                metrics.update(self._startup_metrics(metrics["timing/train/total_step_time"], bar))
                self._watch_learning_signal(metrics, bar)
                reached = None
                if (s.val_period > 0 and step % s.val_period == 0) or (s.val_at_end and step == self.last_step):
                    validation = self._validate_recovering(validate_fn, recovery)
                    if validation is None:
                        continue  # the policy was rebuilt: the run went back to its last checkpoint
                    metrics.update(validation)
                    reached = self._reached_targets(validation)
                    if reached:  # saved with the checkpoint: a rerun then knows the run is complete
                        self.state[TARGET_REACHED_STATE] = step
                records = {}
                if recovery is not None:
                    metrics.update(recovery.metrics())
                    records = recovery.records()
                self.logger.log_metrics(metrics, step, records=records)
                saving = self.checkpointer.should_save(step, is_last_step=step == self.last_step or bool(reached))
                if saving and not self._save_recovering(recovery):
                    continue
                bar.update(metrics)
                if reached:
                    bar.write(f"[posttrain] {self.name} reached {self.section}.stop_at_validation at step {step} "
                              f"({reached}): stopping")
                    break
                if _STEP_CALLBACKS and _call_step_callbacks(self.section, step, metrics):
                    if self.cfg.checkpointing.enabled and not saving:
                        self.save()  # where a rerun resumes
                    bar.write(f"[posttrain] {self.name} stopped after step {step}: a step callback asked to stop")
                    break
        except KeyboardInterrupt as interrupt:
            bar.close()
            if not interrupt.args:  # the innermost loop (a warm start's) says where its rerun resumes
                interrupt.args = (self.resume_point(),)
            raise
        finally:
            startup.end()  # the first step's, if it failed
        bar.close()
        return metrics

    # ------------------------------------------------------------------------------ recovery
    def _snapshot(self) -> tuple:
        """What a step changes in the loop, taken before it (for a replay), and the counts of
        updates of the policy and the models trained beside it (`Policy.updates`), to tell whether
        the step failed after training."""
        extras = self.replay_extras[0]() if self.replay_extras is not None else None
        return (copy.deepcopy(self.loader.state_dict()), copy.deepcopy(self.state), len(self.history),
                self._updates(), extras)

    def _updates(self) -> tuple:
        """The update counts of the policy and the models `trained_beside` it (None: not counted)."""
        return tuple(getattr(model, "updates", None) for model in (self.policy, *self.trained_beside.values()))

    def _recover(self, recovery: Any, error: Exception, what: str, before: Optional[tuple]) -> Replay:
        """Recover from `error`, raised by `what` ("step 3"), and put the loop where the replay
        starts: before it (`before`, the step's snapshot) or at the last checkpoint. Raises `error`
        when there is no recovery or nothing to recover (a bug, a NaN loss: no worker died)."""
        if recovery is None:
            raise error
        trained = before is not None and self._updates() != before[3]
        self.on_failure()
        replay = recovery.recover(error, what, trained=trained)
        if replay is None:
            raise error
        if replay is Replay.FROM_CHECKPOINT:
            self.rewind()
        elif before is not None:
            loader_state, state, validations, _, extras = before
            self.loader.load_state_dict(loader_state)
            self.state, self.history = state, self.history[:validations]
            if self.replay_extras is not None:
                self.replay_extras[1](extras)
        return replay

    def _validate_recovering(self, validate_fn: ValidateFn, recovery: Any) -> Optional[dict[str, float]]:
        """`validate`, again after each recovered failure; None when the recovery sent the run back
        to its last checkpoint (the caller goes on from there)."""
        while True:
            try:
                return self.validate(validate_fn)
            except Exception as error:
                if self._recover(recovery, error, f"the validation at step {self.step}", None) is Replay.FROM_CHECKPOINT:
                    return None

    def _save_recovering(self, recovery: Any) -> bool:
        """`save`; False when a policy worker died in it and the run went back to its last
        checkpoint (a half-written checkpoint is never found: `CheckpointManager`)."""
        try:
            self.save()
        except Exception as error:
            if self._recover(recovery, error, f"the checkpoint of step {self.step}", None) is Replay.FROM_CHECKPOINT:
                return False
            self.save()  # only a policy takes part in a save; a failure elsewhere leaves it to do
        return True

    def _save_config(self) -> None:
        from posttrain.utils.run_dirs import save_run_config

        save_run_config(self.cfg)
        self.config_saved = True

    def resume_point(self) -> str:
        """Where a rerun of the same command resumes this run, in words (for an interrupt)."""
        where = f"{self.name} stopped after step {self.step}"
        if not self.cfg.checkpointing.enabled:
            return f"{where}; checkpointing.enabled=false: a rerun starts again at step 1"
        found = complete_checkpoints(self.checkpointer.checkpoint_dir)
        if not found:
            return (f"{where}, before its first checkpoint (checkpointing.save_period="
                    f"{self.cfg.checkpointing.save_period}): a rerun starts again at step 1")
        step, path = found[-1]
        return f"{where}; a rerun of the same command resumes from step {step} ({path})"

    def _startup_metrics(self, step_seconds: float, bar: Optional[ProgressBar] = None) -> dict[str, float]:
        """After this process's first training step: where the start-up went (`timing/startup/*`),
        printed as one line as well (above the progress bar)."""
        phases = startup.CLOCK.report(step_seconds)
        if phases is None:
            return {}
        (bar.write if bar is not None else print)(startup.summary_line(phases))
        return prefixed(phases, "timing/startup")

    def _watch_learning_signal(self, metrics: dict[str, float], bar: Optional[ProgressBar] = None) -> None:
        """Warn once `NO_SIGNAL_STEPS` steps in a row had no prompt group with differing rewards
        (`SIGNAL_METRIC`): every advantage is then zero and the policy does not learn."""
        share = metrics.get(SIGNAL_METRIC)
        if share is None:
            return
        self.steps_without_signal = 0 if share > 0 else self.steps_without_signal + 1
        if self.steps_without_signal == NO_SIGNAL_STEPS:
            reward = metrics.get("train/reward")
            rewards = f" (train/reward {reward:.4g})" if reward is not None else ""
            (bar.write if bar is not None else print)(
                f"[posttrain] WARNING: no learning signal: for {NO_SIGNAL_STEPS} steps (to step {self.step}) every "
                f"prompt's samples got the same reward{rewards}, so every advantage is 0 and the policy does not "
                f"change; check that the environment can reward this model's answers (answer format, "
                f"max_new_tokens), warm-start it (sft_warmup) or raise grpo.num_generations_per_prompt")

    def _reached_targets(self, validation: dict[str, float]) -> Optional[str]:
        """`stop_at_validation`'s targets, all at or above their values in `validation`, in words;
        None when one is not (or there are none). A target the validation does not report is a
        mistake in its name: refused in one line, naming the metrics it does report."""
        targets = self.schedule.stop_at_validation
        if not targets or not validation:  # none set, or no validation data
            return None
        missing = sorted(name for name in targets if name not in validation)
        if missing:
            reported = ", ".join(sorted(k for k in validation if k.startswith("validation/")))
            raise UserError(f"{self.section}.stop_at_validation names {', '.join(missing)}, which this run's "
                            f"validation does not report; it reports: {reported}")
        if all(validation[name] >= value for name, value in targets.items()):
            return ", ".join(f"{name} {validation[name]:.4g} >= {value:g}" for name, value in targets.items())
        return None

    def validate(self, validate_fn: ValidateFn) -> dict[str, float]:
        """Run `validate_fn` at the current step, time it and record it in the history."""
        t0 = time.perf_counter()
        metrics = dict(validate_fn())
        if not metrics:
            return {}
        metrics["timing/validation/total_validation_time"] = time.perf_counter() - t0
        self.history.append((self.step, {k: v for k, v in metrics.items() if k.startswith("validation/")}))
        return metrics

    def log_samples(self, samples: list[dict]) -> None:
        """A validation's sample completions (`{"prompt", "response", "reward"}`), at the current
        step: on the console and as a TensorBoard text table (`Logger.log_samples`)."""
        self.logger.log_samples(samples, self.step)

    def save(self) -> Path:
        """Write `step_N/` atomically: policy (weights, optimizer unless
        `checkpointing.save_optimizer=false`, RNG) and the models `trained_beside` it, loader position (and the
        files of `checkpoint_extras`), validation history and `state`; ranked for `keep_top_k` by the most recent validation."""
        ranking = self.history[-1][1] if self.history else {}
        tmp = self.checkpointer.begin(self.step)
        self.policy.save_checkpoint(tmp / "policy", save_optimizer=self.cfg.checkpointing.save_optimizer)
        for name, model in self.trained_beside.items():
            model.save_checkpoint(tmp / name, save_optimizer=self.cfg.checkpointing.save_optimizer)
        loader_state, files = self.checkpoint_extras()
        (tmp / LOADER_STATE_FILE).write_text(json.dumps(loader_state))
        for name, obj in files.items():
            import torch

            torch.save(obj, tmp / name)
        info = {"val_history": self.history, "state": self.state}
        if not self.config_saved:  # a step was trained; the config the checkpoint was made with
            self._save_config()
        return self.checkpointer.finalize(self.step, tmp, ranking, info)

    # ------------------------------------------------------------------------------ the end
    def headline_name(self) -> Optional[str]:
        """The `headline` given, else the accuracy the validations reported (None without one)."""
        if self.headline is not None:
            return self.headline
        return next((name for _, m in self.history for name in [find_accuracy(m)] if name is not None), None)

    def headline_change(self) -> tuple[Optional[float], Optional[float]]:
        """The headline metric at the first and at the last validation that reported it."""
        headline = self.headline_name()
        values = [m[headline] for _, m in self.history if headline in m]
        return (values[0], values[-1]) if values else (None, None)

    def finish(self, details: str = "") -> None:
        """Write `report.png` (when `logger.report`) and print the run's summary line; `details`
        (the algorithm's own results) is added to it."""
        log_dir = Path(self.cfg.logger.log_dir)
        if self.cfg.logger.report and (log_dir / "metrics.jsonl").exists():
            from posttrain.utils.report import write_report

            write_report(log_dir / "metrics.jsonl", log_dir / "report.png")
        seconds = time.perf_counter() - self.started
        print(f"[posttrain] {self.name} finished at step {self.step} in {seconds:.0f}s: "
              f"{self.summary()}{details}{self._recoveries()}; logs in {log_dir}", flush=True)

    def _recoveries(self) -> str:
        """The run's recoveries in words, for the summary ("" without any)."""
        budget = getattr(self.recovery, "budget", None)
        if budget is None or not budget.total:
            return ""
        return (f"; recovered {budget.total} time(s) (cluster.max_restarts={budget.max_restarts}; each failure in "
                f"metrics.jsonl as recovery/failures)")

    def summary(self) -> str:
        """The validation results in words: the headline's change from the first to the last
        validation, and the other metrics of the last one."""
        if not self.history:
            return "no validation"
        (first_step, first), (last_step, last) = self.history[0], self.history[-1]
        headline = self.headline_name()
        parts = []
        if headline in last and headline in first and first_step != last_step:
            before, after = first[headline], last[headline]
            as_fraction = _is_fraction(headline, before) and _is_fraction(headline, after)
            change = f"{100 * (after - before):+.1f} percentage points" if as_fraction else f"{after - before:+.4f}"
            parts.append(f"validation {_label(headline)} {_fmt(headline, before, as_fraction)} (step {first_step}) "
                         f"-> {_fmt(headline, after, as_fraction)} (step {last_step}), {change}")
        others = ", ".join(f"{_label(k)} {_fmt(k, v)}" for k, v in last.items()
                           if not (parts and k == headline) and "/" not in k.partition("/")[2])
        if others:  # the validation's, not the training steps' (the progress lines show train/loss)
            parts.append(f"validation at step {last_step}: {others}")
        return "; ".join(parts)

    def close(self) -> None:
        self.logger.close()


def _label(name: str) -> str:
    """A metric's name in words: `validation/accuracy_greedy` -> `accuracy (greedy)`."""
    label = name.partition("/")[2]
    for kind in ("greedy", "sampled"):
        label = label.replace(f"accuracy_{kind}", f"accuracy ({kind})")
    return label.replace("_", " ")


def _is_fraction(name: str, value: float) -> bool:
    """Accuracies are fractions, unless an environment's reward is not 0/1 (a reward model's score:
    its mean is then no percentage)."""
    return ("accuracy" in name or "pass@" in name) and 0.0 <= value <= 1.0


def _fmt(name: str, value: float, as_fraction: Optional[bool] = None) -> str:
    fraction = _is_fraction(name, value) if as_fraction is None else as_fraction
    return f"{value:.1%}" if fraction else f"{value:.4f}"


def train_offline(cfg: Any, schedule: Any, *, name: str, section: str, policy: Any, loader: Any,
                  train_step: Callable[[list, Timer], dict[str, float]], validate: ValidateFn) -> dict[str, float]:
    """The whole run of a trainer on a fixed data set (SFT, DPO, RM), from resume to summary, with
    the run's recovery on the Ray backend (`run_recovery.RunRecovery`: its one policy group).

    `train_step(datums, timer)` trains on the loader's next batch and returns metric names without
    the `train/` prefix; `validate()` as in `TrainingLoop.run`. Returns the last step's metrics
    (empty when a resumed run had nothing left to train: it said so).
    """
    from posttrain.algorithms.run_recovery import RunRecovery, TrainerRun

    loop = TrainingLoop(cfg, schedule, name=name, section=section, policy=policy, loader=loader)
    try:
        loop.resume()
        done = loop.done_message()
        if done:
            print(done, flush=True)
            return {}
        # On Ray, a dead or stuck policy worker is rebuilt and the run replays from its last checkpoint.
        recovery = RunRecovery.for_run(TrainerRun(cfg, policy, loop))
        metrics = loop.run(lambda step, timer: prefixed(train_step(loader.next_batch(), timer), "train"), validate,
                           recovery=recovery)
        loop.finish()
        return metrics
    finally:
        loop.close()
