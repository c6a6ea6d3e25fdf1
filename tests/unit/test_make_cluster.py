"""How `make_cluster` lays workers out over nodes (VirtualCluster replaced by a recorder)."""

from types import SimpleNamespace

import pytest

import posttrain.distributed.cluster as cluster_module
from posttrain.job import make_cluster
from posttrain.config import load_config


@pytest.fixture
def layouts(monkeypatch):
    made = []
    def record(bundles_per_node, **kw):
        made.append((bundles_per_node, kw["use_gpus"]))
        return SimpleNamespace()

    monkeypatch.setattr(cluster_module, "VirtualCluster", record)
    return made


@pytest.mark.parametrize("overrides, workers, expected", [
    ([], 2, ([2], False)),                                         # CPU, one node: all there
    (["cluster.num_nodes=2"], 4, ([2, 2], False)),                 # CPU: spread evenly
    (["cluster.num_nodes=2"], 3, ([2, 2], False)),                 # rounded up per node
    (["cluster.gpus_per_node=8", "cluster.num_nodes=2"], 16, ([8, 8], True)),
    (["cluster.gpus_per_node=8"], 4, ([4], True)),                 # fewer workers than GPUs
])
def test_layout(layouts, overrides, workers, expected):
    make_cluster(load_config("grpo", overrides=["cluster.backend=ray", *overrides]), workers)
    assert layouts == [expected]


def test_auto_backend_runs_a_one_process_job_locally(layouts):
    """The default job fits one process: no Ray cluster is reserved, the workers get every core
    unless cluster.cpus_per_worker says otherwise."""
    from posttrain.distributed.actors import LocalCluster, available_cpus

    local = make_cluster(load_config("grpo"), 1)
    assert isinstance(local, LocalCluster) and layouts == []
    assert local.cpus_per_bundle == available_cpus()
    assert make_cluster(load_config("grpo", overrides=["cluster.cpus_per_worker=1"]), 1).cpus_per_bundle == 1.0


def test_too_few_gpu_nodes_is_an_error(layouts):
    with pytest.raises(ValueError, match=r"needs 16 workers but cluster.num_nodes=1 x 8 per node is too few"):
        make_cluster(load_config("grpo", overrides=["cluster.gpus_per_node=8"]), 16)
