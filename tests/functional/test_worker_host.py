"""Reused worker processes (`VirtualCluster(reuse_worker_processes=True)`, `worker_host.py`): a group
shut down cleanly leaves its processes to the next group on its node, with nothing of its members
left in them; any failure, a restart or the cluster's shutdown ends them instead.

The tests share one module-scoped cluster with a pool of its own (jobs' clusters are not reused in
this module: `cluster_reuse.py`'s shared pool is tested in test_cluster_reuse.py), whose idle processes
pass from test to test (which is the point: few interpreters are started), so each asserts only on
processes it saw itself."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from posttrain.distributed import actors, progress
from posttrain.distributed.batch import Batch
from posttrain.distributed.cluster import VirtualCluster
from posttrain.distributed.worker_group import DistributedWorker, WorkerError, WorkerGroup, WorkerTimeoutError
from posttrain.distributed.worker_host import HostedWorker, HostPool
from posttrain.utils import startup_gc

# own_process_pools: clusters keep their idle processes in pools of their own here (conftest.py).
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200), pytest.mark.own_process_pools,
              pytest.mark.usefixtures("patient_shutdowns")]  # conftest.py

MEMBER_VAR = "POSTTRAIN_TEST_SET_BY_A_MEMBER"
DEADLINE_S = 120.0  # hang guard for what Ray does in the background (a kill), not a speed test


class ProbeWorker(DistributedWorker):
    """Sets a variable of its own, draws from torch's global RNG and holds `hold_mib` MiB."""

    def __init__(self, hold_mib: int = 0) -> None:
        super().__init__()
        os.environ[MEMBER_VAR] = f"rank {self.rank}"
        self.first_draw = torch.rand(4).tolist()
        self.held = torch.ones(hold_mib * 2**18) if hold_mib else None  # float32: 4 bytes each

    def env(self) -> dict[str, str]:
        keys = ("RANK", "WORLD_SIZE", "MASTER_PORT", "POSTTRAIN_HEARTBEAT_S", MEMBER_VAR)
        return {key: os.environ.get(key, "") for key in keys}

    def draw(self) -> list[float]:
        return self.first_draw

    def heartbeat_threads(self) -> int:
        return sum(thread.name == "posttrain-heartbeat" for thread in threading.enumerate())

    def collector(self) -> dict:
        return startup_gc.state()

    def sum_of_ranks_plus_one(self) -> float:
        return self.all_reduce_sum(float(self.rank + 1))

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def fail(self) -> None:
        raise ValueError("this member failed on purpose")


class OtherWorker(DistributedWorker):
    """Another class on the same processes."""

    def env(self) -> dict[str, str]:
        return ProbeWorker.env(self)

    def draw(self) -> list[float]:
        return torch.rand(4).tolist()

    def heartbeat_threads(self) -> int:
        return ProbeWorker.heartbeat_threads(self)


class FailingInitWorker(DistributedWorker):
    def __init__(self) -> None:
        super().__init__()
        raise ValueError("model path does not exist")


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    cluster = VirtualCluster([2], max_colocated_worker_groups=2, reuse_worker_processes=True, name="reuse")
    yield cluster
    cluster.shutdown()


def wait_until(condition, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE_S:.0f}s: {what}")
        time.sleep(0.1)
    return value


def idle_ids(cluster) -> set[str]:
    """The actor ids of the cluster's idle hosts."""
    return {actors.actor_id(host) for host in cluster.worker_hosts.idle_hosts()}


def idle_pids(cluster) -> set[int]:
    """The process ids of the cluster's idle hosts."""
    import ray

    return set(ray.get([host.__ray_call__.remote(lambda _: os.getpid()) for host in cluster.worker_hosts.idle_hosts()]))


def process_gone(pid: int) -> bool:
    """No such process, or one that exited and waits to be reaped (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_the_next_group_reuses_the_processes_with_nothing_of_the_last_members(cluster):
    first = WorkerGroup(cluster, ProbeWorker, init_kwargs={"hold_mib": 64}, name="first", heartbeat_timeout_s=60.0)
    pids, envs, draws = first.run_all("pid"), first.run_all("env"), first.run_all("draw")
    first_peak_mib = first.run_all("peak_rss_mb")
    assert [e[MEMBER_VAR] for e in envs] == ["rank 0", "rank 1"]
    assert all(e["POSTTRAIN_HEARTBEAT_S"] for e in envs) and first.run_all("heartbeat_threads") == [1, 1]
    assert all(isinstance(worker, HostedWorker) for worker in first.workers)
    # The host's start-up deferred full collections until the member's modules had come (with its
    # class), then froze them: `startup_gc`.
    assert all(not c["deferring"] and c["frozen"] > 1000 for c in first.run_all("collector"))
    processes = {actors.actor_id(worker) for worker in first.workers}
    first.shutdown()
    assert processes <= idle_ids(cluster)

    second = WorkerGroup(cluster, OtherWorker, name="second")  # another class, no heartbeats
    try:
        assert sorted(second.run_all("pid")) == sorted(pids)
        second_envs = second.run_all("env")
        # Its own rendezvous; nothing the first members set, or were given, is left.
        assert [e["RANK"] for e in second_envs] == ["0", "1"] and [e["WORLD_SIZE"] for e in second_envs] == ["2", "2"]
        assert second_envs[0]["MASTER_PORT"] != envs[0]["MASTER_PORT"]
        assert [(e[MEMBER_VAR], e["POSTTRAIN_HEARTBEAT_S"]) for e in second_envs] == [("", ""), ("", "")]
        assert second.run_all("heartbeat_threads") == [0, 0]
        assert second.run_all("all_reduce_sum", 1.0) == [2.0, 2.0]  # a working process group
        # torch's RNG as a new process has it: the first members drew the same numbers.
        assert sorted(second.run_all("draw")) == sorted(draws)
        # The peak is this member's: the first one's 64 MiB tensor is not in it.
        second_peak_mib = second.run_all("peak_rss_mb")
        assert max(second_peak_mib) < min(first_peak_mib) - 32, (second_peak_mib, first_peak_mib)
    finally:
        second.shutdown()


def test_colocated_groups_get_processes_of_their_own_and_give_them_back(cluster):
    policy = WorkerGroup(cluster, ProbeWorker, name="policy")
    generation = WorkerGroup(cluster, OtherWorker, name="generation")
    try:
        policy_pids, generation_pids = policy.run_all("pid"), generation.run_all("pid")
        assert set(policy_pids).isdisjoint(generation_pids)
        assert policy.run_all("sum_of_ranks_plus_one") == [3.0, 3.0]
        processes = {actors.actor_id(worker) for group in (policy, generation) for worker in group.workers}
    finally:
        policy.shutdown()
        generation.shutdown()
    assert len(processes) == 4 and processes <= idle_ids(cluster)
    again = [WorkerGroup(cluster, OtherWorker, name=f"again{i}") for i in range(2)]
    try:
        assert sorted(pid for group in again for pid in group.run_all("pid")) == sorted(policy_pids + generation_pids)
    finally:
        for group in again:
            group.shutdown()


def test_a_group_that_saw_a_failure_or_a_restart_does_not_give_its_processes_back(cluster):
    """One member on bundle 1, group after group; each time the next one runs in a new process."""
    seen: list[int] = []

    def member(name: str) -> WorkerGroup:
        group = WorkerGroup(cluster, ProbeWorker, name=name, bundle_indices=[1])
        pid = group.run_rank0("pid")
        assert pid not in seen, name
        seen.append(pid)
        return group

    raised = member("raised")
    with pytest.raises(WorkerError, match=r"(?s)rank 0 \(fail, .*this member failed on purpose"):
        raised.run_all("fail")
    raised.shutdown()

    killed = member("killed")
    os.kill(seen[-1], signal.SIGKILL)
    wait_until(killed.faults, "Ray reports the killed member")
    killed.shutdown()

    restarted = member("restarted")
    restarted.restart()
    assert restarted.run_rank0("pid") not in seen
    seen.append(restarted.run_rank0("pid"))
    restarted.shutdown()
    idle = cluster.worker_hosts.count()
    assert not set(seen) & idle_pids(cluster)  # none of them came back

    with pytest.raises(WorkerError, match=r"(?s)rank 0 \(__init__, .*ValueError: model path does not exist"):
        WorkerGroup(cluster, FailingInitWorker, name="badinit", bundle_indices=[1])
    assert cluster.worker_hosts.count() == max(idle - 1, 0)  # it took an idle process, if any, and ended it
    after = member("after")
    after.shutdown()
    assert seen[-1] in idle_pids(cluster)  # a clean shutdown gives it back


def test_a_policy_worker_is_freed_and_a_generation_worker_follows_it_in_its_process(cluster):
    """The real workers: nothing keeps a shut-down policy worker alive (else its process would not
    be reused), and an engine builds and generates where it was."""
    from test_tensor_parallel import make_batch, policy_cfg

    from posttrain.models.generation.native import NativeGeneration
    from posttrain.models.generation.spec import GenerationSpec
    from posttrain.models.policy.policy import Policy

    policy = Policy(cluster, policy_cfg(), init_reference_model=False, name="policy-first")
    pid = policy.worker_group.run_rank0("pid")
    policy.shutdown()
    generation = NativeGeneration(cluster, GenerationSpec("tiny", {"max_new_tokens": 4}, precision="float32"),
                                  bundle_indices=[0], name="engine-after")
    try:
        assert generation.worker_group.run_rank0("pid") == pid
        prompts = Batch(input_ids=make_batch()["input_ids"][:2, :3], input_lengths=torch.tensor([3, 3]))
        out = generation.generate(prompts, greedy=True)
        assert out["output_ids"][:, :3].tolist() == prompts["input_ids"].tolist()
        assert (out["generation_lengths"] >= 1).all(), out["generation_lengths"]
    finally:
        generation.shutdown()


def test_a_frozen_member_of_a_reused_process_is_named(cluster, monkeypatch):
    monkeypatch.setattr(progress, "STACK_WAIT_S", 600.0)  # a guard, not a wait
    # Only the stopped member may fall silent: the healthy first group's bound is long, the second's
    # long enough for a busy machine's scheduling, and it is the shutdown of a frozen member that is short.
    first = WorkerGroup(cluster, ProbeWorker, name="beats", bundle_indices=[0], heartbeat_timeout_s=60.0)
    pid = first.run_rank0("pid")
    first.shutdown()
    group = WorkerGroup(cluster, ProbeWorker, name="frozen", bundle_indices=[0], heartbeat_timeout_s=10.0)
    try:
        assert group.run_rank0("pid") == pid
        assert group.run_rank0("heartbeat_threads") == 1
        ref = group.run_single_async(0, "sleep", 60.0)
        os.kill(pid, signal.SIGSTOP)  # alive to Ray, silent to its heartbeat
        with pytest.raises(WorkerTimeoutError, match=r"'frozen': stopped answering: rank 0 \(node .*no heartbeat"):
            group.get([ref], timeout=600)
    finally:
        group.shutdown(timeout_s=5.0)  # its goodbye never comes
    wait_until(lambda: process_gone(pid), f"the frozen process {pid} ends")  # killed, not kept


def test_a_group_with_env_vars_gets_its_own_processes_beside_idle_ones(cluster):
    fillers = [WorkerGroup(cluster, OtherWorker, name=f"filler{i}", bundle_indices=[1]) for i in range(2)]
    idle = [filler.run_rank0("pid") for filler in fillers]
    for filler in fillers:
        filler.shutdown()
    assert set(idle) <= idle_pids(cluster)
    # Idle processes reserve nothing: bundle 1 has room for a plain actor beside them.
    group = WorkerGroup(cluster, ProbeWorker, name="with-env", bundle_indices=[1], env_vars={"POSTTRAIN_X": "1"})
    try:
        assert not isinstance(group.workers[0], HostedWorker)  # a runtime_env: set before the interpreter starts
        assert group.run_rank0("pid") not in idle
        assert group.run_rank0("env")["RANK"] == "0"
        assert set(idle) <= idle_pids(cluster)
    finally:
        group.shutdown()
    assert set(idle) <= idle_pids(cluster)  # a plain actor is not kept; the idle ones still wait


def test_groups_beyond_the_colocation_limit_are_refused_though_their_processes_reserve_nothing(cluster):
    from posttrain.distributed.cluster import ClusterError

    cluster.placement_timeout_s, timeout = 1.0, cluster.placement_timeout_s
    groups = [WorkerGroup(cluster, OtherWorker, name=f"share{i}", bundle_indices=[0]) for i in range(2)]
    try:
        with pytest.raises(ClusterError, match=r"'third': no room on .*bundle 0: CPU free 0, needed 0.5"):
            WorkerGroup(cluster, OtherWorker, name="third", bundle_indices=[0])
    finally:
        cluster.placement_timeout_s = timeout
        for group in groups:
            group.shutdown()


def test_the_clusters_shutdown_ends_its_idle_processes(ray_cluster):
    cluster = VirtualCluster([1], reuse_worker_processes=True, name="reuse-end")
    try:
        group = WorkerGroup(cluster, OtherWorker, name="only")
        host, pid = group.workers[0].host, group.run_rank0("pid")
        group.shutdown()
        assert cluster.worker_hosts.count() == 1 and not process_gone(pid)
    finally:
        cluster.shutdown()
    wait_until(lambda: actors.actor_death(host), "Ray reports the idle process dead")
    wait_until(lambda: process_gone(pid), f"the idle process {pid} ends")


def test_without_reuse_a_shut_down_groups_processes_end(ray_cluster):
    cluster = VirtualCluster([1], name="no-reuse")
    try:
        assert cluster.worker_hosts is None
        group = WorkerGroup(cluster, OtherWorker, name="plain")
        handle, pid = group.workers[0], group.run_rank0("pid")
        assert not isinstance(handle, HostedWorker)
        group.shutdown()
        assert wait_until(lambda: actors.actor_death(handle), "Ray reports the actor dead")[0] == "was killed (ray.kill)"
        wait_until(lambda: process_gone(pid), f"the process {pid} ends")
    finally:
        cluster.shutdown()


class _Nothing:
    pass


def test_a_full_pool_ends_the_process_idle_longest(ray_cluster):
    pool = HostPool(max_idle=2)
    members = [pool.host() for _ in range(3)]
    try:
        for member in members:
            member.construct(_Nothing, {}, {})
        for member in members:  # given back one after the other: the first has waited longest
            assert pool.take_back([member], [], DEADLINE_S) == [member]
        assert {actors.actor_id(host) for host in pool.idle_hosts()} == {actors.actor_id(m) for m in members[1:]}
        wait_until(lambda: actors.actor_death(members[0]), "Ray reports the evicted process dead")
        # Taken in the reverse order: the last given back first.
        assert [actors.actor_id(pool.take()[0]) for _ in range(2)] == [actors.actor_id(m) for m in members[:0:-1]]
        assert pool.take() is None
    finally:
        for member in members:
            actors.kill(member)
