"""A run's recovery from dead or hung workers (`cluster.max_restarts`).

    ctx.recovery = RunRecovery.for_run(ctx)      # build_on_policy_run; None with the local backend
    ctx.loop.run(step_fn, validate_fn, recovery=ctx.recovery)
    RunRecovery.for_run(TrainerRun(cfg, policy, loop))   # SFT, DPO, RM (`loop.train_offline`)

When a step fails, the loop asks `recover(error, "step 3")`. It finds who failed: the members Ray
reports dead (`WorkerGroup.faults`, `EnvironmentActors.faults`: policy workers, PPO's critic
workers, distillation's teachers, generation workers, environment actors, all of those on a lost
node) and the ones a timeout names (no heartbeat, or no answer within `cluster.worker_timeout_s`).
It says which and why in one line, rebuilds them, each the way it knows (`Policy.restart` for the
policy and the critic, then the loop reloads the last checkpoint; `Policy.restart` for a teacher,
whose weights are its model's; `WorkerGroupGeneration.restart`, then the next step refits it from
the policy; `EnvironmentActors.restart`), and tells the loop what to replay (`Replay`). An error
nobody died of (a bug, a NaN loss) is not recovered: `recover` returns None and the loop raises it
as it was. Past `cluster.max_restarts` recoveries, or when what failed cannot be rebuilt (a policy
or critic worker without checkpoints; a lost node whose work the other nodes cannot hold), the run
stops with `RunStopped`: one line, and the last checkpoint whole.

A run that goes back before its first checkpoint starts every trained group (policy and critic)
again from its initial weights, as a rerun would. Async GRPO goes back to the last checkpoint after
any failure (`replay_from_checkpoint`): its rollouts run ahead of its steps, and its replay buffer
and prompt position agree only in a checkpoint.

With `checkpointing.enabled`, the restart counts and each failure's line are kept beside the
checkpoints (`<checkpoint_dir>/recovery.json`, written at every failure), so a rerun of the command
goes on counting: `cluster.max_restarts` bounds the run, not each process (a fresh checkpoint
directory starts at 0). Every logged step carries the counts; the first one after a failure also
carries `recovery/failures`, every failure's line so far.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from posttrain.distributed import actors
from posttrain.distributed.recovery import (
    BASE_KINDS,
    RECORD_FILE,
    TRAINED_KINDS,
    Fault,
    Replay,
    RestartBudget,
    describe,
    load_record,
    save_record,
)
from posttrain.errors import RunStopped

# How long to wait for Ray to say whether an actor that cannot be reached is dead: a lost node is
# declared dead only once its health checks have failed for a while.
SETTLE_S = 90.0
# After any other worker failure (a collective that broke because its peer died, say), how long to
# look for a death Ray has not recorded yet before the failure counts as the worker's own error.
WORKER_ERROR_SETTLE_S = 3.0


@dataclass
class TrainerRun:
    """What recovery reads of a trainer's run on a fixed data set (SFT, DPO, RM: `loop.train_offline`),
    in the names of an `OnPolicyContext`: one policy group (a DPO reference lives in its workers),
    no generation engine, no environments."""

    cfg: Any
    policy: Any
    loop: Any
    generation: Any = None
    envs: Any = None
    refit_metadata: Any = None
    generation_stale: bool = False


@dataclass(frozen=True)
class Rebuildable:
    """A worker group of the run that recovery can rebuild.

    Args:
        kind: "policy", "critic", "teacher" or "generation" (`recovery.KINDS`).
        label: the group in messages: its kind, or a teacher's key ("teachers.math").
        part: what owns the group and restarts it (`Policy.restart`, `WorkerGroupGeneration.restart`).
    """

    kind: str
    label: str
    part: Any

    @property
    def group(self) -> Any:
        return self.part.worker_group


class RunRecovery:
    """Recovery of the run `ctx` (an `OnPolicyContext`, or a `TrainerRun`): its policy, critic,
    teachers, generation engine and environments, at most `max_restarts` times (`cluster.max_restarts`)."""

    def __init__(self, ctx: Any, max_restarts: int, settle_s: float = SETTLE_S) -> None:
        self.ctx, self.settle_s = ctx, settle_s
        self.budget = RestartBudget(max_restarts, {*BASE_KINDS, *(member.kind for member in self.rebuildable())})
        checkpointing = ctx.cfg.checkpointing
        self.record_dir = checkpointing.checkpoint_dir if checkpointing.enabled else None
        record = load_record(self.record_dir) if self.record_dir is not None else None
        if record is not None:
            self.budget.load_state_dict(record)
        self._failures_logged = len(self.budget.failures)
        # Why every failure goes back to the last checkpoint, when it does (async GRPO: its
        # rollouts run ahead of its steps, and its replay buffer and prompt position agree only
        # in a checkpoint); None: only a failure that lost trained state does.
        self.replay_from_checkpoint: Optional[str] = None

    @classmethod
    def for_run(cls, ctx: Any) -> Optional["RunRecovery"]:
        """The run's recovery; None with the local backend, whose workers are this process (or a
        policy not built on a worker group)."""
        group = getattr(ctx.policy, "worker_group", None)
        if group is None or group.is_local:
            return None
        return cls(ctx, ctx.cfg.cluster.max_restarts)

    def metrics(self) -> dict[str, float]:
        """`recovery/restarts` (cumulative) and `recovery/restarts/<kind>`, for every logged step."""
        return self.budget.metrics()

    def records(self) -> dict[str, list[str]]:
        """`{"recovery/failures": every failure's line so far}` for the first step logged after a
        failure (else {}). A rewind drops the logged steps after its checkpoint, and always comes
        with a new failure, so the last step logged with the list has it whole."""
        if len(self.budget.failures) == self._failures_logged:
            return {}
        self._failures_logged = len(self.budget.failures)
        return {"recovery/failures": list(self.budget.failures)}

    def _note(self, what: str, failed: str) -> None:
        """Add the failure's line to the record and keep the record beside the checkpoints."""
        self.budget.failures.append(f"{what}: {failed}")
        if self.record_dir is not None:
            save_record(self.record_dir, self.budget.state_dict())

    # ------------------------------------------------------------------------------ recover
    def recover(self, error: BaseException, what: str, trained: bool = False) -> Optional[Replay]:
        """Rebuild what failed in `error`, raised by `what` ("step 3", "the validation at step 3"),
        and say what to replay; None when no member failed (the caller raises `error`). Raises
        `RunStopped` when it cannot go on. `trained`: the policy or the critic had already trained
        in the failed step, so replaying the step on top of it would train twice: the run goes back
        to the last checkpoint instead (default False)."""
        faults = self.find_faults(error)
        if not faults:
            return None
        failed = describe(faults)
        kinds = {fault.kind for fault in faults}
        if self.budget.exhausted():
            self._note(what, failed)
            earlier = ""
            if self.budget.earlier:
                earlier = (f", {self.budget.earlier} of them made by earlier runs of this command ("
                           f"{self.record_dir}/{RECORD_FILE}); raise cluster.max_restarts to allow more")
            raise RunStopped(f"{failed}; no restart left (cluster.max_restarts={self.budget.max_restarts}{earlier}); "
                             f"{self.ctx.loop.resume_point()}") from None
        # First whether the lost work can be placed at all: when it cannot, that is the reason,
        # whichever phase of the step the failure came in.
        problem = self._placement_problem(faults)
        if problem is not None:
            self._note(what, failed)
            raise RunStopped(f"{failed}; {problem}; {self.ctx.loop.resume_point()}") from None
        lost_state = [kind for kind in TRAINED_KINDS if kind in kinds]
        rewind = bool(lost_state) or trained or self.replay_from_checkpoint is not None
        if rewind and not self.ctx.cfg.checkpointing.enabled:
            if lost_state:
                why = f"rebuilding a {lost_state[0]} worker needs a checkpoint to restore the weights and optimizer from"
            elif self.replay_from_checkpoint is not None:
                why = f"{self.replay_from_checkpoint}, so a failure replays from the last checkpoint"
            else:
                why = f"training had already begun in {what}, so replaying it needs a checkpoint to go back to"
            self._note(what, failed)
            raise RunStopped(f"{failed}; {why}, and checkpointing.enabled=false; {self.ctx.loop.resume_point()}") from None
        from posttrain.utils.checkpoint import complete_checkpoints

        from_start = rewind and not complete_checkpoints(self.ctx.cfg.checkpointing.checkpoint_dir)
        number = self.budget.record(kinds)
        self._note(what, failed)
        print(f"[posttrain] recovery {number} of {self.budget.max_restarts}: {failed}; "
              f"{self._plan(kinds, what, trained, from_start)}", flush=True)
        from posttrain.distributed.cluster import ClusterError
        from posttrain.distributed.worker_group import WorkerError

        try:
            self._rebuild(faults, rewind, from_start)
        except (ClusterError, WorkerError) as rebuild_error:
            reason = str(rebuild_error).splitlines()[0]
            raise RunStopped(f"{failed}; rebuilding failed: {reason}; {self.ctx.loop.resume_point()}") from None
        return Replay.FROM_CHECKPOINT if rewind else Replay.STEP

    def _plan(self, kinds: set[str], what: str, trained: bool, from_start: bool) -> str:
        """What recovery does next, in words (`from_start`: there is no checkpoint to go back to yet)."""
        parts = []
        if "environment" in kinds:
            parts.append("restarting the environment")
        if "teacher" in kinds:
            parts.append("rebuilding the teacher workers (weights from the teacher's model)")
        for kind in TRAINED_KINDS:
            if kind in kinds:
                parts.append(f"rebuilding the {kind} workers, then loading the last checkpoint")
        if "generation" in kinds:
            parts.append("rebuilding the generation workers (weights refit from the policy)")
        if kinds & set(TRAINED_KINDS):
            replay = "replaying from the last checkpoint"
        elif self.replay_from_checkpoint is not None:
            replay = f"replaying from the last checkpoint ({self.replay_from_checkpoint})"
        elif trained:
            replay = f"replaying from the last checkpoint (training had already begun in {what})"
        else:
            replay = f"replaying {what}"
        if from_start:
            groups = [member.kind for member in self.rebuildable() if member.kind in TRAINED_KINDS]
            again = (f"the {groups[0]} starts again from its" if len(groups) == 1 else
                     f"the {' and the '.join(groups)} start again from their")
            replay += f" (none yet: {again} initial weights, at step 1)"
        return ", ".join(parts) + f", {replay}"

    def find_faults(self, error: BaseException) -> list[Fault]:
        """The members that failed: those Ray reports dead, and those a timeout in `error` names.
        When `error` says an actor cannot be reached but none is dead yet (a node being lost), wait
        up to `settle_s` for Ray to decide; after another worker's failure, a few seconds."""
        from posttrain.distributed.worker_group import WorkerError

        settle = self.settle_s if actors.is_actor_failure(error) else WORKER_ERROR_SETTLE_S if isinstance(
            error, WorkerError) else 0.0
        deadline = time.monotonic() + settle
        while True:
            faults = self._dead_members() + self._hung_members(error)
            if faults or time.monotonic() >= deadline:
                return faults
            time.sleep(0.5)

    def rebuildable(self) -> list[Rebuildable]:
        """The worker groups it can rebuild: the policy's, PPO's critic's, distillation's teachers',
        and the generation engine's when it is built on a worker group (`WorkerGroupGeneration`;
        an engine of the user's may not be)."""
        ctx = self.ctx
        members = [Rebuildable("policy", "policy", ctx.policy)]
        if getattr(ctx, "critic", None) is not None:
            members.append(Rebuildable("critic", "critic", ctx.critic))
        teacher_groups = getattr(ctx, "teacher_groups", None)
        for key, teacher in (teacher_groups().items() if teacher_groups is not None else ()):
            if teacher is not None:
                members.append(Rebuildable("teacher", key, teacher))
        if hasattr(ctx.generation, "restart") and hasattr(ctx.generation, "worker_group"):
            members.append(Rebuildable("generation", "generation", ctx.generation))
        return members

    def _dead_members(self) -> list[Fault]:
        faults = []
        for member in self.rebuildable():
            for rank, cause, lost_node in member.group.faults():
                faults.append(Fault(member.kind, f"{member.label} worker {member.group.describe_rank(rank)}", cause,
                                    lost_node, name=member.label))
        envs = self.ctx.envs
        for env, cause in (envs.faults() if hasattr(envs, "faults") else []):
            faults.append(Fault("environment", f"environment {env!r}", cause, name=env))
        return faults

    def _hung_members(self, error: BaseException) -> list[Fault]:
        """Members named by a `WorkerTimeoutError` in `error`'s chain (no heartbeat, no progress within
        its phase's bound, or no answer in time)."""
        from posttrain.distributed.worker_group import WorkerTimeoutError
        from posttrain.environments.registry import ENV_GROUP_PREFIX

        members = {member.group.name: member for member in self.rebuildable()}
        seen: set[int] = set()
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            if isinstance(error, WorkerTimeoutError):
                cause = "hung: " + str(error).split(": ", 1)[-1].splitlines()[0]
                member = members.get(error.group)
                if member is not None:
                    return [Fault(member.kind, f"{member.label} workers", cause, name=member.label)]
                if error.group.startswith(ENV_GROUP_PREFIX):
                    env = error.group[len(ENV_GROUP_PREFIX):]
                    return [Fault("environment", f"environment {env!r}", cause, name=env)]
            error = error.__cause__ or error.__context__
        return []

    def _placement_problem(self, faults: list[Fault]) -> Optional[str]:
        """Why the groups that lost members with a node cannot be placed again on the live nodes
        (`VirtualCluster.lost_node_problem`); None when they can, or when no node was lost."""
        lost = {fault.name for fault in faults if fault.lost_node}
        for member in self.rebuildable():
            check = getattr(member.group.cluster, "lost_node_problem", None) if member.label in lost else None
            problem = check() if check is not None else None
            if problem is not None:
                return problem
        return None

    # ------------------------------------------------------------------------------ rebuild
    def _rebuild(self, faults: list[Fault], rewind: bool, from_start: bool) -> None:
        """Environments first (they hold no state), then the teachers (their weights are their
        model's), then the trained groups (new process groups; the loop loads the last checkpoint
        into them: `rewind`), then generation, which the next step refits. A run going back to its
        last checkpoint with none yet (`from_start`) starts every trained group again from its
        initial weights, as a rerun would (also those that did not fail: they trained since)."""
        ctx = self.ctx
        for env in sorted({fault.name for fault in faults if fault.kind == "environment"}):
            ctx.envs.restart(env)
        failed = {fault.name for fault in faults if fault.kind != "environment"}
        kinds = {fault.kind for fault in faults}
        members = self.rebuildable()
        for member in members:
            if member.kind == "teacher" and member.label in failed:
                member.part.restart()
        for member in members:
            if member.kind in TRAINED_KINDS and (member.label in failed or from_start):
                member.part.restart()
                if member.kind == "policy":
                    forget = getattr(ctx.generation, "forget_refit_channel", None)
                    if forget is not None:
                        forget()  # the broadcast group's sender, policy rank 0, is a new process
        if "generation" in kinds:
            ctx.generation.restart(ctx.refit_metadata)
        if kinds & {"policy", "generation"} or rewind:
            ctx.generation_stale = True
