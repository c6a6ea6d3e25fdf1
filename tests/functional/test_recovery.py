"""In-process recovery from dead workers (`cluster.max_restarts`), GRPO on the Ray backend with the
tiny model: a generation worker, the environment actor and a policy worker are SIGKILLed at known
points of one run (the environment does it, `plugin_envs.KillPlanEnv`), and the run rebuilds each
and ends with every step; a run whose environment dies once more than allowed stops in one line,
its last checkpoint whole and resumable."""

from __future__ import annotations

import pytest
from test_grpo import plugin_env, read_metrics, small_cfg

from posttrain import cli
from posttrain.config.loader import save_config
from posttrain.utils.checkpoint import complete_checkpoints

# The timeout is a hang guard, not a speed test.
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]

RECOVERY = ["cluster.backend=ray", "grpo.max_num_steps=4", "checkpointing.save_period=1", plugin_env("KillPlanEnv")]


def kills(tmp_path, plan: str) -> list[str]:
    return [f"env.math.kill_plan={plan}", f"env.math.kill_counter={tmp_path}/calls"]


def test_a_run_rebuilds_a_dead_generation_worker_environment_and_policy_worker(ray_cluster, tmp_path, capfd):
    from posttrain.algorithms import grpo

    generation_pid, policy_pid = tmp_path / "generation.pid", tmp_path / "policy.pid"
    # Two policy workers (an FSDP group) and, colocated, two generation workers: the environment is
    # called once per generation shard, so twice a step (once in a step cut short). Call 1 kills
    # generation rank 0 in step 1, call 5 the environment itself in step 2, call 9 policy rank 1 in
    # step 3 (whether step 1's second call came before its failure or not).
    cfg = small_cfg(tmp_path, *RECOVERY, "policy.num_workers=2",
                    *kills(tmp_path, f"1:{generation_pid};5:self;9:{policy_pid}"))
    ctx = grpo.setup(cfg)
    try:
        generation_pid.write_text(str(ctx.generation.worker_group.run_all("pid")[0]))
        policy_pid.write_text(str(ctx.policy.worker_group.run_all("pid")[1]))
        grpo.grpo_train(ctx)
    finally:
        ctx.shutdown()
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("[posttrain] recovery ")]
    print("\n".join(lines))  # shown with the test's output when it fails
    assert len(lines) == 3, lines
    died = "died: its process exited (killed by a signal, out of memory, or crashed)"
    assert any("generation worker rank 0 (node " in line and died in line and "refit from the policy" in line
               for line in lines), lines
    assert any(f"environment 'math' {died}" in line and "replaying step 2" in line for line in lines), lines
    assert any("policy worker rank 1 (node " in line and died in line and "from the last checkpoint" in line
               for line in lines), lines
    metrics = read_metrics(tmp_path / "logs")
    assert sorted(metrics) == [1, 2, 3, 4]  # every step once: replays overwrite nothing, skip nothing
    last = metrics[4]
    assert last["recovery/restarts"] == 3
    assert [last[f"recovery/restarts/{kind}"] for kind in ("policy", "generation", "environment")] == [1, 1, 1]
    counts = [metrics[step]["recovery/restarts"] for step in (1, 2, 3, 4)]
    assert counts == sorted(counts) and counts[0] >= 1  # the first kill was in step 1, which was then replayed
    # The rebuilt engines were refit from the (rebuilt) policy: the trainer agrees with what they sampled.
    assert 1.0 <= last["train/token_mult_prob_error"] < 1.001
    assert (tmp_path / "ckpt" / "step_4" / "training_info.json").exists()


def test_past_max_restarts_the_run_stops_in_one_line_and_resumes_from_its_checkpoint(ray_cluster, tmp_path, capfd):
    # One policy and one generation worker: one environment call a step. The environment dies at
    # step 3 (call 3) and again when step 3 is replayed (call 4): one more than max_restarts=1.
    cfg = small_cfg(tmp_path, *RECOVERY, "cluster.max_restarts=1", *kills(tmp_path, "3:self;4:self"))
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

    # The kill plan is spent: the same command resumes from step 2 and finishes.
    assert cli.main(["grpo", "--config", str(config)]) == 0
    assert "resumed from" in capfd.readouterr().out
    assert sorted(read_metrics(tmp_path / "logs")) == [1, 2, 3, 4]
