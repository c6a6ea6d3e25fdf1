"""In-process recovery from dead and hung workers (`cluster.max_restarts`) on the Ray backend with
the tiny model: in one PPO run (GRPO's step with a critic) a generation worker, a policy worker and
a critic worker are SIGKILLed at known points (the environment does it, `plugin_envs.KillPlanEnv`),
and the run rebuilds each and ends with every step; a PPO run survives a policy worker's SIGSEGV and
a generation worker frozen by SIGSTOP; a collective stuck with its peers alive and a wedged
environment are found by their phases' progress bounds; a GRPO run whose environment dies mid-step
and whose policy worker dies right after its update ends on the weights of an uninterrupted run; a
GRPO run whose environment dies once more than allowed stops in one line, its last checkpoint
whole, and its rerun goes on counting restarts; an SFT run whose policy worker dies after its update
ends on the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import torch

import pytest
from test_grpo import (IN_PROCESS, PARTIAL, SMALL, _comparable, keeping_torch_threads, plugin_env, read_metrics,
                       small_cfg)

from posttrain import cli
from posttrain.algorithms.loop import step_callbacks
from posttrain.config.loader import load_config, save_config
from posttrain.utils.checkpoint import complete_checkpoints

# The timeout is a hang guard, not a speed test.
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]

PLUGIN_LOSSES = Path(__file__).with_name("plugin_losses.py")
RECOVERY = ["cluster.backend=ray", "grpo.max_num_steps=4", "checkpointing.save_period=1", plugin_env("KillPlanEnv")]


def kills(tmp_path, plan: str) -> list[str]:
    return [f"env.math.kill_plan={plan}", f"env.math.kill_counter={tmp_path}/calls"]


def recovery_lines(out: str) -> list[str]:
    lines = [line for line in out.splitlines() if line.startswith("[posttrain] recovery ")]
    print("\n".join(lines))  # shown with the test's output when it fails
    return lines


def test_a_ppo_run_rebuilds_a_dead_generation_worker_policy_worker_and_critic_worker(
        ray_cluster, tmp_path, capfd):
    from posttrain.algorithms import ppo

    pids = {name: tmp_path / f"{name}.pid" for name in ("generation", "policy", "critic")}
    # Two policy workers (an FSDP group), the critic's two beside them and one generation worker of
    # its own (how many engines is not what this test is about: two processes fewer to start, one at
    # first and one in the rebuild; a colocated engine's rebuild: the segfault test below): the
    # environment is called once a step and once in the validation before the first step (call 1);
    # checkpoints come every 2 steps and at the last. Call 2 kills the generation worker in step 1
    # (the step is replayed: call 3). Call 4 kills policy rank 1 in step 2, after the updates of
    # step 1 and before the first checkpoint: the run starts again at step 1 (call 5) with the
    # policy and the (live, trained) critic at their initial weights, keeping the validation before
    # it. Call 7 kills critic rank 0 in step 3, the last: the run goes back to step 2's checkpoint
    # and replays step 3. (The environment's own death: the next test.)
    plan = [(2, pids["generation"]), (4, pids["policy"]), (7, pids["critic"])]
    cfg = load_config("ppo", overrides=[
        *SMALL, *RECOVERY, f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
        "grpo.max_num_steps=3", "checkpointing.save_period=2", "policy.num_workers=2", "grpo.val_at_start=true",
        "policy.generation.colocated.enabled=false", "policy.generation.colocated.num_workers=1",
        "critic.warmup_steps=0",  # the policy trains from step 1
        *kills(tmp_path, ";".join(f"{call}:{target}" for call, target in plan))])
    ctx = ppo.setup(cfg)

    def write_pids(*_) -> None:  # after every step too: a recovery starts new processes
        pids["generation"].write_text(str(ctx.generation.worker_group.run_all("pid")[0]))
        pids["policy"].write_text(str(ctx.policy.worker_group.run_all("pid")[1]))
        pids["critic"].write_text(str(ctx.critic.worker_group.run_all("pid")[0]))

    try:
        write_pids()
        with step_callbacks([write_pids], "grpo"):
            ppo.ppo_train(ctx)
        history = list(ctx.loop.history)
    finally:
        ctx.shutdown()
    out = capfd.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("[posttrain] recovery ")]
    print("\n".join(lines))  # shown with the test's output when it fails
    assert len(lines) == 3, lines
    died = "died: its process exited (killed by a signal, out of memory, or crashed)"
    assert "generation worker rank 0 (node " in lines[0] and died in lines[0] and "replaying step 1" in lines[0], lines
    assert "policy worker rank 1 (node " in lines[1] and "from the last checkpoint" in lines[1], lines
    assert "critic worker rank 0 (node " in lines[2] and died in lines[2], lines
    assert "rebuilding the critic workers, then loading the last checkpoint" in lines[2], lines
    assert "no checkpoint yet: starting again at step 1" in out and "resumed from" in out
    metrics = read_metrics(tmp_path / "logs")
    assert sorted(metrics) == [0, 1, 2, 3]  # every step once: replays overwrite nothing, skip nothing
    # The validation before the first step survived the rewind to the start: the run's "before".
    assert "validation/accuracy_greedy" in metrics[0] and history[0][0] == 0
    last = metrics[3]
    assert last["recovery/restarts"] == 3
    kinds = ("policy", "critic", "generation", "environment")
    assert [last[f"recovery/restarts/{kind}"] for kind in kinds] == [1, 1, 1, 0]
    assert [metrics[step]["recovery/restarts"] for step in (1, 2, 3)] == [2, 2, 3]
    assert [line.split(":")[0] for line in metrics[3]["recovery/failures"]] == ["step 1", "step 2", "step 3"]
    # The rebuilt engines were refit from the (rebuilt) policy: the trainer agrees with what they sampled.
    assert 1.0 <= last["train/token_mult_prob_error"] < 1.001
    assert (tmp_path / "ckpt" / "step_3" / "critic").is_dir()  # the last step's checkpoint, after the rebuild


def test_past_max_restarts_the_run_stops_in_one_line_and_resumes_from_its_checkpoint(ray_cluster, tmp_path, capfd):
    # One policy and one generation worker: one environment call a step. The environment dies at
    # step 3 (call 3) and again when step 3 is replayed (call 4): one more than max_restarts=1. The
    # rerun allows one more restart, which the environment's death in its first call takes (call 5).
    cfg = small_cfg(tmp_path, *RECOVERY, "cluster.max_restarts=1", *kills(tmp_path, "3:self;4:self;5:self"))
    config = tmp_path / "run.yaml"
    save_config(cfg, config)
    assert cli.main(["grpo", "--config", str(config)]) == 3
    out, err = capfd.readouterr()
    assert len([line for line in out.splitlines() if line.startswith("[posttrain] recovery 1 of 1: ")]) == 1
    stopped = [line for line in err.splitlines() if line.startswith("posttrain grpo: stopped: ")]
    assert len(stopped) == 1, err
    assert "environment 'math' died" in stopped[0] and "no restart left (cluster.max_restarts=1)" in stopped[0]
    assert "resumes from step 2" in stopped[0], stopped
    assert "Traceback" not in err
    assert [step for step, _ in complete_checkpoints(tmp_path / "ckpt")] == [1, 2]
    assert sorted(read_metrics(tmp_path / "logs")) == [1, 2]
    record = json.loads((tmp_path / "ckpt" / "recovery.json").read_text())
    assert record["restarts"] == 1 and len(record["failures"]) == 2  # the restart, and the failure that stopped it

    # The rerun resumes from step 2 and goes on counting: its one restart is the run's second.
    assert cli.main(["grpo", "--config", str(config), "cluster.max_restarts=2"]) == 0
    out = capfd.readouterr().out
    assert "resumed from" in out and "[posttrain] recovery 2 of 2: environment 'math' died" in out, out
    assert "recovered 2 time(s) (cluster.max_restarts=2" in out  # the summary line
    metrics = read_metrics(tmp_path / "logs")
    assert sorted(metrics) == [1, 2, 3, 4] and metrics[4]["recovery/restarts"] == 2
    failures = metrics[3]["recovery/failures"]  # every failure so far, on the first step logged after one
    assert [line.split(":")[0] for line in failures] == ["step 3"] * 3 and "environment 'math' died" in failures[2]


def test_a_collective_stuck_with_live_peers_and_a_wedged_environment_are_found_and_recovered(
        ray_cluster, tmp_path, capfd, monkeypatch):
    from posttrain.algorithms import grpo
    from posttrain.distributed import progress

    monkeypatch.setattr(progress, "STACK_WAIT_S", 600.0)  # the stacks come within a beat: a guard, not a wait

    # Two policy workers (one FSDP group) and one generation worker of its own (how many engines
    # is not what this test is about: one fewer process to start): one environment call a step.
    # Call 2 (step 2) raises the flag on which policy rank 1 stops inside its loss in step 2's
    # update (`plugin_losses.StallOnceLoss`): alive, beating, while rank 0 waits for it in one of
    # FSDP's collectives. The run goes back to step 1's checkpoint and replays step 2 (call 3);
    # call 4 (step 3's, or later should another replay come between) never returns. The phases'
    # bounds (15 s) are far above a normal train call or environment step of the tiny model (a
    # second or less) and far below cluster.worker_timeout_s (1800 s): without progress detection
    # the test would run into its own timeout.
    flag = tmp_path / "stall_flag"
    cfg = load_config("grpo", overrides=[
        *SMALL, *RECOVERY, f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
        "policy.num_workers=2", "policy.generation.colocated.enabled=false",
        "policy.generation.colocated.num_workers=1",
        f"loss_fn.name={PLUGIN_LOSSES}:StallOnceLoss", f"loss_fn.kwargs.stall_flag={flag}",
        "grpo.max_num_steps=3", "cluster.progress_timeout_s.train=15", "cluster.progress_timeout_s.env_step=15",
        "cluster.max_restarts=5",  # room for a normal call that a busy machine made overrun its bound
        *kills(tmp_path, f"2:touch:{flag};4:hang")])
    ctx = grpo.setup(cfg)
    try:
        grpo.grpo_train(ctx)
    finally:
        ctx.shutdown()
    lines = recovery_lines(capfd.readouterr().out)
    stuck = [line for line in lines if "policy workers hung: no progress" in line]
    wedged = [line for line in lines if "environment 'math' hung: no progress" in line]
    assert stuck and wedged, lines
    # Both ranks are named: rank 1 where it stopped (the loss), rank 0 in the collective it waits in.
    rank1 = re.search(r"rank 1 \(node [^)]*\), no progress in train for \d+s \(bound 15s: "
                      r"cluster.progress_timeout_s.train=15\), stuck in [^;]*__call__ \(plugin_losses.py:\d+\)", stuck[0])
    rank0 = re.search(r"rank 0 \(node [^)]*\), no progress in train for \d+s \(bound 15s: [^)]*\), stuck in ([^;]*)",
                      stuck[0])
    assert rank1 and rank0 and re.search(r"distributed|fsdp", rank0.group(1)), stuck[0]
    assert "rebuilding the policy workers, then loading the last checkpoint" in stuck[0]
    assert re.search(r"no progress in env_step for \d+s \(bound 15s: cluster.progress_timeout_s.env_step=15\), "
                     r"stuck in wait \(threading.py:\d+\) <- .*step \(plugin_envs.py:\d+\)", wedged[0]), wedged[0]
    assert "restarting the environment" in wedged[0]
    metrics = read_metrics(tmp_path / "logs")
    assert sorted(metrics) == [1, 2, 3]
    # A busy machine could make a normal call overrun a bound too: every recovery is counted, the two
    # planned ones among them.
    last = metrics[3]
    print({step: round(m["timing/train/policy_training"], 2) for step, m in metrics.items()})
    assert last["recovery/restarts"] == len(lines)
    assert last["recovery/restarts/policy"] >= 1 and last["recovery/restarts/environment"] >= 1


def final_weights(ctx) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in ctx.policy.state_dict_for_export().items()}


def test_a_replay_after_an_environment_died_mid_step_and_a_policy_worker_after_its_update_is_exact(
        ray_cluster, tmp_path, capfd):
    from posttrain.algorithms import grpo

    def run(directory: Path, plan: str, kill_after_update_in: int = 0, *backend: str) -> dict[str, torch.Tensor]:
        # One policy and one generation worker: one environment call a step; checkpoints at steps 2, 4.
        cfg = small_cfg(directory, *RECOVERY, "checkpointing.save_period=2", *kills(directory, plan), *backend)
        ctx = grpo.setup(cfg)
        train = ctx.policy.train

        def train_then_die(*args, **kwargs):  # the worker dies with its update done, the step not yet over
            out = train(*args, **kwargs)
            if ctx.loop.step + 1 == kill_after_update_in and not (directory / "killed").exists():
                (directory / "killed").touch()
                os.kill(ctx.policy.worker_group.run_all("pid")[0], signal.SIGKILL)
            return out

        ctx.policy.train = train_then_die
        try:
            grpo.grpo_train(ctx)
            return final_weights(ctx)
        finally:
            ctx.shutdown()

    with keeping_torch_threads():
        uninterrupted = run(tmp_path / "uninterrupted", "", 0, *IN_PROCESS)
    capfd.readouterr()
    # Call 2 (step 2): the environment kills itself mid-step; step 2 is replayed. Step 3's update is
    # done when the policy worker dies: the run goes back to step 2's checkpoint.
    recovered = run(tmp_path / "recovered", "2:self", kill_after_update_in=3)
    lines = recovery_lines(capfd.readouterr().out)
    assert len(lines) == 2, lines
    assert "environment 'math' died" in lines[0] and "replaying step 2" in lines[0], lines
    assert "policy worker rank 0 (node " in lines[1] and "replaying from the last checkpoint" in lines[1], lines
    metrics = read_metrics(tmp_path / "recovered" / "logs")
    assert sorted(metrics) == [1, 2, 3, 4] and metrics[4]["recovery/restarts"] == 2
    assert metrics[4]["recovery/restarts/policy"] == 1 and metrics[4]["recovery/restarts/environment"] == 1
    assert uninterrupted.keys() == recovered.keys()
    differing = [name for name in uninterrupted if not torch.equal(uninterrupted[name], recovered[name])]
    assert not differing, differing


def test_a_ppo_run_survives_a_segfaulted_policy_worker_and_a_frozen_generation_worker(ray_cluster, tmp_path, capfd):
    from posttrain.algorithms import ppo

    # A policy worker's segfault and a frozen generation worker in one run, shorter than the 30
    # steps of docs/errors.md's drill: one policy and one generation worker, one environment call a
    # step, checkpoints every 2 steps. Call 3 (step 3) sends SIGSEGV to the policy worker: the run
    # goes back to step 2's checkpoint. Call 5 (step 4, after step 3's replay) sends SIGSTOP to the
    # generation worker: alive to Ray, silent to its heartbeat, it is found when the next call to it
    # (step 5's generation at the latest) has waited cluster.heartbeat_timeout_s without a beat, and
    # the step is replayed with a rebuilt one.
    pids = {name: tmp_path / f"{name}.pid" for name in ("generation", "policy")}
    cfg = load_config("ppo", overrides=[
        *SMALL, *RECOVERY, f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
        "grpo.max_num_steps=5", "checkpointing.save_period=2", "critic.warmup_steps=0",
        "cluster.heartbeat_timeout_s=20",  # short, as the frozen worker is found by it; no healthy beat is that late
        *kills(tmp_path, f"3:{pids['policy']}:SEGV;5:{pids['generation']}:STOP")])
    ctx = ppo.setup(cfg)

    def write_pids(*_) -> None:  # after every step too: a recovery starts new processes
        pids["generation"].write_text(str(ctx.generation.worker_group.run_all("pid")[0]))
        pids["policy"].write_text(str(ctx.policy.worker_group.run_all("pid")[0]))

    try:
        write_pids()
        with step_callbacks([write_pids], "grpo"):
            ppo.ppo_train(ctx)
    finally:
        ctx.shutdown()
    lines = recovery_lines(capfd.readouterr().out)
    assert len(lines) == 2, lines
    assert lines[0].startswith("[posttrain] recovery 1 of 3: policy worker rank 0 (node ") and "died" in lines[0], lines
    assert "replaying from the last checkpoint" in lines[0]
    assert lines[1].startswith("[posttrain] recovery 2 of 3: generation workers hung: stopped answering: rank 0 "), lines
    assert "no heartbeat for" in lines[1] and "rebuilding the generation workers" in lines[1], lines
    metrics = read_metrics(tmp_path / "logs")
    assert sorted(metrics) == [1, 2, 3, 4, 5]
    last = metrics[5]
    assert last["recovery/restarts"] == 2
    assert [last[f"recovery/restarts/{kind}"] for kind in ("policy", "critic", "generation", "environment")] == [1, 0, 1, 0]
    assert 1.0 <= last["train/token_mult_prob_error"] < 1.001  # the rebuilt engine holds the policy's weights


def test_a_partial_rollout_step_replayed_after_its_environment_died_continues_the_same_carry_over(
        ray_cluster, tmp_path, capfd):
    from posttrain.algorithms import grpo

    def run(directory: Path, plan: str, calls_by_step: dict[int, int], *backend: str) -> dict[str, torch.Tensor]:
        cfg = small_cfg(directory, *PARTIAL, *RECOVERY, "grpo.max_num_steps=3", "checkpointing.save_period=2",
                        *kills(directory, plan), *backend)
        ctx = grpo.setup(cfg)

        def count_calls(step, _metrics) -> None:
            calls_by_step[step] = int((directory / "calls").read_text())

        try:
            with step_callbacks([count_calls], "grpo"):
                grpo.grpo_train(ctx)
            return final_weights(ctx)
        finally:
            ctx.shutdown()

    def comparable(directory: Path) -> dict[int, dict]:
        return {step: {k: v for k, v in row.items() if not k.startswith("recovery/")}
                for step, row in _comparable(read_metrics(directory / "logs")).items()}

    calls: dict[int, int] = {}
    with keeping_torch_threads():  # plan "0:...": counts the calls, kills nobody
        uninterrupted = run(tmp_path / "uninterrupted", "0:self", calls, *IN_PROCESS)
    expected = comparable(tmp_path / "uninterrupted")
    assert expected[2]["train/partial_rollouts/carried_over_sequences"] > 0  # step 3 continues some
    capfd.readouterr()
    # The environment dies in its first call of step 3: by then the step's first chunk has advanced
    # the carried-over sequences in place. The replay starts from the carry-over step 3 began with.
    recovered = run(tmp_path / "recovered", f"{calls[2] + 1}:self", {})
    lines = recovery_lines(capfd.readouterr().out)
    assert len(lines) == 1 and "environment 'math' died" in lines[0] and "replaying step 3" in lines[0], lines
    assert comparable(tmp_path / "recovered") == expected
    assert read_metrics(tmp_path / "recovered" / "logs")[3]["recovery/restarts/environment"] == 1
    assert all(torch.equal(uninterrupted[name], recovered[name]) for name in uninterrupted)


def test_an_sft_run_whose_policy_worker_dies_after_its_update_ends_on_the_uninterrupted_weights(
        ray_cluster, tmp_path, capfd, monkeypatch):
    from safetensors.torch import load_file

    from posttrain.algorithms import sft

    def run(directory: Path, kill_after_update_in: int = 0, *backend: str) -> dict[str, torch.Tensor]:
        # 4 steps of 8 rows, checkpoints at steps 2 and 4; the export holds the final weights.
        cfg = load_config("sft", overrides=[
            "cluster.backend=ray", *backend, "data.num_train=64", "data.num_validation=8", "sft.max_num_steps=4",
            "sft.val_period=0", "sft.val_at_start=false", "sft.val_at_end=false", "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=8", "checkpointing.save_period=2", "logger.progress_bar=false",
            "logger.report=false", "logger.tensorboard_enabled=false", f"logger.log_dir={directory}/logs",
            f"checkpointing.checkpoint_dir={directory}/ckpt"])
        make_policy = sft.make_policy

        def make_policy_that_dies(*args, **kwargs):  # its worker dies with step 3's update done
            policy = make_policy(*args, **kwargs)
            train = policy.train

            def train_then_die(*train_args, **train_kwargs):
                out = train(*train_args, **train_kwargs)
                if policy.updates == kill_after_update_in and not (directory / "killed").exists():
                    (directory / "killed").touch()
                    os.kill(policy.worker_group.run_all("pid")[0], signal.SIGKILL)
                return out

            policy.train = train_then_die
            return policy

        monkeypatch.setattr(sft, "make_policy", make_policy_that_dies)
        sft.run(cfg, export_dir=directory / "export")
        return load_file(directory / "export" / "model.safetensors")

    with keeping_torch_threads():
        uninterrupted = run(tmp_path / "uninterrupted", 0, *IN_PROCESS)
    capfd.readouterr()
    recovered = run(tmp_path / "recovered", kill_after_update_in=3)
    lines = recovery_lines(capfd.readouterr().out)
    # Step 4's update finds the worker dead: the run goes back to step 2's checkpoint.
    assert len(lines) == 1 and lines[0].startswith("[posttrain] recovery 1 of 3: policy worker rank 0 (node "), lines
    assert "rebuilding the policy workers, then loading the last checkpoint, replaying from the last checkpoint" in lines[0]
    metrics = read_metrics(tmp_path / "recovered" / "logs")
    assert sorted(metrics) == [1, 2, 3, 4]
    assert metrics[4]["recovery/restarts"] == 1 and metrics[4]["recovery/restarts/policy"] == 1
    assert [line.split(":")[0] for line in metrics[3]["recovery/failures"]] == ["step 4"]
    assert uninterrupted.keys() == recovered.keys()
    differing = [name for name in uninterrupted if not torch.equal(uninterrupted[name], recovered[name])]
    assert not differing, differing
