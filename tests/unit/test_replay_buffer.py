"""The async GRPO replay buffer: FIFO, bounded staleness, bounded size, and waits that end."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from posttrain.algorithms.replay_buffer import AsyncRolloutError, ReplayBuffer


@dataclass
class Group:
    name: str
    weight_version: int


def test_take_returns_the_oldest_fresh_groups_and_evicts_the_stale():
    buffer = ReplayBuffer(capacity=10, max_age=1)
    for name, version in [("a", 0), ("b", 1), ("c", 1), ("d", 2), ("e", 2)]:
        buffer.put(Group(name, version))
    taken = buffer.take(2, current_version=2, timeout=1)
    assert [g.name for g in taken] == ["b", "c"]  # "a" is 2 steps old > max_age 1
    assert buffer.evicted == 1 and buffer.last_ages == [1, 1] and len(buffer) == 2
    assert [g.name for g in buffer.take(2, current_version=3, timeout=1)] == ["d", "e"]


def test_take_waits_for_a_producer_and_times_out_with_the_count():
    buffer = ReplayBuffer(capacity=4, max_age=1)
    threading.Timer(0.2, lambda: [buffer.put(Group(str(i), 0)) for i in range(2)]).start()
    assert len(buffer.take(2, current_version=0, timeout=120)) == 2
    buffer.put(Group("x", 0))
    t0 = time.monotonic()
    with pytest.raises(AsyncRolloutError, match=r"only 1 of 2 prompt groups ready after 0s"):
        buffer.take(2, current_version=0, timeout=0.3)
    assert time.monotonic() - t0 < 60  # the timeout, not a hang


def test_take_stops_at_once_when_the_producer_died():
    buffer = ReplayBuffer(capacity=4, max_age=1)
    reason = []
    threading.Timer(0.2, lambda: reason.append("RuntimeError: boom")).start()
    t0 = time.monotonic()
    with pytest.raises(AsyncRolloutError, match="collector stopped: RuntimeError: boom"):
        buffer.take(1, current_version=0, timeout=600, producer_error=lambda: reason[0] if reason else None)
    assert time.monotonic() - t0 < 60  # long before the 600 s timeout


def test_put_waits_for_room_and_gives_up_on_stop_or_close():
    buffer = ReplayBuffer(capacity=1, max_age=1)
    assert buffer.put(Group("a", 0))
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert buffer.put(Group("b", 0), stop, poll_s=0.05) is False and len(buffer) == 1
    threading.Timer(0.2, lambda: buffer.take(1, current_version=0, timeout=120)).start()
    assert buffer.put(Group("c", 0), threading.Event(), poll_s=0.05) is True
    buffer.close()
    assert buffer.put(Group("d", 0)) is False


def test_state_round_trip_keeps_order_and_counts():
    buffer = ReplayBuffer(capacity=4, max_age=2)
    for i in range(3):
        buffer.put(Group(str(i), i))
    buffer.evicted = 7
    restored = ReplayBuffer(capacity=4, max_age=2)
    restored.load_state_dict(buffer.state_dict())
    assert [g.name for g in restored.take(3, current_version=2, timeout=1)] == ["0", "1", "2"]
    assert restored.evicted == 7


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="capacity=0"):
        ReplayBuffer(capacity=0, max_age=1)
