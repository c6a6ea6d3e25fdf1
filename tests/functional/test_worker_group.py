"""WorkerGroup / VirtualCluster on a real local Ray cluster with real gloo process groups."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import ray
import torch
from conftest import RAY_TEST_CPUS

from posttrain.distributed import progress
from posttrain.distributed.batch import Batch
from posttrain.distributed.cluster import ClusterError, VirtualCluster
from posttrain.distributed.progress import ProgressLimits
from posttrain.distributed.worker_group import DistributedWorker, WorkerError, WorkerGroup, WorkerTimeoutError
from posttrain.environments.interface import Environment, EnvironmentReturn
from posttrain.environments.registry import EnvironmentActors, EnvRouter, create_env, launch_step

# The timeout is a hang guard, not a speed test: beside two CPU hogs this module ran 4-6x its quiet time.
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]


class EchoWorker(DistributedWorker):
    def __init__(self, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset

    def env(self) -> dict[str, str]:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "POSTTRAIN_TEST_FLAG")
        return {key: os.environ.get(key, "") for key in keys}

    def niceness(self) -> int:
        return os.nice(0)

    def sum_of_ranks_plus_one(self) -> float:
        return self.all_reduce_sum(float(self.rank + 1))

    def tag_shard(self, shard: Batch, scale: int = 1) -> Batch:
        """Adds rank*100*scale to `x`; `ids` gets width rank+1 so the gather has to pad."""
        out = shard.copy()
        out["x"] = shard["x"] + 100 * scale * self.rank + self.offset
        out["rank"] = [self.rank] * shard.size
        out["ids"] = torch.full((shard.size, self.rank + 1), 7)
        return out

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def stall_in_sleep(self) -> float:
        """Rank 1 never comes back (a deadlock or an endless loop, for all the controller can tell);
        rank 0 waits for it in a collective: both processes alive, both beating."""
        if self.rank == 1:
            time.sleep(3600)
        return self.all_reduce_sum(1.0)


class CrashingWorker(DistributedWorker):
    def rank1_exits_while_rank0_hangs(self) -> float:
        if self.rank == 1:
            time.sleep(0.5)
            os._exit(1)
        time.sleep(120)  # stands for a collective that never completes because its peer died
        return 0.0


class FailingInitWorker(DistributedWorker):
    def __init__(self) -> None:
        super().__init__()
        raise ValueError("model path does not exist")


@pytest.fixture(scope="module")
def pair(ray_cluster):
    cluster = VirtualCluster([2], name="pair")
    group = WorkerGroup(
        cluster, EchoWorker, init_kwargs={"offset": 1}, name="echo", env_vars={"POSTTRAIN_TEST_FLAG": "on"}
    )
    yield group
    group.shutdown()
    cluster.shutdown()


def test_env_and_all_reduce(pair):
    envs = pair.run_all("env")
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert [e["WORLD_SIZE"] for e in envs] == ["2", "2"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]  # both bundles on the one node
    assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] == pair.node_ips[0]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] != ""
    assert [e["POSTTRAIN_TEST_FLAG"] for e in envs] == ["on", "on"]
    assert pair.run_all("sum_of_ranks_plus_one") == [3.0, 3.0]  # (0+1) + (1+1)
    summed = pair.run_all("all_reduce_sum", torch.tensor([1.0, 2.0]))
    assert all(torch.equal(t, torch.tensor([2.0, 4.0])) for t in summed)
    assert pair.run_rank0("ping") is True


def test_workers_run_at_the_drivers_priority(pair):
    # Ray's default puts workers at nice 15: beside other work at nice 0 they got a few percent of
    # the CPU (ray_utils._RAY_ENV_DEFAULTS).
    assert pair.run_all("niceness") == [os.nice(0), os.nice(0)]


def test_run_sharded_keeps_order_with_uneven_shards(pair):
    batch = Batch(x=torch.arange(7), name=[f"s{i}" for i in range(7)])
    out = pair.run_sharded("tag_shard", batch, scale=2)
    # rank 0 gets rows 0-3, rank 1 rows 4-6; +200*rank (scale 2) +1 (offset)
    assert out["x"].tolist() == [1, 2, 3, 4, 205, 206, 207]
    assert out["rank"] == [0, 0, 0, 0, 1, 1, 1]
    assert out["name"] == batch["name"]
    assert out["ids"].tolist() == [[7, 0]] * 4 + [[7, 7]] * 3  # rank 0's width-1 rows padded with 0

    refs = pair.run_sharded_async("tag_shard", batch, common_kwargs={"scale": 0})
    padded = pair.gather(refs, pad_values={"ids": -1})
    assert padded["x"].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert padded["ids"][0].tolist() == [7, -1]


def test_get_timeout_names_the_slow_rank(pair):
    refs = [pair.run_single_async(0, "sleep", 0.0), pair.run_single_async(1, "sleep", 10.0)]
    pair.get(refs[:1])  # rank 0 has answered, however busy the machine, before the short wait below
    with pytest.raises(WorkerTimeoutError, match=r"rank 1 \(sleep") as caught:
        pair.get(refs, timeout=0.5)
    assert "rank 0" not in str(caught.value)
    assert pair.run_all("ping") == [True, True]  # the group stays usable once the slow call ends


def test_unknown_method_is_a_clear_error(pair):
    with pytest.raises(AttributeError, match="EchoWorker.*'no_such_method'"):
        pair.run_all("no_such_method")


def test_dead_worker_is_reported_without_waiting_for_the_hung_one(ray_cluster):
    cluster = VirtualCluster([2], name="crash")
    group = WorkerGroup(cluster, CrashingWorker, name="crashy")
    try:
        refs = group.run_all_async("rank1_exits_while_rank0_hangs")
        with pytest.raises(WorkerError) as info:
            group.get(refs, timeout=100)  # a WorkerTimeoutError here would mean we waited for rank 0 (120 s)
        assert not isinstance(info.value, WorkerTimeoutError)
        message = str(info.value)
        assert message.startswith("WorkerGroup 'crashy': rank 1 (rank1_exits_while_rank0_hangs, node ")
        assert "ActorDiedError" in message.splitlines()[0]
        assert group.workers[1]._actor_id.hex() in message
    finally:
        group.shutdown(timeout_s=0.5)  # rank 0 is still asleep; it gets killed
        group.shutdown()  # idempotent
        cluster.shutdown()


def test_a_frozen_or_stuck_worker_is_named_and_the_group_restarts(ray_cluster, monkeypatch):
    # The stacks come within a beat or two; waiting up to 10 minutes only guards against a busy machine.
    monkeypatch.setattr(progress, "STACK_WAIT_S", 600.0)
    cluster = VirtualCluster([2], name="frozen")
    # The heartbeat's bound is long enough that a healthy member's beat is never late on a busy
    # machine (a false "stopped answering" would hide the stuck call's "no progress" below).
    group = WorkerGroup(cluster, EchoWorker, name="frozen", heartbeat_timeout_s=10.0,
                        progress_limits=ProgressLimits({"stall_in_sleep": 2.0}))
    try:
        pids = group.run_all("pid")
        ref = group.run_single_async(1, "sleep", 60.0)
        os.kill(pids[1], signal.SIGSTOP)  # frozen: alive to Ray, silent to its heartbeat
        # A deadline far beyond the heartbeat's: the message says which of the two ended the wait.
        with pytest.raises(WorkerTimeoutError, match=r"'frozen': stopped answering: rank 1 \(node .*no heartbeat") as info:
            group.get([ref], timeout=600)
        assert (info.value.group, info.value.ranks) == ("frozen", (1,))
        assert group.faults() == []  # frozen, not dead

        group.restart()  # every member again, as a new process group
        assert set(group.run_all("pid")).isdisjoint(pids)
        assert group.run_all("sum_of_ranks_plus_one") == [3.0, 3.0]

        # Alive and beating, but stuck: rank 1 sleeps inside the call, rank 0 waits for it in a
        # collective. The call is past its phase's bound (2 s) long before the deadline of the wait.
        with pytest.raises(WorkerTimeoutError, match=r"'frozen': no progress: ") as info:
            group.get(group.run_all_async("stall_in_sleep"), timeout=600)
        message = str(info.value)
        assert (info.value.group, info.value.ranks) == ("frozen", (0, 1)), message
        assert re.search(r"rank 1 \(node [^)]*\), no progress in stall_in_sleep for \d+s \(bound 2s: "
                         r"cluster.progress_timeout_s.stall_in_sleep=2\), stuck in stall_in_sleep \(test_worker_group.py:",
                         message), message
        rank0 = message.split("; ")[0]  # rank 0, waiting for rank 1 in the collective
        assert rank0.startswith("WorkerGroup 'frozen': no progress: rank 0 (node ") and "all_reduce" in rank0, message
        group.restart()
        assert group.run_all("sum_of_ranks_plus_one") == [3.0, 3.0]

        os.kill(group.run_all("pid")[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (faults := group.faults()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert faults == [(0, "died: its process exited (killed by a signal, out of memory, or crashed)", None)]
    finally:
        group.shutdown()
        cluster.shutdown()


def test_failing_constructor_is_reported(ray_cluster):
    cluster = VirtualCluster([1], name="badinit")
    try:
        with pytest.raises(WorkerError, match="(?s)rank 0.*model path does not exist"):
            WorkerGroup(cluster, FailingInitWorker, name="bad")
    finally:
        cluster.shutdown()


def test_impossible_request_fails_at_once_with_both_numbers(ray_cluster):
    # The preflight answers without waiting for placement_timeout_s (an hour here).
    with pytest.raises(ClusterError) as info:
        VirtualCluster([20], cpus_per_bundle=1.0, placement_timeout_s=3600.0, name="toobig")
    message = str(info.value)
    assert message.startswith("VirtualCluster 'toobig': the Ray cluster cannot hold this request")
    assert re.search(r"CPU: asked 20, the cluster has \d", message)  # less what other tests' groups hold
    assert "node " in message and "cluster.autoscaling=true" in message
    with pytest.raises(ClusterError, match="GPU: asked 1, the cluster has 0"):
        VirtualCluster([1], use_gpus=True, placement_timeout_s=3600.0, name="nogpu")
    # What this job already holds counts: a second group that only fits in an empty cluster fails at once too.
    from posttrain.distributed.cluster import _held_by_this_job

    unheld = RAY_TEST_CPUS - int(_held_by_this_job().get("CPU", 0))  # other tests' fixtures may hold some
    first = VirtualCluster([unheld - 1], name="holder")
    try:
        with pytest.raises(ClusterError) as info:
            VirtualCluster([2], placement_timeout_s=3600.0, name="second")
        assert "CPU: asked 2, the cluster has 1" in str(info.value)
        assert f"this job's other worker groups already hold {{CPU: {RAY_TEST_CPUS - 1}}}" in str(info.value)
    finally:
        first.shutdown()
    # Nothing was reserved for the refused requests.
    names = [pg["name"] for pg in ray.util.placement_group_table().values()]
    assert not any(name.startswith(("toobig", "nogpu", "second")) for name in names)


def test_autoscaling_waits_for_nodes_then_says_so(ray_cluster):
    with pytest.raises(ClusterError) as info:
        VirtualCluster([20], placement_timeout_s=1.0, autoscaling=True, name="scaleup")
    message = str(info.value)
    assert "not ready after 1.0s" in message and "the autoscaler has not added the nodes yet" in message
    assert "[20] bundles" in message and "{'CPU': 1.0}" in message and "available" in message
    # The half-made reservation was released, not left pending.
    states = [pg["state"] for pg in ray.util.placement_group_table().values() if pg["name"].startswith("scaleup")]
    assert states and set(states) == {"REMOVED"}


def test_colocated_groups_share_bundles(ray_cluster):
    cluster = VirtualCluster([2], max_colocated_worker_groups=2, placement_timeout_s=300.0, name="coloc")
    assert cluster.actor_resources() == {"num_cpus": 0.5}
    first = WorkerGroup(cluster, EchoWorker, name="policy")
    second = WorkerGroup(cluster, EchoWorker, init_kwargs={"offset": 10}, name="generation")
    try:
        assert first.run_all("sum_of_ranks_plus_one") == [3.0, 3.0]
        assert second.run_all("sum_of_ranks_plus_one") == [3.0, 3.0]
        assert first.run_all("env")[0]["MASTER_PORT"] != second.run_all("env")[0]["MASTER_PORT"]
        # Without env_vars the members set their own variables in their constructors (no runtime_env).
        assert [[e[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")] for e in first.run_all("env")] == \
            [["0", "2", "0"], ["1", "2", "1"]]
        out = second.run_sharded("tag_shard", Batch(x=torch.zeros(2, dtype=torch.long)))
        assert out["x"].tolist() == [10, 110]
        # A full bundle is polled for room up to placement_timeout_s (resource views lag behind actor
        # deaths); generous above for placing the bundles on a busy machine, short here.
        cluster.placement_timeout_s = 2.0
        with pytest.raises(ClusterError, match="no room.*max_colocated_worker_groups=2"):
            WorkerGroup(cluster, EchoWorker, name="third")
    finally:
        first.shutdown()
        second.shutdown()
        cluster.shutdown()


def test_bad_arguments(ray_cluster):
    with pytest.raises(ValueError, match="bundles_per_node"):
        VirtualCluster([0])
    cluster = VirtualCluster([1], name="args")
    try:
        with pytest.raises(TypeError, match="plain subclass of DistributedWorker"):
            WorkerGroup(cluster, ray.remote(EchoWorker))
        with pytest.raises(ValueError, match="RANK"):
            WorkerGroup(cluster, EchoWorker, env_vars={"RANK": "3"})
        with pytest.raises(ValueError, match="out of range"):
            WorkerGroup(cluster, EchoWorker, bundle_indices=[1])
    finally:
        cluster.shutdown()


def test_a_rendezvous_port_taken_before_rank_0_listens_starts_the_group_on_another(ray_cluster, monkeypatch):
    """The port found free for the rendezvous can be bound by another process before rank 0's store
    listens on it (a parallel test did it in CI): the group starts again on a new port."""
    import socket

    from posttrain.distributed.worker_group import is_port_taken

    cluster = VirtualCluster([2], name="porttaken")
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    real = cluster.master_address_and_port
    ports: list[int] = []

    def first_the_taken_port(bundle: int = 0):
        address, port = real(bundle)
        ports.append(taken.getsockname()[1] if not ports else port)
        return address, ports[-1]

    monkeypatch.setattr(cluster, "master_address_and_port", first_the_taken_port)
    try:
        group = WorkerGroup(cluster, EchoWorker, name="echo-port")
        envs = group.run_all("env")
        assert len(ports) == 2 and [e["MASTER_PORT"] for e in envs] == [str(ports[1])] * 2
        assert group.run_all("sum_of_ranks_plus_one") == [3.0, 3.0]
        group.shutdown()
    finally:
        taken.close()
        cluster.shutdown()
    assert not is_port_taken(ValueError("model path does not exist"))


class StallingEnv(Environment):
    """Rewards 1, except that a step whose first row asks it to stall never returns (a deadlock)."""

    def __init__(self, cfg=None) -> None:
        self.stuck = threading.Event()

    def step(self, message_logs, metadata):
        if metadata[0].get("stall"):
            self.stuck.wait()  # never set
        n = len(message_logs)
        return EnvironmentReturn([{"role": "environment", "content": ""}] * n, list(metadata), [None] * n,
                                 torch.ones(n), torch.ones(n, dtype=torch.bool), [None] * n)


def test_an_environment_step_that_makes_no_progress_is_named_with_where_it_is_stuck(ray_cluster, monkeypatch):
    monkeypatch.setattr(progress, "STACK_WAIT_S", 600.0)  # as above: a guard, not a wait
    actor = create_env("stall", cls=StallingEnv, beat_period_s=0.5)
    envs = EnvironmentActors({"stall": actor}, {"stall": "stall"}, {"stall": (StallingEnv, None, "ray")},
                             step_timeout_s=600.0, heartbeat_timeout_s=60.0,
                             progress_limits=ProgressLimits({"env_step": 2.0}), beat_period_s=0.5)
    try:
        logs = [[{"role": "user", "content": "hi"}]]
        assert launch_step(envs, logs, [{}], ["stall"]).result().rewards.tolist() == [1.0]
        with pytest.raises(WorkerTimeoutError, match=r"^environment 'stall': no progress: its actor \w+, no progress in "
                                                      r"env_step for \d+s \(bound 2s: cluster.progress_timeout_s.env_step=2\), "
                                                      r"stuck in wait \(threading.py:\d+\) .*<- step \(test_worker_group.py:") as info:
            launch_step(envs, logs, [{"stall": True}], ["stall"]).result()
        assert info.value.group == "env:stall"
        envs.restart("stall")  # what a run's recovery does with it
        assert launch_step(envs, logs, [{}], ["stall"]).result().rewards.tolist() == [1.0]
    finally:
        EnvRouter(envs).shutdown()
