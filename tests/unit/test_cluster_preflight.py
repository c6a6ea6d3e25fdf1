"""`check_request_fits`: the preflight that refuses impossible reservations before Ray waits on them."""

import pytest

from posttrain.distributed.cluster import check_request_fits

ONE_NODE = {"a": {"CPU": 8.0, "GPU": 0.0}}
TWO_GPU_NODES = {"a": {"CPU": 64.0, "GPU": 8.0}, "b": {"CPU": 64.0, "GPU": 8.0}}


def test_a_request_that_fits_has_no_problems():
    assert check_request_fits([{"CPU": 4.0}, {"CPU": 4.0}], ONE_NODE) == []
    assert check_request_fits([{"CPU": 8.0, "GPU": 8.0}] * 2, TWO_GPU_NODES) == []


def test_too_many_cpus_names_both_numbers():
    assert check_request_fits([{"CPU": 20.0}], ONE_NODE) == ["CPU: asked 20, the cluster has 8"]


def test_missing_gpu_and_custom_resource():
    problems = check_request_fits([{"CPU": 1.0, "GPU": 1.0, "trainer": 1.0}], ONE_NODE)
    assert problems == ["GPU: asked 1, the cluster has 0", "trainer: asked 1, the cluster has 0"]


def test_a_group_larger_than_any_node():
    # 16 GPUs exist in total, but one STRICT_PACK group of 16 needs them on one machine.
    problems = check_request_fits([{"CPU": 16.0, "GPU": 16.0}], TWO_GPU_NODES)
    assert problems == ["node group 0 needs {CPU: 16, GPU: 16} on one machine; the largest node has {CPU: 64, GPU: 8}"]


def test_equal_groups_that_do_not_pack():
    # Three groups of 5 GPUs: 15 <= 16 in total, each fits a node, but only one fits per node.
    problems = check_request_fits([{"GPU": 5.0}] * 3, TWO_GPU_NODES)
    assert problems == ["3 node groups of {GPU: 5} each (each on one machine): only 2 fit on the 2 node(s)"]


def test_zero_requests_are_ignored():
    assert check_request_fits([{"CPU": 1.0, "GPU": 0.0}], ONE_NODE) == []


def test_a_local_ray_cluster_too_small_for_the_workers_is_refused_from_the_config(monkeypatch):
    """The local cluster's size is known before Ray starts: 64 workers on 2 cores are refused by
    preflight (issue 26: it took Ray's start and the warm start, 21-45 s, to say so)."""
    import posttrain.distributed.local_resources as job
    from posttrain.config import load_config
    from posttrain.errors import UserError
    from posttrain.preflight import preflight

    monkeypatch.setattr(job, "local_ray_cpus", lambda: 2)
    split = ["policy.generation.colocated.enabled=false", "policy.generation.colocated.num_workers=1"]
    cfg = load_config("grpo", overrides=["sft_warmup=null", "policy.num_workers=2", *split])
    assert job.ray_cpu_request(cfg) == [("policy.num_workers=2", 2.0), ("policy.generation.colocated.num_workers=1", 1.0)]
    problem = job.local_resources_problem(cfg)
    assert problem.startswith("policy.num_workers=2 (2) + policy.generation.colocated.num_workers=1 (1) with "
                              "cluster.cpus_per_worker=1 ask a local Ray cluster for 3 CPUs, but this machine has 2")
    with pytest.raises(UserError, match="ask a local Ray cluster for 64 CPUs"):
        preflight(load_config("grpo", overrides=["sft_warmup=null", "policy.num_workers=64"]))
    # Half a core each fits; a cluster to join, or the local backend, is not this check's business.
    assert job.local_resources_problem(load_config("grpo", overrides=[
        "sft_warmup=null", "policy.num_workers=2", "cluster.cpus_per_worker=0.5", *split])) is None
    assert job.local_resources_problem(load_config("grpo", overrides=[
        "sft_warmup=null", "policy.num_workers=64", "cluster.ray_address=auto"])) is None
    assert job.local_resources_problem(load_config("grpo", overrides=["sft_warmup=null"])) is None
