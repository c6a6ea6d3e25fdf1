"""Sharded loading (issue 24, item 4): with several policy workers only rank 0 reads the checkpoint;
the others build on the meta device and receive their FSDP / tensor-parallel shards, so no rank but
0 ever holds a full float32 copy. Measured with each worker's peak resident set during its model
load (`PolicyWorker.get_load_host_memory`, `posttrain.utils.memory`), 2 workers against 1.

The checkpoint is the 100m preset (397 MiB in float32, 12 layers of 768 x 3072, no tensor over
9 MiB) saved in bfloat16, as hub checkpoints are: loading it in float32 converts every tensor, so a
rank that reads it holds the whole float32 model. (A float32 checkpoint would not show it: its
tensors stay copy-on-write maps of the file, and a rank that shards without sharded loading touches
only the pages of its own shard.)

Measured on 2 cores (MiB above the resident set before the load): 1 worker 607; 2 workers (FSDP)
rank 0 613, rank 1 351; 2 workers (TP) rank 0 640, rank 1 280. Without sharded loading every rank of
both pairs took 607.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.config.loader import load_config
from posttrain.job import make_cluster

# The timeout is a hang guard, not a speed test.
pytestmark = [pytest.mark.functional, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def bfloat16_checkpoint(tmp_path_factory):
    from posttrain.models.hf import load_causal_lm, load_tokenizer

    out = tmp_path_factory.mktemp("llama-100m-bf16")
    load_causal_lm("100m").to(torch.bfloat16).save_pretrained(out)
    load_tokenizer("100m").save_pretrained(out)
    return str(out)


def _load(model: str, workers: int, tp: int) -> tuple[list[dict[str, int]], str, int]:
    """Start `workers` policy workers (`tp` per tensor-parallel group) on `model`: each worker's
    load memory, the weights' checksum and the float32 model's bytes."""
    from posttrain.models.policy.policy import Policy

    cfg = load_config("grpo", overrides=[
        "policy.scheduler.name=constant",  # a Policy built outside a job has no run length to decay over
        "sft_warmup=null", "cluster.backend=ray", f"policy.model_name={model}", f"policy.num_workers={workers}",
        f"policy.tensor_parallel_size={tp}", "policy.train_global_batch_size=2", "policy.train_micro_batch_size=1",
    ])
    cluster = make_cluster(cfg, workers, name=f"sharded-load-{workers}-tp{tp}")
    try:
        policy = Policy(cluster, cfg.policy, init_reference_model=False, init_optimizer=False)
        try:
            memory = policy.worker_group.run_all("get_load_host_memory")
            model_bytes = sum(4 * math.prod(shape) for _, shape, _ in policy.refit_info())
            return memory, policy.weights_checksum(), model_bytes
        finally:
            policy.shutdown()
    finally:
        cluster.shutdown()


def test_each_of_two_workers_loads_a_shard_not_the_model(ray_cluster, bfloat16_checkpoint):
    """Per worker, 2 against 1: rank 1 of a pair (FSDP, and TP) peaks at least 40% of a model below
    the single worker, which holds the whole float32 model (every rank did, before sharded
    loading); rank 0 reads the model and keeps its shard: at most the single worker's peak plus
    that shard. The shards hold rank 0's weights (same checksum as the single worker's)."""
    runs = {(workers, tp): _load(bfloat16_checkpoint, workers, tp) for workers, tp in ((1, 1), (2, 1), (2, 2))}
    model_bytes = runs[(1, 1)][2]
    load = {key: [m["peak"] - m["rss_before"] for m in memory] for key, (memory, _, _) in runs.items()}
    print("model", model_bytes >> 20, "MiB; load peak MiB above the resident set before it:",
          {f"{w} workers tp={tp}": [b >> 20 for b in peaks] for (w, tp), peaks in load.items()})
    [single] = load[(1, 1)]
    assert single > 0.9 * model_bytes  # the measure sees the float32 model of a rank that reads it
    for pair in ((2, 1), (2, 2)):
        assert runs[pair][1] == runs[(1, 1)][1], pair
        rank0, rank1 = load[pair]
        assert rank1 < single - 0.4 * model_bytes, (pair, load)
        assert rank0 < single + 0.6 * model_bytes, (pair, load)
