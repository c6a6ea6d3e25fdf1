"""`start_concurrently`: worker groups start in parallel; a failure shuts down the others."""

import threading
import time

import pytest

from posttrain.job import start_concurrently


class FakeGroup:
    def __init__(self, name: str, delay: float = 0.0, fail: bool = False):
        time.sleep(delay)
        if fail:
            raise RuntimeError(f"{name} could not start")
        self.name = name
        self.thread = threading.current_thread().name
        self.stopped = False

    def shutdown(self):
        self.stopped = True


def test_results_in_order_and_started_in_parallel():
    # Each maker waits for the other at a barrier: run one after the other, they would break it.
    both_started = threading.Barrier(2, timeout=120)

    def make(name):
        both_started.wait()
        return FakeGroup(name)

    a, b = start_concurrently(lambda: make("a"), lambda: make("b"))
    assert (a.name, b.name) == ("a", "b")
    assert a.thread != b.thread


def test_failure_shuts_down_the_groups_that_started():
    started = []

    def make_ok():
        group = FakeGroup("ok", delay=0.1)
        started.append(group)
        return group

    with pytest.raises(RuntimeError, match="policy could not start"):
        start_concurrently(lambda: FakeGroup("policy", fail=True), make_ok)
    assert len(started) == 1 and started[0].stopped
