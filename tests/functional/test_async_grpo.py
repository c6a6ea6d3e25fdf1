"""Async GRPO with real Ray workers: staleness, importance weights, resume, recovery from killed
workers, and every way it could hang (a dead collector, a crashed or stuck environment, a
straggler) ending in a clear error or a counted drop within its timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_grpo import SMALL, read_metrics

from posttrain.config.loader import load_config, save_config

pytestmark = pytest.mark.functional

REPO = Path(__file__).resolve().parents[2]
PLUGIN_ENVS = Path(__file__).with_name("plugin_envs.py")

ASYNC = [
    "grpo.async_grpo.enabled=true",
    "grpo.async_grpo.max_trajectory_age_steps=1",
    "loss_fn.use_importance_sampling_correction=true",
    "policy.generation.colocated.enabled=false",
    "policy.generation.colocated.num_workers=1",
]


def async_cfg(tmp_path: Path, *extra: str):
    return load_config("grpo", overrides=[
        *SMALL, *ASYNC, f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt", *extra,
    ])


def faulty(name: str) -> str:
    return f"env.math.class_path={PLUGIN_ENVS}:{name}"


def run_async(cfg) -> tuple[float, BaseException | None]:
    """Run GRPO to the end or to its error; (seconds, error)."""
    from posttrain.algorithms import async_grpo, grpo

    ctx = grpo.setup(cfg)
    t0 = time.monotonic()
    try:
        async_grpo.async_grpo_train(ctx)
        return time.monotonic() - t0, None
    except Exception as e:  # noqa: BLE001 - the tests assert on it
        return time.monotonic() - t0, e
    finally:
        ctx.shutdown()


def kill_once_when_logged(ctx, victims: dict[int, tuple[str, Callable[[], Any]]]) -> list[str]:
    """Kill each victim once (`actors.kill`: its process, also when it lives in a reused one), right
    after its step's metrics are logged: `victims` maps a step to (a name, a function giving the
    actor). The actor is looked up at that moment, so a group rebuilt by an earlier recovery yields
    its new worker. Returns the names killed, in order (a step logged again after a replay does not
    kill again)."""
    from posttrain.distributed import actors

    original, killed = ctx.loop.logger.log_metrics, []

    def log_then_kill(metrics, step, *args, **kwargs):
        original(metrics, step, *args, **kwargs)
        name, actor = victims.get(step, (None, None))
        if name is not None and name not in killed:
            killed.append(name)
            actors.kill(actor())

    ctx.loop.logger.log_metrics = log_then_kill
    return killed


def recovery_lines(capfd) -> list[str]:
    """The run's `[posttrain] recovery` lines in the captured stdout, printed again so that they are
    shown with the test's output when it fails."""
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("[posttrain] recovery ")]
    print("\n".join(lines))
    return lines


def test_async_grpo_trains_on_one_step_old_groups_with_importance_weights(ray_cluster, tmp_path):
    seconds, error = run_async(async_cfg(
        tmp_path, "grpo.max_num_steps=4", "grpo.val_at_end=true", "checkpointing.save_period=2", faulty("CoinEnv"),
        "loss_fn.truncated_importance_sampling_type=tis", "loss_fn.truncated_importance_sampling_ratio=2.0",
    ))
    assert error is None, error
    steps = read_metrics(tmp_path / "logs")
    assert sorted(s for s in steps if s > 0) == [1, 2, 3, 4]
    # The first step trains the groups made with the starting weights; afterwards the collector
    # is one step ahead, and nothing is older than the limit, so nothing is evicted.
    assert steps[1]["async/trajectory_age_max"] == 0
    assert [steps[s]["async/trajectory_age_max"] for s in (2, 3, 4)] == [1, 1, 1]
    assert all(steps[s]["async/evicted_groups"] == 0 and steps[s]["async/dropped_groups"] == 0 for s in steps if s)
    # One step old, the generating weights differ from the trained ones: the importance weights
    # are no longer all 1, and stay close to it (small steps).
    weights = [steps[s]["train/sampling_importance_ratio_untruncated"] for s in (2, 3, 4)]
    assert all(w != 1.0 and abs(w - 1.0) < 0.2 for w in weights), weights
    assert steps[1]["train/sampling_importance_ratio_untruncated"] == pytest.approx(1.0, abs=1e-5)
    for key in ("timing/train/idle/buffer_starvation", "timing/train/exposed_generation", "timing/train/weight_sync",
                "timing/train/idle/refit_bubble", "timing/collector/generation", "async/buffer_size"):
        assert all(key in steps[s] for s in (1, 2, 3, 4)), key
    assert 0 <= steps[4]["timing/train/exposed_generation"] <= steps[4]["timing/train/idle/buffer_starvation"] + 1e-6
    assert "validation/accuracy_greedy" in steps[4]
    # The checkpoint holds the buffer: what a resumed run trains next.
    saved = torch.load(tmp_path / "ckpt" / "step_2" / "replay_buffer.pt", weights_only=False)
    assert saved["batches"] >= 2 and all(g.weight_version <= 2 for g in saved["buffer"]["groups"])


def test_staleness_eviction_with_a_real_collector(ray_cluster, tmp_path):
    """Groups older than the limit when the trainer looks are evicted and counted; the
    collector then goes on with fresh groups."""
    from posttrain.algorithms import grpo
    from posttrain.algorithms.async_grpo import TrajectoryCollector
    from posttrain.algorithms.replay_buffer import ReplayBuffer

    ctx = grpo.setup(async_cfg(tmp_path))
    lock = threading.Lock()
    buffer = ReplayBuffer(capacity=8, max_age=1)
    collector = TrajectoryCollector(ctx, buffer, lock)
    collector.start()
    try:
        deadline = time.monotonic() + 600  # generous: beside CPU hogs a rollout batch takes minutes
        while len(buffer) < 8:  # two steps' groups, made with weights of step 0
            assert collector.problem() is None and time.monotonic() < deadline
            time.sleep(0.05)
        # The policy moved on three steps without them (version 3): step-0 groups are too old.
        ctx.generation.refit_from_policy(ctx.policy, ctx.refit_metadata, 3)
        collector.consumed_steps = 3
        fresh = buffer.take(4, current_version=3, timeout=600, producer_error=collector.problem)
        assert buffer.evicted == 8
        assert [g.weight_version for g in fresh] == [3] * 4 and buffer.last_ages == [0] * 4
    finally:
        collector.stop()
        ctx.shutdown()


@pytest.mark.parametrize("fault, extra, expected", [
    ("CrashingEnv", [], "verifier exploded on purpose"),
    ("StuckEnv", ["grpo.async_grpo.rollout_timeout_s=1.5", "grpo.async_grpo.max_consecutive_failed_rollouts=2"],
     "2 rollout batches in a row yielded no group"),
    ("StuckEnv", ["grpo.async_grpo.rollout_timeout_s=600", "grpo.async_grpo.buffer_timeout_s=4"],
     "ready after 4s (grpo.async_grpo.buffer_timeout_s)"),
])
def test_a_failing_environment_stops_the_run_with_its_reason(ray_cluster, tmp_path, fault, extra, expected):
    _, error = run_async(async_cfg(tmp_path, "grpo.max_num_steps=50", faulty(fault), *extra))
    # The reason itself shows the failure was seen where it happened: a run that missed it would
    # end, 600 s later, with the buffer timeout's message instead (no clock raced here).
    assert error is not None and expected in str(error), error


def test_async_grpo_recovers_from_a_killed_environment_generation_worker_and_policy_worker(
        ray_cluster, tmp_path, capfd):
    from posttrain.algorithms import async_grpo, grpo

    ctx = grpo.setup(async_cfg(tmp_path, "grpo.max_num_steps=6", "checkpointing.save_period=2"))
    # Each victim is killed once, as soon as a step is logged: the environment after step 2 (the
    # collector's next call finds it dead), the generation worker after step 4 (the collector's
    # generation or the trainer's refit finds it), the policy worker after step 5 (step 6's update).
    # Each failure sends the run back to its last checkpoint, with a new collector.
    killed = kill_once_when_logged(ctx, {
        2: ("environment", lambda: ctx.envs["math"]),
        4: ("generation", lambda: ctx.generation.worker_group.workers[0]),
        5: ("policy", lambda: ctx.policy.worker_group.workers[0]),
    })
    try:
        async_grpo.async_grpo_train(ctx)
    finally:
        ctx.shutdown()
    lines = recovery_lines(capfd)
    assert killed == ["environment", "generation", "policy"] and len(lines) == 3, lines
    assert "environment 'math' was killed (ray.kill)" in lines[0], lines
    assert "generation worker rank 0 (node " in lines[1], lines
    for line in lines[:2]:
        assert line.endswith("replaying from the last checkpoint (the collector's rollouts run ahead of the steps)"), line
    assert "policy worker rank 0 (node " in lines[2] and "then loading the last checkpoint" in lines[2], lines
    steps = read_metrics(tmp_path / "logs")
    assert sorted(s for s in steps if s > 0) == [1, 2, 3, 4, 5, 6]  # each step once: the replays overwrote theirs
    last = steps[6]
    assert [last[f"recovery/restarts/{kind}"] for kind in ("policy", "generation", "environment")] == [1, 1, 1]
    assert last["recovery/restarts"] == 3
    assert all(steps[s]["async/trajectory_age_max"] <= 1 for s in range(1, 7))
    assert 1.0 <= last["train/token_mult_prob_error"] < 1.01  # the rebuilt engine was refit from the policy


def test_a_straggler_is_dropped_and_counted_and_the_run_finishes(ray_cluster, tmp_path, monkeypatch):
    # The straggler's batch (the third: plugin_envs.StragglerEnv's third call) starts with its
    # deadline already reached, and its call answers only once that batch is dropped (an event,
    # not a clock): it misses its deadline however fast the machine is. The other batches keep a
    # deadline far from a normal batch's time (under a second here; over 20 s beside CPU hogs,
    # tests/stress.sh), and the next batch's call, queued behind the straggler's, answers at once.
    from posttrain.algorithms import async_grpo

    dropped = tmp_path / "straggler-dropped"
    roll_out_groups = async_grpo.roll_out_groups

    def roll_out_with_the_straggler(ctx, prompts, seed_key, *args, deadline=None, **kwargs):
        if seed_key != 3:
            return roll_out_groups(ctx, prompts, seed_key, *args, deadline=deadline, **kwargs)
        groups, metrics = roll_out_groups(ctx, prompts, seed_key, *args, deadline=time.monotonic(), **kwargs)
        dropped.touch()
        return groups, metrics

    monkeypatch.setattr(async_grpo, "roll_out_groups", roll_out_with_the_straggler)
    seconds, error = run_async(async_cfg(
        tmp_path, "grpo.max_num_steps=4", faulty("StragglerEnv"), f"env.math.release_when={dropped}",
        "grpo.async_grpo.rollout_timeout_s=600",
    ))
    assert error is None, error
    steps = read_metrics(tmp_path / "logs")
    assert steps[4]["async/dropped_groups"] >= 4  # the third rollout's whole batch came late
    assert all(steps[s]["async/trajectory_age_max"] <= 1 for s in (1, 2, 3, 4))


def test_a_killed_async_run_resumes_and_finishes(ray_cluster, tmp_path, capfd):
    """A `posttrain grpo` process (async) SIGKILLed after its step-2 checkpoint; the same command
    run again resumes from it, replay buffer included, and finishes. The rerun runs in this process
    (`cli.main`, on the session's Ray): the killed run is the one that needs a process of its own."""
    from posttrain import cli

    cfg = async_cfg(tmp_path, "grpo.max_num_steps=6", "checkpointing.save_period=2",
                    faulty("HoldAfterCheckpointEnv"))
    config = tmp_path / "run.yaml"
    save_config(cfg, config)
    log = tmp_path / "run.log"
    step2 = tmp_path / "ckpt" / "step_2" / "training_info.json"
    # Rollouts stop once the step-2 checkpoint exists, so the run cannot reach its end before the
    # kill, however fast it is (at most the already-buffered steps train meanwhile). The rerun, in
    # this process without the two variables, has the math environment.
    hold = tmp_path / "hold"
    hold.touch()
    env = {**os.environ, "HOLD": str(hold), "HOLD_AFTER": str(step2)}
    run = subprocess.Popen([sys.executable, "-m", "posttrain", "grpo", "--config", str(config)], cwd=REPO,
                           env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not step2.exists():
        assert run.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "no step-2 checkpoint in time"
        time.sleep(0.1)
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert (tmp_path / "ckpt" / "step_2" / "replay_buffer.pt").exists()
    hold.unlink()
    capfd.readouterr()
    assert cli.main(["grpo", "--config", str(config)]) == 0
    text = "".join(capfd.readouterr())
    assert "resumed from" in text and "GRPO finished at step 6" in text, text[-3000:]
    steps = read_metrics(tmp_path / "logs")
    assert sorted(s for s in steps if s > 0) == [1, 2, 3, 4, 5, 6]
    assert all(steps[s]["async/trajectory_age_max"] <= 1 for s in range(1, 7))
