"""In-process recovery from dead workers (`cluster.max_restarts`) on the Ray backend with the tiny
model: in one PPO run (GRPO's step with a critic) a generation worker, a policy worker and a critic
worker are SIGKILLed at known points (the environment does it, `plugin_envs.KillPlanEnv`), and the
run rebuilds each and ends with every step; a GRPO run whose environment dies once more than
allowed stops in one line, its last checkpoint whole, and its rerun goes on counting restarts."""

from __future__ import annotations

import json

import pytest
from test_grpo import SMALL, plugin_env, read_metrics, small_cfg

from posttrain import cli
from posttrain.algorithms.loop import step_callbacks
from posttrain.config.loader import load_config, save_config
from posttrain.utils.checkpoint import complete_checkpoints

# The timeout is a hang guard, not a speed test.
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]

RECOVERY = ["cluster.backend=ray", "grpo.max_num_steps=4", "checkpointing.save_period=1", plugin_env("KillPlanEnv")]


def kills(tmp_path, plan: str) -> list[str]:
    return [f"env.math.kill_plan={plan}", f"env.math.kill_counter={tmp_path}/calls"]


def test_a_ppo_run_rebuilds_a_dead_generation_worker_policy_worker_and_critic_worker(
        ray_cluster, tmp_path, capfd):
    from posttrain.algorithms import ppo

    pids = {name: tmp_path / f"{name}.pid" for name in ("generation", "policy", "critic")}
    # Two policy workers (an FSDP group), the critic's two beside them and, colocated, two generation
    # workers: the environment is called once per generation shard, so twice a step (once in a step
    # cut short) and twice in the validation before the first step (calls 1 and 2); checkpoints
    # come every 2 steps. Call 3 kills generation rank 0 in step 1 (the step is replayed). Call 7
    # kills policy rank 1 in step 2, after the updates of step 1 and before the first checkpoint:
    # the run starts again at step 1 with the policy and the (live, trained) critic at their
    # initial weights, keeping the validation before it. Call 13 kills critic rank 0 in step 3: the
    # run goes back to step 2's checkpoint. Each call lands in its step whether step 1's second call
    # came before its failure or not. (The environment's own death: the next test.)
    plan = [(3, pids["generation"]), (7, pids["policy"]), (13, pids["critic"])]
    cfg = load_config("ppo", overrides=[
        *SMALL, *RECOVERY, f"logger.log_dir={tmp_path}/logs", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
        "checkpointing.save_period=2", "policy.num_workers=2", "grpo.val_at_start=true",
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
    assert sorted(metrics) == [0, 1, 2, 3, 4]  # every step once: replays overwrite nothing, skip nothing
    # The validation before the first step survived the rewind to the start: the run's "before".
    assert "validation/accuracy_greedy" in metrics[0] and history[0][0] == 0
    last = metrics[4]
    assert last["recovery/restarts"] == 3
    kinds = ("policy", "critic", "generation", "environment")
    assert [last[f"recovery/restarts/{kind}"] for kind in kinds] == [1, 1, 1, 0]
    assert [metrics[step]["recovery/restarts"] for step in (1, 2, 3, 4)] == [2, 2, 3, 3]
    assert [line.split(":")[0] for line in metrics[3]["recovery/failures"]] == ["step 1", "step 2", "step 3"]
    # The rebuilt engines were refit from the (rebuilt) policy: the trainer agrees with what they sampled.
    assert 1.0 <= last["train/token_mult_prob_error"] < 1.001
    assert (tmp_path / "ckpt" / "step_4" / "critic").is_dir()


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
