"""`cluster_reuse`'s bookkeeping on stand-in clusters (no Ray): what is parked, what is handed out,
what is released. tests/functional/test_cluster_reuse.py runs the same on real clusters and jobs.
Earlier tests of the session may have parked real clusters: counts are taken per shape."""

from __future__ import annotations

import pytest

from posttrain.distributed import cluster_reuse


class StandIn:
    """What `cluster_reuse` asks of a `VirtualCluster`."""

    def __init__(self) -> None:
        self.reuse_key = None
        self.groups: list[object] = []
        self.released = 0

    def open_groups(self) -> list[object]:
        return list(self.groups)

    def reservation_stands(self) -> bool:
        return self.released == 0

    def release(self) -> None:
        self.released += 1


@pytest.fixture
def reuse():
    was = cluster_reuse.reusing()
    cluster_reuse.reuse_clusters(True)
    yield
    cluster_reuse.release_idle()  # no stand-in stays parked
    cluster_reuse.reuse_clusters(was)


def test_a_cluster_shut_down_cleanly_serves_the_next_job_of_its_shape_only(reuse):
    first = cluster_reuse.take("a", StandIn)
    assert first.reuse_key == "a" and cluster_reuse.keep(first) and cluster_reuse.keep(first)
    assert cluster_reuse.parked_count("a") == 1  # kept twice, parked once
    other = cluster_reuse.take("b", StandIn)
    assert other is not first and cluster_reuse.parked_count("a") == 1
    assert cluster_reuse.take("a", StandIn) is first and cluster_reuse.parked_count("a") == 0
    assert cluster_reuse.take("a", StandIn) is not first  # handed out once
    assert first.released == 0


def test_an_open_group_or_a_fallen_reservation_is_not_parked(reuse):
    busy = cluster_reuse.take("a", StandIn)
    busy.groups.append(object())
    assert not cluster_reuse.keep(busy)
    gone = cluster_reuse.take("a", StandIn)
    gone.released = 1  # Ray restarted under it
    assert not cluster_reuse.keep(gone)
    assert not cluster_reuse.keep(StandIn())  # not made by `take`
    assert cluster_reuse.parked_count("a") == 0


def test_a_parked_cluster_whose_reservation_fell_is_released_and_replaced(reuse):
    parked = cluster_reuse.take("a", StandIn)
    assert cluster_reuse.keep(parked)
    parked.released = 1
    fresh = cluster_reuse.take("a", StandIn)
    assert fresh is not parked and parked.released == 2  # released again: the idle processes go too


def test_release_idle_and_turning_reuse_off_release_what_is_parked(reuse):
    parked = [cluster_reuse.take(key, StandIn) for key in ("a", "b")]
    assert all(cluster_reuse.keep(cluster) for cluster in parked)
    assert cluster_reuse.release_idle() == 2 and [c.released for c in parked] == [1, 1]
    again = cluster_reuse.take("a", StandIn)
    assert cluster_reuse.keep(again)
    cluster_reuse.reuse_clusters(False)
    assert again.released == 1 and cluster_reuse.parked_count() == 0
    built = cluster_reuse.take("a", StandIn)
    assert built.reuse_key is None and not cluster_reuse.keep(built)  # off: every job builds and releases


def test_shapes_equal_in_content_share_a_key_whatever_their_dicts_order():
    shape = dict(bundles_per_node=[2], use_gpus=False, name="policy", bundle_resources={"a": 1.0, "b": 2.0})
    reordered = dict(reversed(list({**shape, "bundle_resources": {"b": 2.0, "a": 1.0}}.items())))
    assert cluster_reuse.shape_key(shape) == cluster_reuse.shape_key(reordered)
    assert cluster_reuse.shape_key(shape) != cluster_reuse.shape_key({**shape, "bundle_resources": {"a": 1.0}})
    assert cluster_reuse.shape_key(shape) != cluster_reuse.shape_key({**shape, "bundles_per_node": [1, 1]})
