"""Training throughput of the policy workers: 1 vs 2 data-parallel workers, side by side.

    python benchmarks/train_throughput.py [--model tiny] [--rows 32] [--seq-len 128] [--steps 3]

Both runs train the same model on the same batch (NLL loss, AdamW) in one process tree and
report valid training tokens per second after a warm-up step, and the 2-worker / 1-worker ratio.
On a CPU with fewer cores than workers the ratio measures contention, not scaling.
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


def make_batch(rows: int, seq_len: int, vocab: int = 100, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (rows,), generator=g)
    valid = torch.arange(seq_len)[None] < lengths[:, None]
    ids = torch.randint(7, vocab, (rows, seq_len), generator=g) * valid
    return Batch(input_ids=ids, input_lengths=lengths, token_mask=valid.float(), sample_mask=torch.ones(rows))


def tokens_per_second(num_workers: int, args: argparse.Namespace, batch: Batch) -> float:
    cfg = PolicyConfig(
        model_name=args.model,
        num_workers=num_workers,
        train_global_batch_size=args.rows,
        train_micro_batch_size=args.micro_batch_size,
    )
    cluster = VirtualCluster([num_workers], name=f"bench{num_workers}")
    policy = Policy(cluster, cfg, init_reference_model=False, name=f"bench{num_workers}")
    try:
        policy.train(batch, NLLLoss())  # warm-up: allocations, first collectives
        tokens, start = 0.0, time.perf_counter()
        for _ in range(args.steps):
            tokens += policy.train(batch, NLLLoss())["global_valid_toks"]
        return tokens / (time.perf_counter() - start)
    finally:
        policy.shutdown()
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="policy.model_name (default tiny)")
    parser.add_argument("--rows", type=int, default=32, help="rows per optimizer step (default 32)")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="rows per micro-batch (default 8)")
    parser.add_argument("--seq-len", type=int, default=128, help="longest row (default 128)")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per setting (default 3)")
    args = parser.parse_args()

    init_ray(num_cpus=4, env_vars={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    batch = make_batch(args.rows, args.seq_len)
    try:
        results = {n: tokens_per_second(n, args, batch) for n in (1, 2)}
    finally:
        shutdown_ray()
    print(f"model={args.model} rows={args.rows} seq_len<={args.seq_len} mbs={args.micro_batch_size} "
          f"cpu_threads_per_worker=1 cuda={torch.cuda.is_available()}")
    print(f"{'workers':>8} {'tokens/s':>12}")
    for n, tps in results.items():
        print(f"{n:>8} {tps:>12.0f}")
    print(f"ratio 2/1: {results[2] / results[1]:.2f}x")


if __name__ == "__main__":
    main()
