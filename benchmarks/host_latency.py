"""How long this machine takes to hand work from one process to another: a pipe round trip
between two processes, and a small gloo all-reduce among 2 and 4 single-threaded processes (what
the multi-worker tests do for every layer under tensor, context or pipeline parallelism), with the
CPU each all-reduce costs. Side by side in one run, quiet:

    ./run.sh python benchmarks/host_latency.py [--round-trips 3000] [--all-reduces 300]

Why: the same test suite on the same 2-core VM took 21 min 41 s and, hours before, 34 min 4 s;
the multi-worker tests had slowed most (1.8-2.6x by file), the single-process jobs not at all
(docs/internals.md). Compute speed does not show that; these hand-offs may. Run this beside a
suite timing: no slow hour has been measured with it yet.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from posttrain.environments.resources_server import free_port


def pipe_round_trips(n: int) -> list[float]:
    """Seconds of each of `n` round trips of one byte between this process and a forked child."""
    to_child, from_parent = os.pipe()
    from_child, to_parent = os.pipe()
    pid = os.fork()
    if pid == 0:
        for _ in range(n):
            os.read(to_child, 1)
            os.write(to_parent, b"x")
        os._exit(0)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        os.write(from_parent, b"x")
        os.read(from_child, 1)
        times.append(time.perf_counter() - start)
    os.waitpid(pid, 0)
    return times


def _all_reduce_rank(rank: int, world: int, n: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(1024)  # 4 KiB: latency, not bandwidth
    for _ in range(20):
        dist.all_reduce(x)
    dist.barrier()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_before = usage.ru_utime + usage.ru_stime
    times = []
    for _ in range(n):
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    results.put((rank, statistics.median(times), (usage.ru_utime + usage.ru_stime - cpu_before) / n))
    dist.destroy_process_group()


def gloo_all_reduce(world: int, n: int) -> tuple[float, float]:
    """(median seconds of a 4 KiB all-reduce seen by rank 0, CPU seconds per all-reduce summed over ranks)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_all_reduce_rank, args=(world, n, free_port(), results), nprocs=world, start_method="spawn")
    rows = [results.get() for _ in range(world)]
    return next(median for rank, median, _ in rows if rank == 0), sum(cpu for _, _, cpu in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round-trips", type=int, default=3000)
    parser.add_argument("--all-reduces", type=int, default=300)
    args = parser.parse_args()
    if args.round_trips < 1 or args.all_reduces < 1:
        parser.error("--round-trips and --all-reduces need at least 1")
    trips = sorted(pipe_round_trips(args.round_trips))
    print(f"cores: {len(os.sched_getaffinity(0))}")
    print(f"pipe round trip      median {statistics.median(trips) * 1e6:7.0f} us   "
          f"p90 {trips[int(0.9 * len(trips))] * 1e6:7.0f} us")
    for world in (2, 4):
        median, cpu = gloo_all_reduce(world, args.all_reduces)
        print(f"gloo all-reduce, {world} processes: median {median * 1e6:7.0f} us   CPU {cpu * 1e6:7.0f} us each")


if __name__ == "__main__":
    main()
