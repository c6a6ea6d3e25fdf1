"""Tensor, sequence, context, expert and pipeline parallelism on CPU: training tokens/s and peak memory per worker.

    python benchmarks/tensor_parallel.py [--model tiny] [--seq-lens 2048 4096] [--rows 2] [--steps 2]
                                         [--settings tp=1 tp=2 "tp=2 + SP" cp=2 "cp=2 x tp=2 + SP" pp=2]

For each sequence length, the same batch (`--rows` rows of that many tokens, NLL loss, AdamW)
trains on 1 worker, on a TP group of 2, on a TP group of 2 with sequence parallelism, on a
context-parallel group of 2 (ring attention), on 4 workers as 2 CP ranks x 2 TP ranks with SP,
and on two pipeline stages (`pp=2`, 1F1B; give it `--rows 2` or more: one micro-batch per row, and
1F1B runs at least one per stage), each in fresh worker processes. For a mixture of experts
(`--model 100m-qwen3_moe`): `dp=2` (FSDP2 over 2 workers, experts sharded like every other weight)
and `ep=2` (the experts split over the 2 workers, tokens sent to them by all-to-all;
`expert_parallel_size=2`). Prints valid training tokens/s after a warm-up step and each worker's
peak resident memory (which includes the ~0.5-1 GiB of torch and the model; the differences
between settings are the activations and the sharded weights). On a 2-core CPU shared with other
work the tokens/s measure contention as much as parallelism; the memory is the point.
"""

from __future__ import annotations

import argparse
import time

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch

from posttrain.algorithms.loss import NLLLoss
from posttrain.config.schema import PolicyConfig
from posttrain.distributed.batch import Batch
from posttrain.distributed.cluster import VirtualCluster
from posttrain.distributed.ray_utils import init_ray, shutdown_ray
from posttrain.models.policy.policy import Policy

SETTINGS = [("tp=1", dict(num_workers=1)), ("tp=2", dict(num_workers=2, tensor_parallel_size=2)),
            ("tp=2 + SP", dict(num_workers=2, tensor_parallel_size=2, sequence_parallel=True)),
            ("cp=2", dict(num_workers=2, context_parallel_size=2)),
            ("cp=2 x tp=2 + SP", dict(num_workers=4, context_parallel_size=2, tensor_parallel_size=2,
                                      sequence_parallel=True)),
            ("dp=2", dict(num_workers=2)), ("ep=2", dict(num_workers=2, expert_parallel_size=2)),
            ("pp=2", dict(num_workers=2, pipeline_parallel_size=2))]


def make_batch(rows: int, seq_len: int, vocab: int = 100, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, vocab, (rows, seq_len), generator=g)
    return Batch(input_ids=ids, input_lengths=torch.full((rows,), seq_len), token_mask=torch.ones(rows, seq_len),
                 sample_mask=torch.ones(rows))


def measure(name: str, overrides: dict, args: argparse.Namespace, batch: Batch) -> tuple[float, list[float]]:
    """(tokens/s, peak RSS MiB of each worker) of one setting."""
    cfg = PolicyConfig(model_name=args.model, train_global_batch_size=args.rows, train_micro_batch_size=1,
                       max_total_sequence_length=batch["input_ids"].shape[1], **overrides)
    cluster = VirtualCluster([cfg.num_workers], name="bench_tp")
    policy = Policy(cluster, cfg, init_reference_model=False, name="bench_tp")
    try:
        policy.train(batch, NLLLoss())  # warm-up: allocations, first collectives
        tokens, start = 0.0, time.perf_counter()
        for _ in range(args.steps):
            tokens += policy.train(batch, NLLLoss())["global_valid_toks"]
        elapsed = time.perf_counter() - start
        return tokens / elapsed, policy.worker_group.run_all("peak_rss_mb")
    finally:
        policy.shutdown()
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="policy.model_name (default tiny)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096], help="tokens per row (default 2048 4096)")
    parser.add_argument("--rows", type=int, default=2, help="rows per optimizer step, one per micro-batch (default 2)")
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps per setting (default 2)")
    parser.add_argument("--settings", nargs="+", choices=[name for name, _ in SETTINGS], default=[name for name, _ in SETTINGS[:5]],
                        help="which settings to run (default all but dp=2 and ep=2, which are for mixtures of experts)")
    args = parser.parse_args()
    init_ray(num_cpus=4, env_vars={"OMP_NUM_THREADS": "1"})
    try:
        print(f"{'tokens':>7} {'setting':<17} {'tokens/s':>9}  peak RSS per worker (MiB)")
        for seq_len in args.seq_lens:
            batch = make_batch(args.rows, seq_len)
            for name, overrides in [(n, o) for n, o in SETTINGS if n in args.settings]:
                speed, rss = measure(name, overrides, args, batch)
                print(f"{seq_len:>7} {name:<17} {speed:>9.0f}  {', '.join(f'{r:.0f}' for r in rss)}", flush=True)
    finally:
        shutdown_ray()


if __name__ == "__main__":
    main()
