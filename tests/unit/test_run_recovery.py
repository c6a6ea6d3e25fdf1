"""Recovery's pure parts: the restart bound and counts, what killed an actor in words, heartbeats,
whether the live nodes can hold a lost node's work, which failures a run recovers from
(`RunRecovery` on fake worker groups), and how the training loop replays a step or goes back to
its last checkpoint."""

from __future__ import annotations

import pytest
from test_training_loop import FakeLoader, FakePolicy, cfg_for, make_loop

from posttrain.algorithms.run_recovery import RunRecovery
from posttrain.distributed.cluster import placement_after_loss
from posttrain.distributed.heartbeat import HeartbeatWatch, period_for
from posttrain.distributed.recovery import Replay, RestartBudget, death_cause
from posttrain.distributed.worker_group import WorkerError, WorkerTimeoutError
from posttrain.errors import RunStopped, UserError
from posttrain.utils.logger import read_metrics_jsonl


# ------------------------------------------------------------------------------ bookkeeping
def test_the_budget_counts_recoveries_in_all_and_per_kind_up_to_its_bound():
    budget = RestartBudget(2)
    assert budget.metrics() == {"recovery/restarts": 0.0, "recovery/restarts/policy": 0.0,
                                "recovery/restarts/generation": 0.0, "recovery/restarts/environment": 0.0}
    assert budget.record(["generation"]) == 1
    assert not budget.exhausted()
    assert budget.record(["policy", "generation"]) == 2  # one recovery (a lost node) rebuilding two kinds
    assert budget.exhausted()
    assert budget.metrics() == {"recovery/restarts": 2.0, "recovery/restarts/policy": 1.0,
                                "recovery/restarts/generation": 2.0, "recovery/restarts/environment": 0.0}
    with pytest.raises(RuntimeError, match="no restart left"):
        budget.record(["environment"])
    assert RestartBudget(0).exhausted()
    with pytest.raises(ValueError, match="teacher"):
        RestartBudget(1).record(["teacher"])  # a run without teachers
    ppo = RestartBudget(1, ["policy", "generation", "environment", "critic"])
    assert ppo.record(["critic"]) == 1 and ppo.metrics()["recovery/restarts/critic"] == 1.0
    with pytest.raises(ValueError, match="referee"):
        RestartBudget(1, ["policy", "referee"])


@pytest.mark.parametrize("reason, oom, expected, lost", [
    ("WORKER_DIED", False, "died: its process exited (killed by a signal, out of memory, or crashed)", False),
    ("NODE_DIED", False, "was lost with its node 10.0.0.2", True),
    ("WORKER_DIED", True, "was killed by Ray's memory monitor (its node ran out of memory)", False),
    ("RAY_KILL", False, "was killed (ray.kill)", False),
    ("UNSPECIFIED", False, "died (The actor is gone)", False),
])
def test_death_causes_in_words(reason, oom, expected, lost):
    assert death_cause(reason, oom=oom, node_ip="10.0.0.2", message="The actor is gone\nmore detail") == (expected, lost)


def test_a_heartbeat_that_stops_moving_is_reported_after_the_timeout_by_the_watchers_clock():
    now = [100.0]
    watch = HeartbeatWatch(timeout_s=5.0, clock=lambda: now[0])
    assert watch.observe({"a": b"1", "b": b"7", "c": None}) == {}
    now[0] = 104.0
    assert watch.observe({"a": b"2", "b": b"7", "c": None}) == {}  # b unchanged for 4 s: not yet
    now[0] = 106.0
    assert watch.observe({"a": b"2", "b": b"7", "c": None}) == {"b": 6.0}  # c never beat: not judged
    now[0] = 107.0
    assert watch.observe({"a": b"3", "b": b"8"}) == {}  # b beats again
    assert 0.5 <= period_for(1.0) and period_for(60.0) == 10.0 and period_for(30.0) == 5.0


def test_a_lost_nodes_work_moves_only_when_the_live_nodes_can_hold_it():
    needs = [{"CPU": 2.0, "GPU": 2.0}, {"CPU": 2.0, "GPU": 2.0}]
    placed = [["n1", "n1"], ["n2", "n2"]]
    # n2 is lost; n3 is free: group 1 can be placed there again.
    assert placement_after_loss(needs, placed, {"n1": {"CPU": 0.0, "GPU": 0.0}, "n3": {"CPU": 4.0, "GPU": 2.0}}) \
        == ([1], [])
    # Only the node that holds group 0 is left: group 1 cannot be placed.
    lost, problems = placement_after_loss(needs, placed, {"n1": {"CPU": 0.0, "GPU": 0.0}})
    assert lost == [1] and problems == ["CPU: asked 2, the cluster has 0", "GPU: asked 2, the cluster has 0"]
    # Enough GPUs in all, but not on one machine.
    lost, problems = placement_after_loss(needs, placed, {"n1": {}, "n3": {"CPU": 1.0, "GPU": 1.0},
                                                          "n4": {"CPU": 1.0, "GPU": 1.0}})
    assert lost == [1] and problems and "on one machine" in problems[0]
    assert placement_after_loss(needs, placed, {"n1": {}, "n2": {}}) == ([], [])  # nothing lost


# ------------------------------------------------------------------------- what is recovered
class FakeCluster:
    def __init__(self, problem=None):
        self.problem = problem

    def lost_node_problem(self):
        return self.problem


class FakeGroup:
    is_local = False

    def __init__(self, name, dead=()):
        self.name, self.dead, self.cluster = name, list(dead), FakeCluster()

    def faults(self):
        return self.dead

    def describe_rank(self, rank):
        return f"rank {rank} (node 10.0.0.{rank + 1})"


class FakeRestartable:
    def __init__(self, group):
        self.worker_group, self.restarts = group, []

    def restart(self, *args):
        self.restarts.append(args)
        self.worker_group.dead = []

    def forget_refit_channel(self):
        self.restarts.append("forget")


class FakeEnvs(dict):
    def __init__(self, dead=()):
        super().__init__(math="actor")
        self.dead, self.restarted = list(dead), []

    def faults(self):
        return self.dead

    def restart(self, env):
        self.restarted.append(env)


class FakeLoop:
    def resume_point(self):
        return "GRPO stopped after step 4; a rerun of the same command resumes from step 4 (ckpt/step_4)"


class FakeCtx:
    checkpoint_dir = None  # each test's own (`own_checkpoint_dir`)

    def __init__(self, policy_dead=(), generation_dead=(), env_dead=(), checkpointing=True, max_restarts=3):
        self.policy = FakeRestartable(FakeGroup("policy", policy_dead))
        self.generation = FakeRestartable(FakeGroup("generation", generation_dead))
        self.critic = None
        self.envs = FakeEnvs(env_dead)
        self.loop, self.refit_metadata, self.generation_stale = FakeLoop(), "metadata", False
        self.cfg = type("Cfg", (), {"checkpointing": type("C", (), {"enabled": checkpointing,
                                                                    "checkpoint_dir": self.checkpoint_dir})(),
                                     "cluster": type("K", (), {"max_restarts": max_restarts})()})()


class FakeDistillCtx(FakeCtx):
    """Distillation's context: two teachers (`DistillContext.teacher_groups`)."""

    def __init__(self, teacher_dead=(), **kwargs):
        super().__init__(**kwargs)
        self.teachers = {"teacher": FakeRestartable(FakeGroup("teacher", teacher_dead)),
                         "teachers.code": FakeRestartable(FakeGroup("teachers_code"))}

    def teacher_groups(self):
        return self.teachers


def with_critic(ctx, dead=()):
    """PPO's context: a critic beside the policy."""
    ctx.critic = FakeRestartable(FakeGroup("critic", dead))
    return ctx


DIED = "died: its process exited (killed by a signal, out of memory, or crashed)"


@pytest.fixture(autouse=True)
def own_checkpoint_dir(tmp_path, monkeypatch):
    """The fake runs' checkpoint directory, empty (no checkpoint, no restart record yet)."""
    monkeypatch.setattr(FakeCtx, "checkpoint_dir", tmp_path / "ckpt")


def test_a_dead_generation_worker_is_rebuilt_and_the_step_replayed(capsys):
    ctx = FakeCtx(generation_dead=[(1, DIED, None)])
    recovery = RunRecovery.for_run(ctx)
    assert recovery.recover(WorkerError("WorkerGroup 'generation': rank 1 failed"), "step 3") is Replay.STEP
    assert ctx.generation.restarts == [("metadata",)] and ctx.policy.restarts == [] and ctx.generation_stale
    assert capsys.readouterr().out == (
        f"[posttrain] recovery 1 of 3: generation worker rank 1 (node 10.0.0.2) {DIED}; rebuilding the generation "
        "workers (weights refit from the policy), replaying step 3\n")
    assert recovery.metrics()["recovery/restarts/generation"] == 1.0


def test_a_dead_policy_worker_sends_the_run_back_to_its_checkpoint_and_refits_generation():
    ctx = FakeCtx(policy_dead=[(0, DIED, None)], env_dead=[("math", DIED)])
    replay = RunRecovery.for_run(ctx).recover(RuntimeError("gloo: connection reset by peer"), "step 5")
    assert replay is Replay.FROM_CHECKPOINT
    assert ctx.policy.restarts == [()] and ctx.generation.restarts == ["forget"] and ctx.envs.restarted == ["math"]
    assert ctx.generation_stale


def test_a_timeout_names_the_hung_members_and_a_plain_error_is_not_recovered():
    ctx = FakeCtx()
    recovery = RunRecovery.for_run(ctx)
    hung = WorkerTimeoutError("WorkerGroup 'policy': stopped answering: rank 1 (node 10.0.0.2), no heartbeat for "
                              "31s (cluster.heartbeat_timeout_s=30)", group="policy", ranks=[1])
    wrapped = RuntimeError("the step failed")
    wrapped.__cause__ = hung
    assert recovery.recover(wrapped, "step 2") is Replay.FROM_CHECKPOINT
    env_hung = WorkerTimeoutError("environment 'math': no answer after 1800s", group="env:math")
    assert recovery.recover(env_hung, "step 2") is Replay.STEP and ctx.envs.restarted == ["math"]
    # A bug or a NaN loss: nobody died, nothing timed out.
    assert recovery.recover(ValueError("non-finite loss"), "step 2") is None
    assert recovery.budget.total == 2


def test_a_call_without_progress_is_recovered_like_a_death_and_says_where_it_was_stuck(capsys):
    ctx = FakeCtx()  # no checkpoint yet: the policy starts again from its initial weights
    stuck = WorkerTimeoutError(
        "WorkerGroup 'policy': no progress: rank 1 (node 10.0.0.2), no progress in train for 41s (bound 40s: "
        "cluster.progress_timeout_s.train=40), stuck in acquire (my_loss.py:88) <- train (worker.py:12)",
        group="policy", ranks=[1])
    assert RunRecovery.for_run(ctx).recover(stuck, "step 2") is Replay.FROM_CHECKPOINT
    assert ctx.policy.restarts == [()]
    assert capsys.readouterr().out == (
        "[posttrain] recovery 1 of 3: policy workers hung: no progress: rank 1 (node 10.0.0.2), no progress in train "
        "for 41s (bound 40s: cluster.progress_timeout_s.train=40), stuck in acquire (my_loss.py:88) <- train "
        "(worker.py:12); rebuilding the policy workers, then loading the last checkpoint, replaying from the last "
        "checkpoint (none yet: the policy starts again from its initial weights, at step 1)\n")


def test_the_run_stops_in_one_line_past_the_bound_or_without_checkpoints():
    ctx = FakeCtx(env_dead=[("math", DIED)], max_restarts=0)
    with pytest.raises(RunStopped) as stopped:
        RunRecovery.for_run(ctx).recover(RuntimeError("actor died"), "step 5")
    assert str(stopped.value) == (f"environment 'math' {DIED}; no restart left (cluster.max_restarts=0); GRPO stopped "
                                  "after step 4; a rerun of the same command resumes from step 4 (ckpt/step_4)")
    assert ctx.envs.restarted == []
    ctx = FakeCtx(policy_dead=[(1, DIED, None)], checkpointing=False)
    with pytest.raises(RunStopped, match=r"^policy worker rank 1 .*needs a checkpoint .*checkpointing.enabled=false"):
        RunRecovery.for_run(ctx).recover(RuntimeError("actor died"), "step 5")
    assert ctx.policy.restarts == []


def test_a_lost_node_moves_its_workers_when_the_others_can_hold_them_else_the_run_stops():
    lost = [(0, "was lost with its node 10.0.0.9", "10.0.0.9")]
    ctx = FakeCtx(generation_dead=lost)
    assert RunRecovery.for_run(ctx).recover(RuntimeError("actor unavailable"), "step 2") is Replay.STEP
    ctx = FakeCtx(generation_dead=lost)
    ctx.generation.worker_group.cluster.problem = "VirtualCluster 'generation' lost node(s) 10.0.0.9 and the remaining " \
                                                  "nodes cannot hold its 1 node group(s) there: GPU: asked 8, the cluster has 0"
    with pytest.raises(RunStopped, match=r"^generation worker rank 0 \(node 10.0.0.1\) was lost with its node 10.0.0.9; "
                                         r"VirtualCluster 'generation' .* cannot hold .*; GRPO stopped after step 4"):
        RunRecovery.for_run(ctx).recover(RuntimeError("actor unavailable"), "step 2")
    assert ctx.generation.restarts == []


def test_a_dead_critic_worker_is_rebuilt_and_the_run_goes_back_to_its_checkpoint(tmp_path, capsys):
    ctx = with_critic(FakeCtx(), dead=[(0, DIED, None)])
    (tmp_path / "ckpt" / "step_2").mkdir(parents=True)
    (tmp_path / "ckpt" / "step_2" / "training_info.json").write_text('{"step": 2}')
    recovery = RunRecovery.for_run(ctx)
    assert recovery.recover(RuntimeError("actor died"), "step 3") is Replay.FROM_CHECKPOINT
    # The loop loads the checkpoint into both trained groups; only the dead one is rebuilt.
    assert ctx.critic.restarts == [()] and ctx.policy.restarts == [] and ctx.generation_stale
    assert capsys.readouterr().out == (
        f"[posttrain] recovery 1 of 3: critic worker rank 0 (node 10.0.0.1) {DIED}; rebuilding the critic workers, "
        "then loading the last checkpoint, replaying from the last checkpoint\n")
    assert recovery.metrics()["recovery/restarts/critic"] == 1.0 and "recovery/restarts/teacher" not in recovery.metrics()
    hung = WorkerTimeoutError("WorkerGroup 'critic': stopped answering: rank 0", group="critic", ranks=[0])
    assert recovery.recover(hung, "step 3") is Replay.FROM_CHECKPOINT and ctx.critic.restarts == [(), ()]
    ctx = with_critic(FakeCtx(checkpointing=False), dead=[(1, DIED, None)])
    with pytest.raises(RunStopped, match=r"^critic worker rank 1 .*rebuilding a critic worker needs a checkpoint"):
        RunRecovery.for_run(ctx).recover(RuntimeError("actor died"), "step 3")


def test_going_back_before_the_first_checkpoint_restarts_every_trained_group(capsys):
    # A generation worker died after the update of step 1 (no checkpoint yet): the policy and the
    # critic both trained since their initial weights, so both start again from them.
    ctx = with_critic(FakeCtx(generation_dead=[(0, DIED, None)]))
    assert RunRecovery.for_run(ctx).recover(RuntimeError("actor died"), "step 1", trained=True) is Replay.FROM_CHECKPOINT
    assert ctx.policy.restarts == [()] and ctx.critic.restarts == [()]
    assert capsys.readouterr().out.endswith(
        "replaying from the last checkpoint (training had already begun in step 1) (none yet: the policy and the "
        "critic start again from their initial weights, at step 1)\n")
    ctx = with_critic(FakeCtx(policy_dead=[(0, DIED, None)]))
    assert RunRecovery.for_run(ctx).recover(RuntimeError("actor died"), "step 1") is Replay.FROM_CHECKPOINT
    assert ctx.policy.restarts == [()] and ctx.critic.restarts == [()]


def test_a_dead_teacher_is_rebuilt_from_its_model_and_the_step_replayed(capsys):
    ctx = FakeDistillCtx(teacher_dead=[(0, DIED, None)])
    recovery = RunRecovery.for_run(ctx)
    assert recovery.recover(WorkerError("WorkerGroup 'teacher': rank 0 failed"), "step 4") is Replay.STEP
    assert ctx.teachers["teacher"].restarts == [()] and ctx.teachers["teachers.code"].restarts == []
    assert ctx.policy.restarts == [] and ctx.generation.restarts == []
    assert capsys.readouterr().out == (
        f"[posttrain] recovery 1 of 3: teacher worker rank 0 (node 10.0.0.1) {DIED}; rebuilding the teacher workers "
        "(weights from the teacher's model), replaying step 4\n")
    hung = WorkerTimeoutError("WorkerGroup 'teachers_code': no answer", group="teachers_code", ranks=[0])
    assert recovery.recover(hung, "step 4") is Replay.STEP and ctx.teachers["teachers.code"].restarts == [()]
    assert recovery.metrics()["recovery/restarts/teacher"] == 2.0


# ------------------------------------------------------------------------------ the loop's side
class ScriptedRecovery:
    """Answers each failure with the next of `replays`, rebuilding the fake policy from scratch for
    a `FROM_CHECKPOINT` (as `Policy.restart` does)."""

    def __init__(self, policy, replays):
        self.policy, self.replays, self.seen = policy, list(replays), []

    def recover(self, error, what, trained=False):
        self.seen.append((str(error), what, trained))
        replay = self.replays.pop(0) if self.replays else None
        if replay is Replay.FROM_CHECKPOINT:
            self.policy.weights = 0
        return replay

    def metrics(self):
        return {"recovery/restarts": float(len(self.seen))}

    def records(self):
        """As `RunRecovery.records`: the failures so far, on the first step logged after one."""
        if len(self.seen) == getattr(self, "logged", 0):
            return {}
        self.logged = len(self.seen)
        return {"recovery/failures": [f"{what}: {error}" for error, what, _ in self.seen]}


def fail_once_at(failures, step, message):
    """Raise `message` as a dead worker would, once for each step of `failures` (popped in order)."""
    if failures and failures[0] == step:
        failures.pop(0)
        raise RuntimeError(message)


def failing_step_fn(policy, loader, fail_at, on_draw=lambda step, batch: None):
    """A training step for the fake loop: draws a batch (`on_draw(step, batch)` sees it), fails
    once in each step of `fail_at` before its update, and otherwise trains the fake policy once."""
    failures = list(fail_at)

    def step_fn(step, timer):
        on_draw(step, loader.next_batch())
        fail_once_at(failures, step, f"a worker died in step {step}")
        policy.weights += 1
        return {"train/loss": 1.0}

    return step_fn


def run_with_failures(tmp_path, fail_at, replays):
    """Five steps, `step_fn` failing once at each step of `fail_at`; (steps drawn, metrics by step, policy)."""
    cfg = cfg_for(tmp_path, "sft.val_at_start=false", "sft.val_period=0", "sft.val_at_end=false")
    policy, loader = FakePolicy(), FakeLoader()
    drawn = []
    train = failing_step_fn(policy, loader, fail_at, on_draw=lambda step, batch: drawn.append((step, batch[0])))

    def step_fn(step, timer):
        metrics = train(step, timer)
        loop.state["trained"] = loop.state.get("trained", 0) + 1
        return metrics

    loop = make_loop(cfg, policy, loader)
    recovery = ScriptedRecovery(policy, replays)
    loop.run(step_fn, lambda: {}, recovery=recovery)
    metrics = read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl")
    return drawn, metrics, policy, loop, recovery


def test_a_failed_step_is_replayed_with_the_prompts_it_drew(tmp_path):
    drawn, metrics, policy, loop, recovery = run_with_failures(tmp_path, [3], [Replay.STEP])
    assert drawn == [(1, 1), (2, 2), (3, 3), (3, 3), (4, 4), (5, 5)]
    assert recovery.seen == [("a worker died in step 3", "step 3", False)]
    assert sorted(metrics) == [1, 2, 3, 4, 5] and policy.weights == 5 and loop.state["trained"] == 5
    assert [metrics[s]["recovery/restarts"] for s in (2, 3)] == [0.0, 1.0]
    assert metrics[3]["recovery/failures"] == ["step 3: a worker died in step 3"]  # the first step logged after it
    assert "recovery/failures" not in metrics[4]
    from posttrain.utils.report import recovery_failures

    assert recovery_failures(metrics) == ["step 3: a worker died in step 3"]


def test_a_rebuilt_policy_sends_the_loop_back_to_its_last_checkpoint(tmp_path):
    # Checkpoints every 2 steps: a failure in step 5 goes back to step 4; one in step 3 (before a
    # later checkpoint) to step 2.
    drawn, metrics, policy, loop, _ = run_with_failures(tmp_path, [3, 5], [Replay.FROM_CHECKPOINT] * 2)
    assert drawn == [(1, 1), (2, 2), (3, 3), (3, 3), (4, 4), (5, 5), (5, 5)]
    assert sorted(metrics) == [1, 2, 3, 4, 5] and policy.weights == 5 and loop.state["trained"] == 5


def test_a_step_that_failed_after_its_update_goes_back_to_the_checkpoint_rather_than_train_twice(tmp_path, capsys):
    # The loop tells the recovery (the policy counts its updates, `Policy.updates`)...
    cfg = cfg_for(tmp_path, "sft.val_at_start=false", "sft.val_period=0", "sft.val_at_end=false")
    policy, loader = FakePolicy(), FakeLoader()
    policy.updates = 0
    failures = [3]

    def step_fn(step, timer):
        loader.next_batch()
        policy.updates += 1
        policy.weights += 1
        fail_once_at(failures, step, "a generation worker died after the update")
        return {"train/loss": 1.0}

    recovery = ScriptedRecovery(policy, [Replay.FROM_CHECKPOINT])
    loop = make_loop(cfg, policy, loader)
    loop.run(step_fn, lambda: {}, recovery=recovery)
    assert [seen[2] for seen in recovery.seen] == [True]
    assert policy.weights == 5  # step 3's update counted once: back to step 2's checkpoint, then 3 to 5
    # ...which rebuilds what died, goes back to the checkpoint, and says why.
    ctx = FakeCtx(generation_dead=[(0, DIED, None)])
    ctx.cfg.checkpointing.checkpoint_dir = tmp_path / "no-checkpoint-yet"
    assert RunRecovery.for_run(ctx).recover(RuntimeError("actor died"), "step 3", trained=True) is Replay.FROM_CHECKPOINT
    assert ctx.generation.restarts == ["forget", ("metadata",)]
    assert ctx.policy.restarts == [()]  # no checkpoint yet: the policy starts from its initial weights
    assert "replaying from the last checkpoint (training had already begun in step 3)" in capsys.readouterr().out
    ctx = FakeCtx(generation_dead=[(0, DIED, None)], checkpointing=False)
    with pytest.raises(RunStopped, match="training had already begun in step 3, so replaying it needs a checkpoint"):
        RunRecovery.for_run(ctx).recover(RuntimeError("actor died"), "step 3", trained=True)


def test_an_error_recovery_cannot_fix_is_raised_as_it_was(tmp_path):
    with pytest.raises(RuntimeError, match="a worker died in step 2"):
        run_with_failures(tmp_path, [2], [])


def test_going_back_to_the_start_keeps_the_first_validation_and_the_step_labels(tmp_path, capsys):
    # Step 2 fails before the first checkpoint (the run starts again at step 1), step 5 after the
    # one of step 3 (back to step 3).
    cfg = cfg_for(tmp_path, "sft.val_at_start=true", "sft.val_period=0", "sft.val_at_end=true",
                  "checkpointing.save_period=3", "logger.progress_bar=true")
    policy, loader = FakePolicy(), FakeLoader()
    loop = make_loop(cfg, policy, loader)
    recovery = ScriptedRecovery(policy, [Replay.FROM_CHECKPOINT] * 2)
    loop.run(failing_step_fn(policy, loader, [2, 5]), lambda: {"validation/accuracy": 0.2 + 0.1 * policy.weights},
             recovery=recovery)
    labels = [line.split()[2] for line in capsys.readouterr().err.splitlines() if line.startswith("SFT step ")]
    assert labels == ["1/5", "1/5", "2/5", "3/5", "4/5", "4/5", "5/5"]  # each step's own number, after each rewind
    metrics = read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert sorted(metrics) == [0, 1, 2, 3, 4, 5] and metrics[0]["validation/accuracy"] == pytest.approx(0.2)
    assert [step for step, _ in loop.history] == [0, 5]
    assert loop.headline_change() == (pytest.approx(0.2), pytest.approx(0.7))  # "before" is the initial weights'


def test_a_step_that_failed_after_only_the_critic_trained_is_not_trained_twice(tmp_path):
    # PPO's warm-up: the critic trains, the policy does not; the loop counts both.
    cfg = cfg_for(tmp_path, "sft.val_at_start=false", "sft.val_period=0", "sft.val_at_end=false")
    policy, critic, loader = FakePolicy(), FakePolicy(), FakeLoader()
    policy.updates = critic.updates = 0
    failures = [2]

    def step_fn(step, timer):
        loader.next_batch()
        critic.updates += 1
        fail_once_at(failures, step, "a generation worker died after the critic's update")
        return {"train/loss": 1.0}

    loop = make_loop(cfg, policy, loader)
    loop.trained_beside["critic"] = critic
    recovery = ScriptedRecovery(policy, [Replay.FROM_CHECKPOINT])
    loop.run(step_fn, lambda: {}, recovery=recovery)
    assert [seen[2] for seen in recovery.seen] == [True]


def test_restart_counts_and_failures_are_kept_beside_the_checkpoints_for_a_rerun(tmp_path, monkeypatch):
    import json

    recovery = RunRecovery.for_run(FakeCtx(env_dead=[("math", DIED)], max_restarts=2))
    assert recovery.recover(RuntimeError("actor died"), "step 3") is Replay.STEP
    assert recovery.records() == {"recovery/failures": [f"step 3: environment 'math' {DIED}"]}
    assert recovery.records() == {}  # on the first step logged after the failure only
    # A rerun of the command (the same checkpoint directory) goes on counting...
    rerun = RunRecovery.for_run(FakeCtx(env_dead=[("math", DIED)], max_restarts=2))
    assert rerun.metrics()["recovery/restarts"] == 1.0 and rerun.metrics()["recovery/restarts/environment"] == 1.0
    assert rerun.records() == {}  # logged by the run that made it
    assert rerun.recover(RuntimeError("actor died"), "step 4") is Replay.STEP
    assert rerun.budget.exhausted()
    # ...so max_restarts bounds the run, not each process.
    with pytest.raises(RunStopped) as stopped:
        RunRecovery.for_run(FakeCtx(env_dead=[("math", DIED)], max_restarts=2)).recover(RuntimeError("actor died"), "step 5")
    assert f"no restart left (cluster.max_restarts=2, 2 of them made by earlier runs of this command ({tmp_path}" \
           "/ckpt/recovery.json); raise cluster.max_restarts to allow more)" in str(stopped.value)
    record = json.loads((tmp_path / "ckpt" / "recovery.json").read_text())
    assert record["restarts"] == 2 and record["per_kind"]["environment"] == 2
    assert record["failures"] == [f"step {step}: environment 'math' {DIED}" for step in (3, 4, 5)]
    # A fresh checkpoint directory starts at 0; without checkpointing nothing is kept.
    monkeypatch.setattr(FakeCtx, "checkpoint_dir", tmp_path / "fresh")
    assert RunRecovery.for_run(FakeCtx()).metrics()["recovery/restarts"] == 0.0
    unkept = RunRecovery.for_run(FakeCtx(env_dead=[("math", DIED)], checkpointing=False))
    assert unkept.recover(RuntimeError("actor died"), "step 1") is Replay.STEP
    assert not (tmp_path / "fresh").exists()
    (tmp_path / "ckpt" / "recovery.json").write_text("[1, 2")  # a torn or foreign file: one line, no traceback
    monkeypatch.setattr(FakeCtx, "checkpoint_dir", tmp_path / "ckpt")
    with pytest.raises(UserError, match=r"recovery.json: not a restart record .*delete it to count restarts from 0"):
        RunRecovery.for_run(FakeCtx())


def test_a_run_that_replays_only_from_checkpoints_goes_back_after_any_failure(tmp_path, capsys):
    # Async GRPO: its rollouts run ahead of its steps, so even a generation worker's death goes back.
    ctx = FakeCtx(generation_dead=[(0, DIED, None)])
    (tmp_path / "ckpt" / "step_2").mkdir(parents=True)
    (tmp_path / "ckpt" / "step_2" / "training_info.json").write_text('{"step": 2}')
    recovery = RunRecovery.for_run(ctx)
    recovery.replay_from_checkpoint = "the collector's rollouts run ahead of the steps"
    assert recovery.recover(WorkerError("WorkerGroup 'generation': rank 0 failed"), "step 3") is Replay.FROM_CHECKPOINT
    assert ctx.generation.restarts == [("metadata",)] and ctx.policy.restarts == [] and ctx.generation_stale
    assert capsys.readouterr().out == (
        f"[posttrain] recovery 1 of 3: generation worker rank 0 (node 10.0.0.1) {DIED}; rebuilding the generation "
        "workers (weights refit from the policy), replaying from the last checkpoint (the collector's rollouts "
        "run ahead of the steps)\n")
    ctx = FakeCtx(env_dead=[("math", DIED)], checkpointing=False)
    recovery = RunRecovery.for_run(ctx)
    recovery.replay_from_checkpoint = "the collector's rollouts run ahead of the steps"
    with pytest.raises(RunStopped, match=r"^environment 'math' .*; the collector's rollouts run ahead of the steps, so a "
                                         r"failure replays from the last checkpoint, and checkpointing.enabled=false; "):
        recovery.recover(RuntimeError("actor died"), "step 3")
    assert ctx.envs.restarted == []


def test_the_algorithms_own_state_is_put_back_for_a_replay_and_restored_with_a_checkpoint(tmp_path):
    # Partial rollouts' carry-over: a step advances it; a replayed step starts from the one it began
    # with, a run sent back to a checkpoint from the one saved there (`on_rewind`), and the
    # algorithm hears of a failure before anything is rebuilt (`on_failure`).
    cfg = cfg_for(tmp_path, "sft.val_at_start=false", "sft.val_period=0", "sft.val_at_end=false")
    policy, loader = FakePolicy(), FakeLoader()
    carried, events = {"groups": []}, []

    def carry(step, batch):  # what the step carries over to the next
        carried["groups"] = carried["groups"] + [step]

    step_fn = failing_step_fn(policy, loader, [3, 5], on_draw=carry)
    loop = make_loop(cfg, policy, loader)
    loop.replay_extras = (lambda: list(carried["groups"]), lambda taken: carried.update(groups=taken))
    loop.on_failure = lambda: events.append(("failure", list(carried["groups"])))
    loop.on_rewind = lambda checkpoint: events.append(("rewind", checkpoint.name if checkpoint else None))
    recovery = ScriptedRecovery(policy, [Replay.STEP, Replay.FROM_CHECKPOINT])
    loop.run(step_fn, lambda: {}, recovery=recovery)
    # Step 3 failed with [1, 2, 3] carried and was replayed from [1, 2]; step 5 sent the run back to
    # step 4's checkpoint (the fake keeps its carry-over as it was: the algorithm restores its own).
    assert events == [("failure", [1, 2, 3]), ("failure", [1, 2, 3, 4, 5]), ("rewind", "step_4")]
    assert carried["groups"] == [1, 2, 3, 4, 5, 5] and policy.weights == 5 and loop.step == 5
