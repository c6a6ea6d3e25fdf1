"""Jobs of one process taking over each other's clusters and processes (`cluster_reuse.py`): a
finished job's cluster serves the next job of the same shape, which then trains exactly as in new
processes; anything else asking for resources releases what is parked, but not the idle processes,
which serve the next members of any cluster: workers and environments, of any class.

The session's Ray reuses clusters (tests/conftest.py), so other modules' jobs may have parked
some: each test asserts only on clusters and processes it made itself."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from test_grpo import _comparable, read_metrics, small_cfg

from posttrain.distributed import actors, cluster_reuse
from posttrain.distributed.cluster import VirtualCluster
from posttrain.distributed.worker_group import DistributedWorker, WorkerGroup
from posttrain.distributed.worker_host import ConstructorFailedError
from posttrain.environments import EnvRouter, Environment, EnvironmentReturn, create_env
from posttrain.environments.math_env import MathEnvConfig

pytestmark = [pytest.mark.functional, pytest.mark.usefixtures("patient_shutdowns")]  # conftest.py


def _run_grpo(tmp_path: Path, *extra: str) -> tuple[list[str], list[VirtualCluster]]:
    """One small GRPO job to its end; the actor ids of its workers' processes and its clusters."""
    from posttrain.algorithms import grpo

    ctx = grpo.setup(small_cfg(tmp_path, "cluster.backend=ray", *extra))
    try:
        processes = [actors.actor_id(worker) for group in ctx.workers() for worker in group.worker_group.workers]
        clusters = list(ctx.clusters)
        grpo.grpo_train(ctx)
    finally:
        ctx.shutdown()
    return processes, clusters


def _idle_processes() -> set[str]:
    return {actors.actor_id(host) for host in cluster_reuse.process_pool().idle_hosts()}


def test_the_next_job_takes_over_the_cluster_and_processes_and_trains_the_same(ray_cluster, tmp_path):
    # Two steps: the second generates with weights the first trained and refitted.
    first_processes, first_clusters = _run_grpo(tmp_path / "first", "grpo.max_num_steps=2")
    assert all(cluster.reservation_stands() for cluster in first_clusters)  # parked, not released
    idle = _idle_processes()
    assert set(first_processes) <= idle and len(first_processes) >= 2
    second_processes, second_clusters = _run_grpo(tmp_path / "second", "grpo.max_num_steps=2")
    assert [id(c) for c in second_clusters] == [id(c) for c in first_clusters]
    # No new process (policy and generation; which idle one a member gets is the pool's choice:
    # the one that went idle last, perhaps the first job's environment's).
    assert set(second_processes) <= idle
    # Nothing of the first job's members stayed in the processes: the same run, the same numbers.
    first, second = (_comparable(read_metrics(tmp_path / name / "logs")) for name in ("first", "second"))
    assert sorted(first) == [1, 2] and second == first

    # Another shape (generation on a cluster of its own) releases what is parked, but its workers
    # start in the idle processes all the same.
    idle = _idle_processes()
    third_processes, third_clusters = _run_grpo(tmp_path / "third", "grpo.max_num_steps=1",
                                                "policy.generation.colocated.enabled=false")
    assert not any(cluster.reservation_stands() for cluster in first_clusters)
    assert {c.name for c in third_clusters} == {"policy", "generation"}
    assert set(third_processes) <= idle and len(third_processes) >= 2


class _Idle(DistributedWorker):
    def torch_threads(self) -> int:
        return torch.get_num_threads()


def _no_build() -> VirtualCluster:
    raise AssertionError("a parked cluster was expected")


def test_a_cluster_with_a_group_still_on_it_is_released_not_parked(ray_cluster):
    shape = ("reuse-test-open-group",)
    cluster = cluster_reuse.take(shape, lambda: VirtualCluster([1], name="open-group", reuse_worker_processes=True))
    group = WorkerGroup(cluster, _Idle, name="left-open")
    try:
        cluster.shutdown()  # the job forgot its group: the bundles are not free for the next job
        assert not cluster.reservation_stands()
        assert cluster_reuse.parked_count(shape) == 0
    finally:
        group.shutdown()


def test_a_parked_cluster_is_handed_out_once_and_released_by_another_reservation(ray_cluster):
    shape = ("reuse-test-parked",)
    cluster = cluster_reuse.take(shape, lambda: VirtualCluster([1], name="parked", reuse_worker_processes=True))
    group = WorkerGroup(cluster, _Idle, name="member")
    process = actors.actor_id(group.workers[0])
    group.shutdown()
    cluster.shutdown()
    cluster.shutdown()  # twice: still parked once
    assert cluster.reservation_stands() and process in _idle_processes()
    assert cluster_reuse.parked_count(shape) == 1
    assert cluster_reuse.take(shape, _no_build) is cluster
    assert cluster_reuse.parked_count(shape) == 0  # handed out: the next job of the shape builds its own
    cluster.shutdown()
    assert cluster_reuse.parked_count(shape) == 1

    # Any new reservation releases what is parked; the idle process serves the new cluster.
    other = VirtualCluster([1], cpus_per_bundle=2.0, name="another-shape", reuse_worker_processes=True)
    try:
        assert not cluster.reservation_stands() and cluster_reuse.parked_count(shape) == 0
        assert process in _idle_processes()
        group = WorkerGroup(other, _Idle, name="elsewhere")
        assert actors.actor_id(group.workers[0]) == process
        assert group.run_rank0("torch_threads") == 2  # this cluster's bundle, not the last one's
        group.shutdown()
    finally:
        other.release()
    assert process in _idle_processes()  # a released cluster leaves its idle processes to the next


def test_a_released_cluster_ends_the_groups_left_on_it(ray_cluster):
    cluster = VirtualCluster([1], name="left", reuse_worker_processes=True)
    group = WorkerGroup(cluster, _Idle, name="forgotten")
    host = actors.ray_handle(group.workers[0])
    cluster.release()  # the job did not shut its group down: its process must not live on
    assert not group.workers and actors.actor_id(host) not in _idle_processes()
    _wait_for_death(host)


def test_with_reuse_off_a_jobs_cluster_is_released(ray_cluster):
    cluster_reuse.reuse_clusters(False)
    try:
        shape = ("reuse-test-off",)
        cluster = cluster_reuse.take(shape, lambda: VirtualCluster([1], name="not-reused"))
        assert cluster.reuse_key is None
        cluster.shutdown()
        assert not cluster.reservation_stands()
    finally:
        cluster_reuse.reuse_clusters(True)


# ------------------------------------------------------------------ environment processes
class _Recorder(Environment):
    """Rewards each answer with the number of objects of its own class alive in its process."""

    def __init__(self, cfg=None):
        self.closed = False

    def step(self, message_logs, metadata):
        import gc

        n = len(message_logs)
        alive = sum(isinstance(obj, _Recorder) for obj in gc.get_objects())
        return EnvironmentReturn(observations=[{"role": "environment", "content": ""}] * n, metadata=list(metadata),
                                 next_stop_strings=[None] * n, rewards=torch.full((n,), float(alive)),
                                 terminateds=torch.ones(n, dtype=torch.bool), answers=[None] * n)


class _BrokenConfig(_Recorder):
    def __init__(self, cfg=None):
        raise ValueError("env.broken.level: must be positive (got -1)")


class _Lingering(_Recorder):
    """Keeps a thread that holds it after its shutdown: its object is never freed."""

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.stop = threading.Event()
        threading.Thread(target=lambda: self.stop.wait(600), daemon=True).start()


class _SlowStart(_Recorder):
    """Its constructor returns once the file its config names exists (a slow start, held by the test)."""

    def __init__(self, cfg=None):
        super().__init__(cfg)
        deadline = time.monotonic() + 300
        while not Path(cfg).exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def _step(env) -> float:
    router = EnvRouter({"task": env})
    return float(router.step([[{"role": "assistant", "content": "x"}]], [{}], ["task"]).rewards[0])


def test_an_environment_that_shut_down_leaves_its_process_to_the_next_environment_of_any_class(ray_cluster):
    cluster_reuse.release_processes()  # other modules' jobs may have left some
    math = create_env("math", MathEnvConfig())
    process = actors.actor_id(math)
    router = EnvRouter({"math": math})
    right = router.step([[{"role": "assistant", "content": "\\boxed{2}"}]], [{"ground_truth": "2"}], ["math"])
    assert right.rewards.tolist() == [1.0]
    router.shutdown()
    assert cluster_reuse.idle_processes() == 1

    # Another class in the same process, with nothing of the math environment left in it.
    recorder = create_env("recorder", cls=_Recorder)
    assert actors.actor_id(recorder) == process and cluster_reuse.idle_processes() == 0
    assert _step(recorder) == 1.0
    host = actors.ray_handle(recorder)
    assert ray.get(host.__ray_call__.remote(lambda h: repr(h))) == "WorkerHost(_Recorder)"

    # A constructor that raised: the first step says why; the shutdown ends its process, keeps none.
    broken = create_env("broken", cls=_BrokenConfig)
    assert actors.actor_id(broken) != process
    with pytest.raises(ConstructorFailedError, match=r"constructor raised ValueError: env\.broken\.level: must be positive"):
        _step(broken)
    EnvRouter({"broken": broken}).shutdown()
    assert cluster_reuse.idle_processes() == 0

    # An environment its shutdown does not free (a thread still holds it) takes its process with it.
    EnvRouter({"recorder": recorder}).shutdown()
    assert cluster_reuse.idle_processes() == 1
    lingering = create_env("lingering", cls=_Lingering)
    assert actors.actor_id(lingering) == process and _step(lingering) == 1.0
    EnvRouter({"lingering": lingering}).shutdown()
    assert cluster_reuse.idle_processes() == 0
    _wait_for_death(lingering)

    # One that reserves CPUs is an actor of its own; turning reuse off ends the idle processes.
    reserving = create_env("cpu", cls=_Recorder, num_cpus=0.5)
    assert isinstance(reserving, ray.actor.ActorHandle)
    EnvRouter({"cpu": reserving}).shutdown()
    kept = create_env("recorder", cls=_Recorder)
    assert _step(kept) == 1.0  # built: a new process, as the last one was ended
    EnvRouter({"recorder": kept}).shutdown()
    assert cluster_reuse.idle_processes() == 1
    cluster_reuse.reuse_clusters(False)
    try:
        assert cluster_reuse.idle_processes() == 0
        _wait_for_death(kept)
        plain = create_env("recorder", cls=_Recorder)
        assert isinstance(plain, ray.actor.ActorHandle)
        EnvRouter({"recorder": plain}).shutdown()
    finally:
        cluster_reuse.reuse_clusters(True)


def test_an_environment_shut_down_while_it_starts_leaves_its_process_once_built(ray_cluster, tmp_path, monkeypatch):
    """The clean-up bound counts from the end of the construction: an environment shut down before
    its first step, while its constructor still runs, is not taken for a wedged one and killed."""
    from posttrain.environments import registry

    monkeypatch.setattr(registry, "ENV_SHUTDOWN_TIMEOUT_S", 5.0)  # the product's bound, not the module's 120 s
    cluster_reuse.release_processes()
    started = tmp_path / "started"
    env = create_env("slow", str(started), cls=_SlowStart)
    shutdown = threading.Thread(target=EnvRouter({"slow": env}).shutdown)
    shutdown.start()
    time.sleep(registry.ENV_SHUTDOWN_TIMEOUT_S + 2)  # past the bound, measured from the shutdown's start
    started.touch()
    shutdown.join(timeout=300)
    assert not shutdown.is_alive() and cluster_reuse.idle_processes() == 1
    again = create_env("recorder", cls=_Recorder)
    assert actors.actor_id(again) == actors.actor_id(env) and _step(again) == 1.0
    EnvRouter({"recorder": again}).shutdown()
    assert cluster_reuse.release_processes() == 1


def _wait_for_death(env, deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    while actors.actor_death(env) is None:
        assert time.monotonic() < deadline, f"{env} still alive"
        time.sleep(0.2)
