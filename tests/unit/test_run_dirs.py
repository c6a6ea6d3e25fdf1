"""Safe run directories: the lock naming its run, stale-lock take-over, config checks on resume,
and the message for a run resumed at or past its last step."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from posttrain.algorithms.loop import train_offline
from posttrain.job import prepare_run_dirs
from posttrain.config import load_config
from posttrain.preflight import STEPS_SECTIONS, check_run_dirs
from posttrain.run_config import (
    planned_run_config,
    warm_start_dirs,
    warm_start_export_dir,
    warm_start_job,
    warm_start_stamp,
)
from posttrain.utils.cache import write_manifest
from posttrain.utils import run_dirs
from posttrain.utils.run_dirs import (
    LOCK_FILE,
    ResumeConfigError,
    RunDirLocked,
    acquire_dir_lock,
    already_done_message,
    compare_configs,
    release_dir_lock,
)

HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from posttrain.utils.run_dirs import acquire_dir_lock
    acquire_dir_lock(sys.argv[1])
    print("locked", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def other_run(tmp_path):
    """Another process holding the lock of `tmp_path / "run"`; yields (process, directory)."""
    directory = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(directory)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    yield proc, directory
    proc.kill()
    proc.wait()


def test_a_second_run_is_refused_naming_the_first(other_run):
    proc, directory = other_run
    with pytest.raises(RunDirLocked) as info:
        acquire_dir_lock(directory)
    message = str(info.value)
    assert f"{directory.resolve()} is in use by another run (host {socket.gethostname()}, pid {proc.pid}, started 20" in message
    assert "command: -c" in message and "use another logger.log_dir / checkpointing.checkpoint_dir" in message


def test_the_lock_of_a_killed_run_is_taken_over(other_run, capsys):
    proc, directory = other_run
    proc.kill()  # kill -9: the lock file stays behind
    proc.wait()
    assert json.loads((directory / LOCK_FILE).read_text())["pid"] == proc.pid
    lock = acquire_dir_lock(directory)
    try:
        assert f"taking over the stale lock of {directory.resolve()}" in capsys.readouterr().out
        assert json.loads(lock.read_text())["pid"] != proc.pid
    finally:
        release_dir_lock(lock)
    assert not lock.exists()


def test_a_reused_pid_does_not_keep_a_lock_alive(tmp_path):
    """A lock whose pid now belongs to a newer process (this one) is stale."""
    import os

    directory = tmp_path / "run"
    directory.mkdir()
    stale = {"host": socket.gethostname(), "pid": os.getpid() + 0, "process_start_time": 1.0, "token": "x"}
    assert run_dirs.holder_is_alive(stale) is False
    stale["host"] = "some-other-host"
    assert run_dirs.holder_is_alive(stale) is None  # cannot tell: refused with the file to delete
    (directory / LOCK_FILE).write_text(json.dumps(stale))
    with pytest.raises(RunDirLocked, match=f"on another host.*delete {directory.resolve() / LOCK_FILE}"):
        acquire_dir_lock(directory)


def test_lock_is_reentrant_in_one_process_and_released(tmp_path):
    first = acquire_dir_lock(tmp_path / "a")
    assert acquire_dir_lock(tmp_path / "a") == first
    release_dir_lock(first)
    assert not first.exists()


def test_compare_configs_splits_corrupting_and_harmless_changes():
    old = load_config("grpo", overrides=["sft_warmup=null"]).model_dump(mode="json")
    new = load_config("grpo", overrides=[
        "sft_warmup=null", "grpo.max_num_steps=500", "logger.log_dir=elsewhere", "policy.optimizer.lr=3e-4",
        "data.num_train=100", "policy.train_global_batch_size=64", "policy.model_name=small",
        "data.num_validation=50",
    ]).model_dump(mode="json")
    corrupting, harmless = compare_configs(old, new)
    assert corrupting == [
        "data.num_train: 8000 -> 100",
        "policy.model_name: 'tiny' -> 'small'",
        "policy.train_global_batch_size: 128 -> 64",
    ]
    assert harmless == [
        "data.num_validation: 500 -> 50",
        "grpo.max_num_steps: 250 -> 500",
        "logger.log_dir: 'logs/grpo_math_tiny' -> 'elsewhere'",
        "policy.optimizer.lr: 0.0001 -> 0.0003",
    ]


def _fake_checkpoint(ckpt: Path) -> None:
    (ckpt / "step_3").mkdir(parents=True)
    (ckpt / "step_3" / "training_info.json").write_text(json.dumps({"step": 3}))


def _cfg(tmp_path: Path, *extra: str):
    return load_config("sft", overrides=[f"logger.log_dir={tmp_path}/logs",
                                         f"checkpointing.checkpoint_dir={tmp_path}/ckpt", *extra])


def test_resume_refuses_corrupting_changes_before_anything_starts(tmp_path, capsys):
    prepare_run_dirs(_cfg(tmp_path))  # first run: checks, locks
    assert (tmp_path / "logs" / LOCK_FILE).is_file() and not (tmp_path / "ckpt" / "config.yaml").exists()
    run_dirs.save_run_config(_cfg(tmp_path))  # ... and, having trained a step, saves its config
    _fake_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ResumeConfigError) as info:
        prepare_run_dirs(_cfg(tmp_path, "data.num_digits=3", "policy.max_total_sequence_length=128"))
    message = str(info.value)
    assert "data.num_digits: 2 -> 3" in message and "policy.max_total_sequence_length: 64 -> 128" in message
    assert "checkpointing.allow_resume_config_changes=true" in message
    # Harmless changes: allowed and listed; the saved config becomes the new one.
    prepare_run_dirs(_cfg(tmp_path, "sft.max_num_steps=900", "logger.progress_bar=false"))
    out = capsys.readouterr().out
    assert "resuming with config changes: logger.progress_bar: True -> False; sft.max_num_steps: 200 -> 900" in out
    run_dirs.save_run_config(_cfg(tmp_path, "sft.max_num_steps=900", "logger.progress_bar=false"))
    assert "max_num_steps: 900" in (tmp_path / "ckpt" / "config.yaml").read_text()
    # The escape hatch resumes anyway, with a warning per key.
    prepare_run_dirs(_cfg(tmp_path, "sft.max_num_steps=900", "logger.progress_bar=false",
                                 "data.num_digits=3", "checkpointing.allow_resume_config_changes=true"))
    assert "WARNING: resuming with a changed config" in capsys.readouterr().out


def test_already_done_messages():
    assert already_done_message(3, 5, "grpo.max_num_steps") is None
    assert "this run is complete" in already_done_message(5, 5, "grpo.max_num_steps")
    message = already_done_message(8, 5, "grpo.max_num_steps")
    assert "at step 8, past this run's last step 5" in message and "raise grpo.max_num_steps above 8" in message
    # ... or start a new run elsewhere, in the same line.
    for message in (already_done_message(8, 5, "grpo.max_num_steps"), already_done_message(5, 5, "sft.max_num_steps")):
        assert "\n" not in message
        assert message.endswith("or set another logger.log_dir and checkpointing.checkpoint_dir to train a new run")


class _Loader:
    def steps_for_epochs(self, epochs):
        return 10**9

    def load_state_dict(self, state):
        pass


class _Policy:
    def load_checkpoint(self, path):
        pass


def test_offline_run_resumed_past_its_last_step_says_so(tmp_path, capsys):
    cfg = _cfg(tmp_path, "sft.max_num_steps=2", "logger.tensorboard_enabled=false", "logger.progress_bar=false")
    _fake_checkpoint(tmp_path / "ckpt")

    def no_training(*_):
        raise AssertionError("nothing should train")

    metrics = train_offline(cfg, cfg.sft, name="SFT", section="sft", policy=_Policy(), loader=_Loader(),
                            train_step=no_training, validate=dict)
    assert metrics == {}
    out = capsys.readouterr().out
    assert "checkpoint is at step 3, past this run's last step 2" in out and "sft.max_num_steps above 3" in out
    assert "SFT finished" not in out  # no stale summary


def test_grpo_resumed_past_its_last_step_says_so(monkeypatch, capsys):
    from posttrain.algorithms import grpo, grpo_run

    class Loop:
        def done_message(self):
            return already_done_message(7, 4, "grpo.max_num_steps")

    class Ctx:
        loop, shut = Loop(), False

        def shutdown(self):
            Ctx.shut = True

    monkeypatch.setattr(grpo_run, "setup_grpo", lambda cfg: Ctx())
    monkeypatch.setattr(grpo, "grpo_train", lambda ctx: pytest.fail("nothing should train"))
    assert grpo.run(load_config("grpo", overrides=["sft_warmup=null"])) == {"before": None, "after": None}
    assert "at step 7, past this run's last step 4" in capsys.readouterr().out and Ctx.shut


class _SteppingLoader(_Loader):
    def next_batch(self):
        return []

    def state_dict(self):
        return {}


class _SavingPolicy(_Policy):
    def save_checkpoint(self, path, save_optimizer=True):
        path.mkdir(parents=True)


def test_runs_that_train_nothing_or_fail_at_start_leave_the_saved_config(tmp_path, capsys):
    """The config beside a checkpoint is the config that trained it: a run already past its last
    step, or one that fails before its first step (a backend that would not start), does not
    overwrite it, and the next resume compares against the config that trained."""
    quiet = ("logger.tensorboard_enabled=false", "logger.progress_bar=false", "logger.report=false",
             "checkpointing.save_period=2")

    def train(cfg, step=lambda datums, timer: {"loss": 1.0}):
        prepare_run_dirs(cfg)
        return train_offline(cfg, cfg.sft, name="SFT", section="sft", policy=_SavingPolicy(), loader=_SteppingLoader(),
                             train_step=step, validate=dict)

    train(_cfg(tmp_path, "sft.max_num_steps=4", *quiet))
    saved = {d: (tmp_path / d / "config.yaml").read_text() for d in ("logs", "ckpt")}
    assert "max_num_steps: 4" in saved["ckpt"] and "backend: auto" in saved["ckpt"]

    # Past its last step: nothing trained.
    assert train(_cfg(tmp_path, "sft.max_num_steps=3", "cluster.backend=ray", *quiet)) == {}

    def fails(datums, timer):
        raise RuntimeError("the backend did not start")

    with pytest.raises(RuntimeError):  # fails in its first step
        train(_cfg(tmp_path, "sft.max_num_steps=6", "cluster.backend=ray", *quiet), fails)
    assert {d: (tmp_path / d / "config.yaml").read_text() for d in ("logs", "ckpt")} == saved

    capsys.readouterr()
    train(_cfg(tmp_path, "sft.max_num_steps=6", *quiet))
    out = capsys.readouterr().out
    assert "resuming with config changes: sft.max_num_steps: 4 -> 6" in out and "cluster.backend" not in out
    assert "max_num_steps: 6" in (tmp_path / "ckpt" / "config.yaml").read_text()


# ------------------------------------------------- checked before anything starts (`posttrain.preflight`)
REPO = Path(__file__).resolve().parents[2]
# Every job that checkpoints: (command, config file, overrides), warm starts off (tested below).
JOB_KINDS = {
    "grpo": ("grpo", None, ["sft_warmup=null"]),
    "async grpo": ("grpo", REPO / "posttrain/configs/grpo_async_tiny.yaml", ["sft_warmup=null"]),
    "sft": ("sft", None, []),
    "dpo": ("dpo", None, []),
    "rm": ("rm", None, []),
    "distill": ("distill", None, ["sft_warmup=null", "teacher_warmup=null"]),
}


def _job_cfg(tmp_path: Path, kind: str, *extra: str):
    command, path, overrides = JOB_KINDS[kind]
    return load_config(command, path, [*overrides, f"logger.log_dir={tmp_path}/logs",
                                       f"checkpointing.checkpoint_dir={tmp_path}/ckpt", *extra])


def _trained(cfg, ckpt: Path, step: int = 3) -> None:
    """What a run of `cfg` leaves once it has checkpointed `step`: its config (as the job ran it) and a checkpoint."""
    section = next(name for name in STEPS_SECTIONS if hasattr(cfg, name))
    run_dirs.save_run_config(planned_run_config(cfg, getattr(cfg, section).max_num_steps))
    (ckpt / f"step_{step}").mkdir(parents=True)
    (ckpt / f"step_{step}" / "training_info.json").write_text(json.dumps({"step": step}))


@pytest.mark.parametrize("kind", JOB_KINDS)
def test_every_job_checks_its_resume_before_anything_starts(tmp_path, kind, capsys):
    cfg = _job_cfg(tmp_path, kind)
    try:
        assert check_run_dirs(cfg) is None  # a fresh run: nothing to compare
        _trained(cfg, tmp_path / "ckpt")
        assert check_run_dirs(_job_cfg(tmp_path, kind)) is None  # the same command resumes, silently
        assert capsys.readouterr().out == ""
        with pytest.raises(ResumeConfigError, match=r"policy.model_name: 'tiny' -> 'tiny-qwen2'\. Use another"):
            check_run_dirs(_job_cfg(tmp_path, kind, "policy.model_name=tiny-qwen2"))
        section = next(name for name in STEPS_SECTIONS if hasattr(cfg, name))
        done = check_run_dirs(_job_cfg(tmp_path, kind, f"{section}.max_num_steps=3"))
        assert f"checkpoint is at step 3, the last step ({section}.max_num_steps=3" in done
    finally:
        run_dirs.release_run_dirs(cfg)
        run_dirs.forget_checks_ahead()


def test_a_resume_is_checked_once_and_a_locked_directory_refused_first(tmp_path, capsys, other_run):
    cfg = _job_cfg(tmp_path, "grpo")
    _trained(cfg, tmp_path / "ckpt", step=1)
    more = _job_cfg(tmp_path, "grpo", "grpo.max_num_steps=400")
    try:
        assert check_run_dirs(more) is None
        assert capsys.readouterr().out.count("resuming with config changes: grpo.max_num_steps: 250 -> 400") == 1
        prepare_run_dirs(planned_run_config(more, 400))  # the job's own check (start_run): not said again
        assert capsys.readouterr().out == ""
    finally:
        run_dirs.release_run_dirs(more)
        run_dirs.forget_checks_ahead()
    _, held = other_run
    with pytest.raises(RunDirLocked, match="is in use by another run"):
        check_run_dirs(_job_cfg(tmp_path, "grpo", f"logger.log_dir={held}"))


def test_a_warm_start_that_will_train_has_its_checkpoints_checked_too(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))  # no export cached: the warm start will train
    overrides = [f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt"]
    cfg = load_config("grpo", overrides=overrides)
    warm = warm_start_job(cfg.sft_warmup, *warm_start_dirs(cfg, "sft_warmup"))
    _trained(warm, tmp_path / "ckpt/sft_warmup", step=2)  # interrupted in its warm start
    try:
        assert check_run_dirs(cfg) is None
        with pytest.raises(ResumeConfigError, match=r"ckpt/sft_warmup holds .* data.num_digits: 2 -> 3"):
            check_run_dirs(load_config("grpo", overrides=[*overrides, "sft_warmup.data.num_digits=3"]))
        # Once the export is complete the warm start does not train again: its checkpoints are not in
        # the way. A directory without its manifest (an unfinished export) is not complete.
        export = warm_start_export_dir(load_config("grpo", overrides=[*overrides, "sft_warmup.data.num_digits=3"]).sft_warmup)
        export.mkdir(parents=True)
        (export / "config.json").write_text("{}")
        with pytest.raises(ResumeConfigError):
            check_run_dirs(load_config("grpo", overrides=[*overrides, "sft_warmup.data.num_digits=3"]))
        write_manifest(export, warm_start_stamp(export))
        assert check_run_dirs(load_config("grpo", overrides=[*overrides, "sft_warmup.data.num_digits=3"])) is None
    finally:
        run_dirs.release_run_dirs(cfg)
        run_dirs.forget_checks_ahead()
