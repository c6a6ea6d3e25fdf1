"""Asynchronous GRPO: generation and training overlap instead of taking turns.

    collector thread:  draw prompts -> roll out groups (generation workers + environments) -> buffer
    trainer (loop):    buffer.take(num_prompts_per_step) -> previous logprobs on current weights
                       -> train (importance-weighted) -> refit generation -> next step

Generation runs on workers of its own (`policy.generation.colocated.enabled=false`), so while the
policy trains step s on one set of cores, the collector generates the groups of step s+1 on
another with weights up to `grpo.async_grpo.max_trajectory_age_steps` steps old. The loss
corrects that staleness with the importance weights exp(logp_prev - logp_generation), where the
previous logprobs are recomputed on the current weights (required by a config check; the
truncation modes `tis`, `icepop`, `seq-mask-tis` apply). NeMo-RL's async GRPO works the same way;
unlike it, the collector is a thread of the controller (it only waits on Ray workers and
environment actors), so its death is seen at once, not after a timeout.

Refit: the collector holds a lock only around each generation call. After each step the trainer
takes it (waiting at most for the generation call in flight), copies the new weights in and
lets go, so environments keep stepping meanwhile and the collector pauses only as long as the
copy takes (`timing/train/idle/refit_bubble`; `timing/collector/paused` adds validation).

Staleness: a batch is started only when its groups will be trained within the age limit (the
collector counts the groups already queued ahead of it), so groups are evicted only when
something went wrong; those that are older are evicted and counted (`async/evicted_groups`).

No hangs: the trainer waits at most `buffer_timeout_s` for a step's groups and stops at once
when the collector died (with its error); environment calls still running after
`rollout_timeout_s` are abandoned and their groups dropped and counted (`async/dropped_groups`);
`max_consecutive_failed_rollouts` rollouts in a row that yield nothing stop the run with the
reason. Checkpoints hold the buffer and the loader position from before the batch in flight, so
a resumed run regenerates exactly the prompts that were not yet trained.

Recovery (`cluster.max_restarts`, Ray backend): a dead or hung worker, seen by the collector or
the trainer, stops the collector, is rebuilt (`run_recovery.RunRecovery`), and the run goes back
to its last checkpoint with a new collector, as a rerun would: the buffer and the loader position
agree only there (`async_grpo_train`).

PPO's asynchronous loop (`ppo.async_ppo_train`) is this one with its own update of a step's
batch (`async_grpo_train(ctx, update=...)`: the critic's values, GAE and critic update, then the
same importance-weighted policy update): the collector, buffer, staleness bound and refit are shared.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from posttrain.algorithms.experience import PromptGroup, roll_out_groups, training_batch, update_policy
from posttrain.algorithms.grpo_run import run_grpo, validate_grpo
from posttrain.algorithms.loop import prefixed
from posttrain.algorithms.on_policy import OnPolicyContext, refit_generation
from posttrain.algorithms.replay_buffer import AsyncRolloutError, ReplayBuffer
from posttrain.config.schema import GRPOMasterConfig
from posttrain.distributed.batch import Batch
from posttrain.utils.timer import Timer

log = logging.getLogger("posttrain.async_grpo")

BUFFER_FILE = "replay_buffer.pt"

# What a step does with the training batch of the groups it took: `update(ctx, train_data, step,
# timer)` -> metrics with their full names. GRPO's trains the policy; PPO's the critic first.
Update = Callable[[OnPolicyContext, Batch, int, Timer], dict[str, float]]


class GuardedGeneration:
    """The generation engine as the collector uses it: every generation call holds `lock` (the
    trainer takes it between calls to refit or validate), and the time spans it generated and
    waited for the lock are recorded."""

    def __init__(self, generation: Any, lock: threading.Lock):
        self.generation, self.lock = generation, lock
        self._spans: list[tuple[float, float]] = []  # (start, end) of recent generation calls
        self._lock_wait = 0.0
        self._stats = threading.Lock()

    @property
    def weights_version(self) -> int:
        return self.generation.weights_version

    def prepare_for_generation(self) -> None:
        self.generation.prepare_for_generation()

    def finish_generation(self) -> None:
        self.generation.finish_generation()

    def generate_shards(self, batch, greedy: bool = False, params: Optional[dict] = None):
        asked = time.monotonic()
        with self.lock:
            start = time.monotonic()
            try:
                yield from self.generation.generate_shards(batch, greedy=greedy, params=params)
            finally:
                with self._stats:
                    self._lock_wait += start - asked
                    self._spans = [*self._spans[-63:], (start, time.monotonic())]

    def generating_within(self, start: float, end: float) -> float:
        """Seconds of [start, end] during which a generation call ran (or runs: up to `end`)."""
        with self._stats:
            return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self._spans)

    def drain_lock_wait(self) -> float:
        """Seconds the collector waited for the lock since the last call."""
        with self._stats:
            wait, self._lock_wait = self._lock_wait, 0.0
            return wait


class TrajectoryCollector:
    """A thread that keeps rolling out prompt groups into the replay buffer (see the module doc).

    `problem()` says why it stopped, if it did; `snapshot()` is what a checkpoint saves.
    """

    def __init__(self, ctx: OnPolicyContext, buffer: ReplayBuffer, lock: threading.Lock):
        self.ctx, self.buffer = ctx, buffer
        self.cfg = ctx.cfg.grpo.async_grpo
        self.generation = GuardedGeneration(ctx.generation, lock)
        self.batches = 0  # rollout batches drawn: the sampling seeds' key
        self.consumed_steps = ctx.step  # takes by the trainer (it resumes at ctx.step)
        self.dropped = self.filtered = 0  # groups dropped at the deadline / without reward variance
        self._state = threading.Lock()  # guards the loader position and batches in flight vs the buffer
        self._loader_before_flight: Optional[dict] = None  # loader state before the batch in flight
        self._timer = Timer()  # the collector's own timings, drained by the trainer each step
        self._stop = threading.Event()
        self._error: Optional[str] = None
        self.exception: Optional[BaseException] = None  # what stopped it (a recovery reads who failed from it)
        self._activity = "starting"
        self._thread = threading.Thread(target=self._run, name="posttrain-trajectory-collector", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._state:  # once it returns, the thread draws no more prompts (a recovery resets the loader)
            self._stop.set()
        self.buffer.close()
        self._thread.join(timeout_s)  # a rollout in flight ends when its workers shut down

    def problem(self) -> Optional[str]:
        """Why the collector is not producing any more (None while it runs)."""
        if self._error:
            return self._error
        if not self._thread.is_alive() and not self._stop.is_set():
            return f"the collector thread exited while {self._activity}"
        return None

    # --------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        failed_in_row = 0
        try:
            while not self._stop.is_set():
                self._activity = "waiting for the trainer (staleness limit)"
                if not self._wait_until_fresh_enough():
                    return
                self._activity = f"rolling out batch {self.batches + 1}"
                with self._state:
                    if self._stop.is_set():
                        return
                    self._loader_before_flight = self.ctx.train_loader.state_dict()
                    prompts = self.ctx.train_loader.next_batch()
                    self.batches += 1
                    seed_key = self.batches
                groups, metrics = roll_out_groups(
                    self.ctx, prompts, seed_key, self._timer, generation=self.generation,
                    weight_version=self.generation.weights_version,
                    deadline=time.monotonic() + self.cfg.rollout_timeout_s,
                )
                ready = self._admit(groups, metrics)
                failed_in_row = 0 if ready or not any(g.timed_out for g in groups) else failed_in_row + 1
                if failed_in_row >= self.cfg.max_consecutive_failed_rollouts:
                    raise AsyncRolloutError(
                        f"{failed_in_row} rollout batches in a row yielded no group: their environments did not "
                        f"answer within grpo.async_grpo.rollout_timeout_s={self.cfg.rollout_timeout_s:g}s"
                    )
        except BaseException as e:  # the trainer reports it (problem()); never die silently
            if self._stop.is_set():  # the run is over: its workers went away under a rollout
                return
            self._error = f"{type(e).__name__}: {e} (while {self._activity})"
            self.exception = e
            log.error("trajectory collector stopped: %s", self._error)
        finally:
            with self._state:
                self._loader_before_flight = None

    def _admit(self, groups: list[PromptGroup], metrics: dict[str, float]) -> int:
        """Put the finished groups in the buffer (timed-out ones and, under dynamic sampling,
        those without reward variance are counted instead); returns how many went in."""
        dynamic = self.ctx.cfg.grpo.use_dynamic_sampling
        ready = [g for g in groups if not g.timed_out and (g.has_signal or not dynamic)]
        with self._state:
            self.dropped += sum(g.timed_out for g in groups)
            self.filtered += sum(not g.timed_out and dynamic and not g.has_signal for g in groups)
            for group in ready:
                group.rollout_metrics = metrics  # logged by the step that trains it
                if not self.buffer.put(group, self._stop):
                    break
            self._loader_before_flight = None
        return len(ready)

    def _wait_until_fresh_enough(self) -> bool:
        """Wait until a batch started now would be trained within the age limit: it is trained
        at trainer step `consumed + queued / P + 1`, whose weights are one step older than that."""
        per_step = self.ctx.cfg.grpo.num_prompts_per_step
        while not self._stop.is_set():
            trained_at_version = self.consumed_steps + len(self.buffer) // per_step
            if trained_at_version - self.generation.weights_version <= self.cfg.max_trajectory_age_steps:
                return True
            time.sleep(0.02)
        return False

    # ------------------------------------------------------------------------ trainer side
    def drain_timings(self) -> dict[str, float]:
        """The collector's timings since the last call (zeros when no rollout ended)."""
        with self._state:
            timer, self._timer = self._timer, Timer()
        return {"generation": 0.0, "reward": 0.0, **timer.get_timing_metrics()}

    def snapshot(self) -> tuple[dict, dict[str, Any]]:
        """(loader state, checkpoint files): the loader position from before any batch in flight,
        with the buffer's groups, so a resumed run regenerates the prompts not yet trained."""
        with self._state:
            loader_state = self._loader_before_flight or self.ctx.train_loader.state_dict()
            state = {"buffer": self.buffer.state_dict(), "batches": self.batches, "dropped": self.dropped,
                     "filtered": self.filtered}
        return loader_state, {BUFFER_FILE: state}

    def restore(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.batches, self.dropped, self.filtered = state["batches"], state["dropped"], state["filtered"]


# ------------------------------------------------------------------------------------ the loop
def run(cfg: GRPOMasterConfig) -> dict[str, Optional[float]]:
    """`posttrain grpo` with `grpo.async_grpo.enabled`: GRPO's run (`grpo_run.run_grpo`: warm
    start, set-up, summary) with the asynchronous loop."""
    if not cfg.grpo.async_grpo.enabled:
        raise ValueError("async_grpo.run needs grpo.async_grpo.enabled=true; grpo.run trains synchronously")
    return run_grpo(cfg, async_grpo_train)


def train_policy_off_policy(ctx: OnPolicyContext, train_data: Batch, step: int, timer: Timer) -> dict[str, float]:
    """GRPO's update of a step's (possibly stale) groups: previous logprobs on the current weights,
    then the importance-weighted policy update."""
    return prefixed(update_policy(ctx, train_data, timer, off_policy=True), "train")


def async_grpo_train(ctx: OnPolicyContext, update: Update = train_policy_off_policy) -> dict[str, float]:
    """Train from the context's step to its last step with a trajectory collector running beside;
    `update` trains on each step's batch (default: GRPO's `train_policy_off_policy`).

    With a recovery (`ctx.recovery`, the Ray backend), a failure stops the collector before the
    failed workers are rebuilt, and the run goes back to its last checkpoint (or its start), where
    a new collector starts from the replay buffer and prompt position saved there: what a rerun
    of the command would do, in process."""
    a, g = ctx.cfg.grpo.async_grpo, ctx.cfg.grpo
    lock = threading.Lock()
    collectors: list[TrajectoryCollector] = []  # the running one last

    def start_collector(checkpoint: Optional[Path]) -> None:
        """A collector with the replay buffer saved in `checkpoint` (None: empty), started on the
        policy's weights."""
        buffer = ReplayBuffer(capacity=g.num_prompts_per_step * (a.max_trajectory_age_steps + 1),
                              max_age=a.max_trajectory_age_steps)
        collector = TrajectoryCollector(ctx, buffer, lock)
        if checkpoint is not None and (checkpoint / BUFFER_FILE).exists():
            import torch

            collector.restore(torch.load(checkpoint / BUFFER_FILE, weights_only=False))
        _refit(ctx, lock, ctx.step)  # a resumed policy is newer than the generation's weights
        ctx.loop.checkpoint_extras = collector.snapshot
        collectors.append(collector)
        collector.start()

    def locked_validate() -> dict[str, float]:
        with lock:  # the collector pauses between generation calls
            return validate_grpo(ctx)

    if ctx.recovery is not None:
        ctx.recovery.replay_from_checkpoint = "the collector's rollouts run ahead of the steps"
        ctx.loop.on_failure = lambda: collectors[-1].stop()
        ctx.loop.on_rewind = start_collector
        ctx.loop.keep_start_position()  # before the collector draws
    start_collector(ctx.loop.checkpointer.latest() if ctx.step and ctx.cfg.checkpointing.enabled else None)
    try:
        return ctx.loop.run(lambda step, timer: async_grpo_step(ctx, collectors[-1], step, timer, update),
                            locked_validate, recovery=ctx.recovery)
    finally:
        collectors[-1].stop()


def async_grpo_step(ctx: OnPolicyContext, collector: TrajectoryCollector, step: int, timer: Timer,
                    update: Update = train_policy_off_policy) -> dict[str, float]:
    """One step: the oldest ready groups, `update` on their batch (GRPO's: previous logprobs on the
    current weights, the importance-weighted update), then refit."""
    cfg, a = ctx.cfg, ctx.cfg.grpo.async_grpo
    asked = time.monotonic()
    try:
        groups = collector.buffer.take(cfg.grpo.num_prompts_per_step, ctx.step, timeout=a.buffer_timeout_s,
                                       producer_error=collector.problem)
    except AsyncRolloutError as error:
        raise error from collector.exception  # a dead or hung worker in it is for the recovery to find
    got = time.monotonic()
    collector.consumed_steps = step
    timer.add("idle/buffer_starvation", got - asked)
    timer.add("exposed_generation", collector.generation.generating_within(asked, got))
    ages = collector.buffer.last_ages

    rollout_metrics = list({id(m): m for m in (getattr(g, "rollout_metrics", {}) for g in groups)}.values())
    train_data, metrics = training_batch(ctx, groups, groups, rollout_metrics)
    train_metrics = update(ctx, train_data, step, timer)
    with timer.time("weight_sync"):  # waiting for the generation call in flight, then the copy
        timer.add("idle/refit_bubble", _refit(ctx, collector.generation.lock, step))

    collector_timings = collector.drain_timings()
    collector_timings["paused"] = collector.generation.drain_lock_wait()  # refits and validation
    metrics.update({
        "async/trajectory_age_mean": sum(ages) / len(ages),
        "async/trajectory_age_max": float(max(ages)),
        "async/evicted_groups": float(collector.buffer.evicted),
        "async/dropped_groups": float(collector.dropped),
        "async/filtered_groups": float(collector.filtered),
        "async/buffer_size": float(len(collector.buffer)),
        **prefixed(collector_timings, "timing/collector"),
    })
    return {**metrics, **train_metrics}


def _refit(ctx: OnPolicyContext, lock: threading.Lock, version: int) -> float:
    """Copy the policy's weights (policy step `version`) into the generation workers, between two
    of the collector's generation calls; returns the seconds generation was held up (the refit
    bubble: the copy itself, not the wait for the call in flight)."""
    with lock:
        if ctx.generation.weights_version == version and not ctx.generation_stale:
            return 0.0
        start = time.perf_counter()
        refit_generation(ctx, version)
        return time.perf_counter() - start

