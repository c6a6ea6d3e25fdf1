"""Environment registry, construction (plain instance, Ray actor or local actor) and routing by task name.

A new environment is one decorated class:

    @register_env("my_task")
    class MyEnv(Environment):
        def __init__(self, cfg): ...
        def step(self, message_logs, metadata) -> EnvironmentReturn: ...

`route_step` lets one run mix environments: each sample carries a task name (`DataConfig.env_name`
by default), samples are grouped per environment, stepped (in parallel when the environments are
actors) and the results put back in the original order.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable, Optional, Sequence

import torch

from posttrain.distributed import actors
from posttrain.environments.interface import Environment, EnvironmentReturn, MessageLog
from posttrain.utils.registry import registrar, resolve

ENV_REGISTRY: dict[str, type[Environment]] = {}

# Modules whose import registers the built-in environments (imported on first lookup, not at
# start-up: they import torch, and `posttrain --help` or loading a config must stay fast). Each
# must import without its optional packages (import those inside the environment).
_BUILTIN_ENV_MODULES = (
    "posttrain.environments.math_env",
    "posttrain.environments.code_env",
    "posttrain.environments.mcqa_env",
    "posttrain.environments.structured_env",
    "posttrain.environments.instructions_env",
    "posttrain.environments.reasoning_gym_env",
    "posttrain.environments.sliding_puzzle_env",
    "posttrain.environments.textarena_env",
    "posttrain.environments.tools.tool_env",
    "posttrain.environments.http_env",
    "posttrain.environments.reward_model_env",
    "posttrain.judges.judge_env",  # above models in the layering (tests/unit/test_import_graph.py)
)


register_env = registrar(ENV_REGISTRY, "environment")
"""Class decorator: `@register_env("name")` makes the class available as `create_env("name", ...)`."""


def get_env_class(name: str) -> type[Environment]:
    """The class registered as `name`; a KeyError suggests the closest registered name."""
    for module in _BUILTIN_ENV_MODULES:
        importlib.import_module(module)
    return resolve(ENV_REGISTRY, name, "environment")


def resolve_env(name: str, section: Any) -> tuple[type[Environment], Any]:
    """`(class, config)` of the environment serving task `name`, from its `env.<name>` section.

    A section with `class_path` loads the user's class (`import_object`), one with `reward_fn` serves
    reward functions (`reward_fn_env.RewardFunctionEnv`); otherwise `name` must be registered. When the class declares `config_class` (a pydantic model), the section's other
    fields are validated into it; errors name the key `env.<name>.<field>` (a ValueError).
    """
    from posttrain.utils.registry import import_object

    fields = section
    if section is not None and not isinstance(section, dict):
        raise ValueError(f"env.{name} must be a section (class_path and the environment's fields), got {section!r}")
    if isinstance(section, dict) and section.get("class_path"):
        fields = {k: v for k, v in section.items() if k != "class_path"}
        cls = import_object(section["class_path"])
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ValueError(f"env.{name}.class_path={section['class_path']!r} is not an Environment subclass")
    elif isinstance(section, dict) and "reward_fn" in section:  # TRL-style reward functions
        from posttrain.environments.reward_fn_env import RewardFunctionEnv

        cls = RewardFunctionEnv
    else:
        cls = get_env_class(name)
    config_class = getattr(cls, "config_class", None)
    if config_class is not None and (fields is None or isinstance(fields, dict)):
        from pydantic import ValidationError

        try:
            fields = config_class.model_validate(fields or {})
        except ValidationError as e:
            first = e.errors()[0]
            key = "".join(f".{part}" for part in first["loc"])
            message = first["msg"].removeprefix("Value error, ")
            if first["type"] == "extra_forbidden" and len(first["loc"]) == 1:  # a mistyped field
                import difflib

                close = difflib.get_close_matches(str(first["loc"][0]), list(config_class.model_fields), n=1)
                message = f"unknown field of env.{name}" + (f"; did you mean env.{name}.{close[0]}?" if close else
                                                           f" (fields: {', '.join(config_class.model_fields)})")
            raise ValueError(f"env.{name}{key}: {message} (got {first.get('input')!r})") from None
    return cls, fields


def create_env(
    name: str, cfg: Any = None, as_actor: bool = True, num_cpus: float = 0.0, cls: Any = None, backend: str = "ray",
    beat_period_s: float = 0.0,
) -> Any:
    """Build the environment registered as `name`.

    Args:
        name: registry name, e.g. `"math"`.
        cfg: the environment's config (e.g. `MathEnvConfig`), passed to its constructor.
        as_actor: True returns an actor handle (call `handle.step.remote(...)`, or use
            `route_step`); False returns a plain instance, stepped in the caller's thread.
            Defaults to True.
        num_cpus: Ray CPUs the actor reserves. Defaults to 0 so the actor always schedules
            beside placement groups that reserve every CPU for policy / generation workers;
            environment work is light and its verifier processes are not Ray tasks anyway. With
            0 and `reuse_clusters()` on, the actor lives in a reusable process (one an earlier
            environment or worker left, when one is idle; `cluster_reuse.hosted_environment`).
        cls: the environment class (default None: the one registered as `name`; see `resolve_env`).
        backend: "ray" (default: a Ray actor, its own process) or "local" (a `LocalActor`: a
            thread of this process; `cluster.backend: local`).
        beat_period_s: a Ray actor beats every this many seconds and answers requests for its
            stacks (`heartbeat.start_beating`; default 0.0: it does not).
    """
    cls = cls or get_env_class(name)
    if not as_actor:
        return cls(cfg)
    if backend == "local":
        return actors.LocalActor(cls, (cfg,), name=f"env-{name}")
    import ray

    from posttrain.distributed import cluster_reuse

    actor_cls = _actor_class(cls, beat_period_s)
    if num_cpus == 0 and cluster_reuse.reusing():
        return cluster_reuse.hosted_environment(actor_cls, cfg)
    return ray.remote(num_cpus=num_cpus)(actor_cls).remote(cfg)


def _actor_class(cls: type, beat_period_s: float) -> type:
    """`cls` whose instances, in their own process, first end its start-up's deferred collections
    (`startup_gc.imports_done`: the environment's modules came with the class) and, when
    `beat_period_s` > 0, start a heartbeat thread (`heartbeat.start_beating`), which also answers
    the controller's requests for their stacks (`progress.py`)."""

    class EnvironmentActor(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            from posttrain.distributed import heartbeat
            from posttrain.utils import startup_gc

            startup_gc.imports_done(freeze=True)
            if beat_period_s:
                heartbeat.start_beating(beat_period_s)
            super().__init__(*args, **kwargs)

    EnvironmentActor.__name__, EnvironmentActor.__qualname__ = cls.__name__, cls.__qualname__
    EnvironmentActor.__doc__ = cls.__doc__
    return EnvironmentActor


def _is_plain_instance(env: Any) -> bool:
    return isinstance(env, Environment)


def route_step(
    envs: dict[str, Any],
    message_logs: Sequence[MessageLog],
    metadata: Sequence[dict],
    task_names: Sequence[str],
) -> EnvironmentReturn:
    """Step each sample in the environment of its task and reassemble the results in input order.

    Args:
        envs: task name -> environment (local `Environment` or Ray actor handle).
        message_logs, metadata, task_names: one entry per sample.
    """
    return launch_step(envs, message_logs, metadata, task_names).result()


class PendingStep:
    """Environment steps launched by `launch_step`: actor calls already running (plain instances
    have already stepped); `result()` waits for them and reassembles the batch."""

    def __init__(self, envs: dict[str, Any], groups: dict[str, list[int]], launched: dict[str, Any], batch_size: int,
                 method: str = "step"):
        self.envs, self.groups, self.launched, self.batch_size = envs, groups, launched, batch_size
        self.timed_out: list[int] = []  # indices `result(timeout)` left behind
        if isinstance(envs, EnvironmentActors):  # its calls' progress is watched from their launch
            envs.started(launched, method)

    def result(self, timeout: Optional[float] = None) -> EnvironmentReturn:
        """Wait for the steps and reassemble them in input order.

        With `timeout` (seconds), environments that have not answered by then are left behind:
        their samples come back terminated with reward 0 and an empty observation, and their
        indices are in `self.timed_out` (a straggler is dropped, not waited for).
        """
        groups, launched, batch_size = dict(self.groups), dict(self.launched), self.batch_size
        self.timed_out = []
        remote_tasks = [task for task in groups if not _is_plain_instance(self.envs[task])]
        if remote_tasks and timeout is None:
            self._raise_if_hung([launched[t] for t in remote_tasks], remote_tasks)
        if remote_tasks:
            if timeout is not None:
                refs = [launched[t] for t in remote_tasks]
                ready, _ = actors.wait(refs, num_returns=len(refs), timeout=max(0.0, timeout))
                ready_ids = set(map(id, ready))
                for task in [t for t in remote_tasks if id(launched[t]) not in ready_ids]:
                    self.timed_out.extend(groups.pop(task))
                    remote_tasks.remove(task)
            for task, result in zip(remote_tasks, actors.get([launched[t] for t in remote_tasks])):
                launched[task] = result
        observations: list[Optional[dict]] = [None] * batch_size
        out_metadata: list[Any] = [None] * batch_size
        stop_strings: list[Optional[list[str]]] = [None] * batch_size
        answers: list[Optional[str]] = [None] * batch_size
        rewards = torch.zeros(batch_size, dtype=torch.float32)
        terminateds = torch.zeros(batch_size, dtype=torch.bool)
        for i in self.timed_out:
            observations[i], out_metadata[i], terminateds[i] = {"role": "environment", "content": ""}, {}, True
        metrics: dict[str, float] = {}
        components: list[dict[str, float]] = [{} for _ in range(batch_size)]
        component_weights: dict[str, float] = {}
        for task, indices in groups.items():
            result: EnvironmentReturn = launched[task]
            for key, value in (getattr(result, "metrics", None) or {}).items():  # per task: "<task>/<key>"
                metrics[f"{task}/{key}"] = metrics.get(f"{task}/{key}", 0.0) + float(value)
            if len(result.observations) != len(indices) or result.rewards.numel() != len(indices):
                raise RuntimeError(
                    f"environment {task!r} returned {len(result.observations)} observations and "
                    f"{result.rewards.numel()} rewards for {len(indices)} samples"
                )
            index = torch.tensor(indices, dtype=torch.long)
            rewards[index] = result.rewards.to(torch.float32).reshape(-1).cpu()
            terminateds[index] = result.terminateds.to(torch.bool).reshape(-1).cpu()
            for j, i in enumerate(indices):
                observations[i] = result.observations[j]
                out_metadata[i] = result.metadata[j]
                stop_strings[i] = result.next_stop_strings[j]
                answers[i] = result.answers[j] if result.answers is not None else None
                if getattr(result, "reward_components", None) is not None:
                    components[i] = dict(result.reward_components[j])
            component_weights.update(getattr(result, "reward_component_weights", None) or {})
        return EnvironmentReturn(observations, out_metadata, stop_strings, rewards, terminateds, answers, metrics,
                                 components, component_weights)

    def _raise_if_hung(self, refs: list, tasks: list[str]) -> None:
        """Wait for the steps of an `EnvironmentActors` (`EnvironmentActors.wait_steps`: a hung
        environment is a `WorkerTimeoutError` naming it, never a wait for ever); a plain dict's
        steps are waited for without a limit."""
        if isinstance(self.envs, EnvironmentActors):
            self.envs.wait_steps(refs, tasks)


def launch_step(
    envs: dict[str, Any],
    message_logs: Sequence[MessageLog],
    metadata: Sequence[dict],
    task_names: Sequence[str],
    method: str = "step",
) -> PendingStep:
    """Start stepping each sample in the environment of its task, without waiting: every actor call
    is launched at once (environments work in parallel, and beside whatever the caller does next).
    `method` is the environment method called: "step" (default) or "finish" (`Environment.finish`)."""
    batch_size = len(message_logs)
    if not (len(metadata) == len(task_names) == batch_size):
        raise ValueError(
            f"route_step: {batch_size} message logs, {len(metadata)} metadata, {len(task_names)} task names"
        )
    groups: dict[str, list[int]] = {}
    for i, task in enumerate(task_names):
        if task not in envs:
            raise KeyError(f"sample {i} has task_name {task!r} but no environment serves it (have: {sorted(envs)})")
        groups.setdefault(task, []).append(i)
    launched: dict[str, Any] = {}
    for task, indices in groups.items():
        env = envs[task]
        group_logs = [message_logs[i] for i in indices]
        group_meta = [metadata[i] for i in indices]
        call = getattr(env, method)
        launched[task] = call(group_logs, group_meta) if _is_plain_instance(env) else call.remote(group_logs, group_meta)
    return PendingStep(envs, groups, launched, batch_size, method)


ENV_SHUTDOWN_TIMEOUT_S = 5.0  # an environment's own clean-up, at most, before its actor is killed
# How long a shutdown waits for an environment still being built in a process it could keep for
# the next environments (`cluster_reuse.py`): the clean-up bound above starts after that, so a
# slow start is not taken for a wedged clean-up (the process would be killed, not kept).
ENV_CONSTRUCTION_WAIT_S = 60.0
ENV_GROUP_PREFIX = "env:"  # `WorkerError.group` of an environment's failure: "env:<name>"


class EnvironmentActors(dict):
    """`task name -> environment actor` as a run starts them (`posttrain.job.make_envs`): a dict,
    which `route_step` and the rollouts take as it is, that can also tell a dead environment actor
    (`faults`) and start it again from its class and config (`restart`).

    Args:
        actors: environment name (its `env.<name>` section) -> its actor.
        env_of_task: task name -> the environment name serving it (tasks may share an actor).
        recipes: environment name -> `(class, config, backend)` its actor was made from (`create_env`).
        step_timeout_s: longest wait for one step before the environment counts as hung
            (default None: no limit; runs pass `cluster.worker_timeout_s`).
        heartbeat_timeout_s: an actor whose heartbeat has not moved for this long while a step
            waits for it has stopped answering (default 0.0: not watched; runs pass
            `cluster.heartbeat_timeout_s`; the actors beat when `beat_period_s` > 0).
        progress_limits: the bound of a step (`progress.ProgressLimits`, phase `env_step`; default
            None: none; runs pass `cluster.progress_timeout_*`).
        beat_period_s: how often the actors (re)started here beat (`create_env`; default 0.0: not).
    """

    def __init__(self, actors: dict[str, Any], env_of_task: dict[str, str], recipes: dict[str, tuple],
                 step_timeout_s: Optional[float] = None, heartbeat_timeout_s: float = 0.0,
                 progress_limits: Any = None, beat_period_s: float = 0.0) -> None:
        from posttrain.distributed import heartbeat, progress

        super().__init__({task: actors[env] for task, env in sorted(env_of_task.items())})
        self.env_of_task, self.recipes, self.step_timeout_s = dict(env_of_task), dict(recipes), step_timeout_s
        self.beat_period_s = beat_period_s
        beats = heartbeat_timeout_s > 0 and beat_period_s > 0
        self.heartbeats = heartbeat.HeartbeatWatch(heartbeat_timeout_s) if beats else None
        watched = progress_limits is not None and progress_limits.enabled and beat_period_s > 0
        self.progress = progress.ProgressWatch(progress_limits) if watched else None
        # Actors that answered a step: only those are judged by progress, as a first step also
        # waits for its actor to start (imports, its __init__), which `step_timeout_s` bounds.
        self._answered: set[str] = set()

    def by_name(self) -> dict[str, Any]:
        """Environment name -> its actor."""
        return {env: self[task] for task, env in self.env_of_task.items()}

    def faults(self) -> list[tuple[str, str]]:
        """`(environment name, cause in words)` of every actor Ray reports dead (`actors.actor_death`)."""
        dead = []
        for env, actor in sorted(self.by_name().items()):
            death = None if _is_plain_instance(actor) else actors.actor_death(actor)
            if death is not None:
                dead.append((env, death[0]))
        return dead

    def restart(self, env: str) -> None:
        """Start the actor of environment `env` again (the old one is killed first, if it still
        runs): a fresh instance of its class and config, for every task it serves."""
        try:
            actors.kill(self.by_name()[env])
        except Exception:  # already gone
            pass
        cls, cfg, backend = self.recipes[env]
        fresh = create_env(env, cfg, cls=cls, backend=backend, beat_period_s=self.beat_period_s)
        for task, name in self.env_of_task.items():
            if name == env:
                self[task] = fresh

    # ------------------------------------------------------------------ watching steps
    def started(self, launched: dict[str, Any], method: str = "step") -> None:
        """Calls of `method` were launched (`launch_step`: task -> its future): their progress counts
        from now, in the phase `env_<method>` (`env_step`, `env_finish`)."""
        if self.progress is not None:
            for task, ref in launched.items():
                if not _is_plain_instance(self[task]):
                    self.progress.started(ref, f"env_{method}")

    def wait_steps(self, refs: list, tasks: list[str]) -> None:
        """Wait until every step of `refs` (those of `tasks`) is done; raise a `WorkerTimeoutError`
        naming the environment whose step ran past `step_timeout_s`, whose actor stopped beating
        (`heartbeat_timeout_s`), or whose step made no progress within its bound (`progress`;
        with where it was stuck, from the actor's stacks; an actor's first step is not judged:
        it includes the actor's start)."""
        from posttrain.distributed import heartbeat, progress
        from posttrain.distributed.worker_group import WorkerTimeoutError

        env_of = {ref: self.env_of_task.get(task, task) for ref, task in zip(refs, tasks)}
        actor_of = {ref: actors.actor_id(self[task]) for ref, task in zip(refs, tasks)}
        limit = self.step_timeout_s
        deadline = None if not limit else time.monotonic() + limit
        slice_s = min(self.beat_period_s or 1.0, 1.0) if (self.heartbeats or self.progress) else limit
        waiting = list(refs)
        try:
            while waiting:
                ready, waiting = actors.wait(waiting, num_returns=len(waiting), timeout=slice_s)
                for ref in ready:
                    self._answered.add(actor_of[ref])
                    if self.progress is not None:
                        self.progress.finished(ref)
                if not waiting:
                    return
                if self.heartbeats is not None:
                    ids = {actor_of[ref]: env_of[ref] for ref in waiting}
                    stopped = self.heartbeats.observe(heartbeat.read_beats(ids))
                    if stopped:
                        env = ids[next(iter(stopped))]
                        raise WorkerTimeoutError(
                            f"environment {env!r}: stopped answering: no heartbeat for {max(stopped.values()):.0f}s "
                            f"(cluster.heartbeat_timeout_s={self.heartbeats.timeout_s:g})", group=ENV_GROUP_PREFIX + env)
                judged = [ref for ref in waiting if actor_of[ref] in self._answered]
                late = self.progress.overdue(judged) if self.progress is not None else []
                if late:
                    ref, phase, running, bound, why = late[0]
                    env, actor = env_of[ref], actor_of[ref]
                    stacks = progress.request_stacks([actor])[actor]
                    raise WorkerTimeoutError(f"environment {env!r}: no progress: " + progress.describe_overdue(
                        f"its actor {actor}", phase, "step", running, bound, why, stacks), group=ENV_GROUP_PREFIX + env)
                if deadline is not None and time.monotonic() >= deadline:
                    stuck = sorted({env_of[ref] for ref in waiting})
                    raise WorkerTimeoutError(f"environment {', '.join(map(repr, stuck))}: no answer after {limit:g}s "
                                             "(cluster.worker_timeout_s)", group=ENV_GROUP_PREFIX + stuck[0])
        finally:
            if self.progress is not None:
                self.progress.forget(refs)


class EnvRouter:
    """Holds `task name -> environment` and steps mixed batches with `route_step`."""

    def __init__(self, envs: dict[str, Any]):
        if not envs:
            raise ValueError("EnvRouter needs at least one environment")
        self.envs = dict(envs)

    def step(self, message_logs: Sequence[MessageLog], metadata: Sequence[dict], task_names: Sequence[str]) -> EnvironmentReturn:
        return route_step(self.envs, message_logs, metadata, task_names)

    def shutdown(self) -> None:
        """Shut every environment down and end its actor (or, for one in a reusable process that
        shut down cleanly, leave the process to the next environments: `cluster_reuse.py`); one
        serving several tasks once."""
        from posttrain.distributed import cluster_reuse
        from posttrain.distributed.worker_host import ConstructorFailedError

        unique: list[Any] = []
        for env in self.envs.values():
            if not any(env is seen for seen in unique):
                unique.append(env)
        for env in unique:
            if _is_plain_instance(env):
                env.shutdown()
                continue
            if cluster_reuse.may_keep_environment_process(env) and not _built(env):
                actors.kill(env)  # never built, or not in time: nothing to clean up, nothing to keep
                continue
            clean = False
            try:  # a wedged environment must not wedge the shutdown: it is killed regardless
                actors.get(env.shutdown.remote(), timeout=ENV_SHUTDOWN_TIMEOUT_S)
                clean = True
            except Exception as error:
                # Dead, wedged, or never built (its constructor raised): nothing to shut down.
                if not (actors.is_get_timeout(error) or actors.is_actor_death(error)
                        or isinstance(error, ConstructorFailedError)):
                    raise
            finally:
                if not (clean and cluster_reuse.keep_environment_process(env, ENV_SHUTDOWN_TIMEOUT_S)):
                    actors.kill(env)


def _built(env: Any) -> bool:
    """Whether hosted environment `env`'s constructor returned, waiting for it up to
    `ENV_CONSTRUCTION_WAIT_S` (False when it raised, its process died, or it is still running)."""
    if env.construction is None:
        return True
    try:
        actors.get(env.construction, timeout=ENV_CONSTRUCTION_WAIT_S)
        return True
    except Exception:  # noqa: BLE001 - raised, died or wedged: the caller kills it either way
        return False


def env_rows_maker(env_sections: Any) -> Callable:
    """`env_rows(data_cfg, split) -> (rows, locations)` for `data.dataset=env`: `data.num_train` /
    `data.num_validation` rows made by the environment `data.env_name` (`Environment.make_rows`,
    configured by `env_sections.section(name)`) from `split_seed(data.seed, split)` (validation rows:
    `data.seed + VALIDATION_SEED_OFFSET`, `posttrain.config.schema.data`)."""
    from posttrain.config.schema import split_seed
    from posttrain.data.datasets import DataError

    def env_rows(data_cfg, split):
        name = data_cfg.env_name
        try:
            cls, env_cfg = resolve_env(name, env_sections.section(name) if env_sections is not None else None)
        except (KeyError, ValueError) as e:
            raise DataError(f"data.dataset=env: {e.args[0] if e.args else e}") from None
        count = data_cfg.num_train if split == "train" else data_cfg.num_validation
        seed = split_seed(data_cfg.seed, split)
        try:
            rows = cls.make_rows(env_cfg, count, seed)
        except NotImplementedError:
            raise DataError(f"data.dataset=env: environment {name!r} ({cls.__name__}) does not make its own rows") from None
        return rows, [f"env {name} {split} row {i}" for i in range(len(rows))]

    return env_rows
