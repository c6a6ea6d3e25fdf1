"""Progress bounds (`posttrain.distributed.progress`): a phase's bound, set by the user or derived
from its slowest call so far, which calls are past theirs, and where a stuck call is, from the
Python stacks of its worker's threads."""

from __future__ import annotations

import threading

from posttrain.distributed.progress import ProgressLimits, ProgressWatch, describe_overdue, format_stacks, where_stuck


def test_a_phase_is_bounded_by_the_users_setting_else_by_its_slowest_call_so_far():
    now = [0.0]
    watch = ProgressWatch(ProgressLimits({"train": 30.0}, factor=5.0, floor_s=10.0), clock=lambda: now[0])
    assert watch.bound("generate") == (None, "")  # no generate finished yet: only worker_timeout_s bounds it
    assert watch.bound("train") == (30.0, "cluster.progress_timeout_s.train=30")
    for seconds in (1.0, 4.0, 2.0):  # three generate calls; the slowest counts
        watch.started(("g", seconds), "generate")
        now[0] += seconds
        watch.finished(("g", seconds))
    assert watch.bound("generate") == (20.0, "5x the slowest generate so far, 4.0s, at least "
                                              "cluster.progress_timeout_floor_s=10")
    watch.started("tiny", "get_node_ip")
    now[0] += 0.1
    watch.finished("tiny")
    assert watch.bound("get_node_ip")[0] == 10.0  # the floor
    assert ProgressWatch(ProgressLimits(factor=0.0)).bound("generate") == (None, "")
    assert not ProgressLimits(factor=0.0).enabled and ProgressLimits({"train": 1.0}).enabled


def test_calls_past_their_bound_are_overdue_and_forgotten_ones_are_not():
    now = [100.0]
    watch = ProgressWatch(ProgressLimits({"train": 5.0, "env_step": 2.0}), clock=lambda: now[0])
    watch.started("rank0", "train")
    watch.started("rank1", "train")
    watch.started("env", "env_step")
    watch.started("unbounded", "generate")
    now[0] += 3.0
    assert [late[:2] for late in watch.overdue(["rank0", "rank1", "env", "unbounded"])] == [("env", "env_step")]
    now[0] += 3.0
    watch.finished("rank0")
    watch.forget(["env"])
    assert watch.overdue(["rank0", "rank1", "env", "unbounded"]) == [
        ("rank1", "train", 6.0, 5.0, "cluster.progress_timeout_s.train=5")]
    # The other ranks of a late call are named with it, even when they started a moment later.
    watch.started("rank2", "train")
    now[0] += 0.5
    assert [(late[0], late[2]) for late in watch.overdue(["rank1", "rank2"])] == [("rank1", 6.5), ("rank2", 0.5)]


def test_the_next_check_comes_when_the_first_running_call_reaches_its_bound():
    now = [100.0]
    watch = ProgressWatch(ProgressLimits({"train": 15.0, "env_step": 2.0}), clock=lambda: now[0])
    assert watch.due_in(["rank0"]) is None  # not running
    watch.started("rank0", "train")
    watch.started("unbounded", "generate")
    assert watch.due_in(["unbounded"]) is None
    now[0] += 10.0
    assert watch.due_in(["rank0", "unbounded"]) == 5.0
    watch.started("env", "env_step")
    assert watch.due_in(["rank0", "env"]) == 2.0 and watch.due_in(["rank0"]) == 5.0
    now[0] += 6.0
    assert watch.due_in(["rank0", "env"]) == 0.0  # past due: look now
    watch.finished("rank0")
    watch.forget(["env"])
    assert watch.due_in(["rank0", "env"]) is None


def stuck_in_a_deadlock(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait()  # stands for a lock nobody releases


def test_the_stacks_say_where_a_call_is_stuck():
    started, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=stuck_in_a_deadlock, args=(started, release), name="worker-call")
    thread.start()
    try:
        assert started.wait(timeout=600)
        stacks = format_stacks(skip=[threading.get_ident()])
    finally:
        release.set()
        thread.join()
    assert 'Thread "worker-call":' in stacks and "test_the_stacks_say_where" not in stacks  # its own thread left out
    where = where_stuck(stacks, "stuck_in_a_deadlock")
    # The innermost frames first: threading's wait, called by the stuck function.
    assert where.startswith("wait (threading.py:") and "<- stuck_in_a_deadlock (test_progress.py:" in where, where
    line = describe_overdue("rank 1 (node 10.0.0.2)", "train", "stuck_in_a_deadlock", 61.0, 60.0,
                            "cluster.progress_timeout_s.train=60", stacks)
    assert line.startswith("rank 1 (node 10.0.0.2), no progress in train for 61s (bound 60s: "
                           "cluster.progress_timeout_s.train=60), stuck in wait (threading.py:"), line
    assert describe_overdue("rank 0", "train", "train", 61.0, 60.0, "x", None).endswith(
        "its stacks did not come (a frozen process?)")
