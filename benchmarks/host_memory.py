"""Host memory and time of bfloat16 training steps on CPU under oneDNN's primitive cache bound and
glibc trimming, side by side in one run.

    ./run.sh python benchmarks/host_memory.py                    # tiny-gemma3, 12 steps of 4 micro-batches
    ./run.sh python benchmarks/host_memory.py --model gemma3-270m --steps 6

RL steps meet new matmul shapes all the time (every micro-batch and prefill has its own token
count), and oneDNN compiles and caches a primitive, with working memory of its own, per shape
(`posttrain/utils/onednn.py`). Each setting runs in a process of its own (oneDNN reads its cache
capacity at its first primitive):
- posttrain: the default posttrain sets (`ONEDNN_PRIMITIVE_CACHE_CAPACITY=64`), and
  `release_freed_memory()` (glibc's `malloc_trim`) after each step, as at each phase boundary;
- no trim: the same cache bound, without the trim;
- oneDNN default: the cache's own 1024, with the trim;
- float32: posttrain's settings without autocast (MKL's sgemm, no oneDNN cache), for reference.
The settings run in turn, `--repeats` rounds; each figure is the median over rounds.
Each step trains `--micro-batches` micro-batches whose token counts are drawn anew (the same draws
in every setting) under bfloat16 autocast, forward and backward, then an AdamW step. Printed per
setting: the median step time (and its ratio to posttrain's), the resident set after the first
step and after the last (its growth per step), and the highest resident set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import posttrain  # noqa: F401  (first: sets posttrain's environment defaults)

SETTINGS = {
    "posttrain": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "TRIM": "1", "DTYPE": "bfloat16"},
    "no trim": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "TRIM": "0", "DTYPE": "bfloat16"},
    "oneDNN default": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "TRIM": "1", "DTYPE": "bfloat16"},
    "float32": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "TRIM": "1", "DTYPE": "float32"},
}


def measure(args) -> dict:
    """Step times and resident sets of `args.steps` bfloat16 training steps, in this process."""
    import random

    import torch

    from posttrain.models.hf import load_causal_lm, resolve_model_path
    from posttrain.utils import memory

    torch.manual_seed(0)
    draw = random.Random(0)
    model = load_causal_lm(resolve_model_path(args.model), dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    vocab = model.config.vocab_size
    times, rss = [], []
    memory.reset_peak_rss()
    for _ in range(args.steps):
        start = time.perf_counter()
        for _ in range(args.micro_batches):
            rows, length = draw.randint(2, 8), draw.randint(16, args.max_length)
            ids = torch.randint(0, vocab, (rows, length))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=os.environ["DTYPE"] == "bfloat16"):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if os.environ.get("TRIM") == "1":
            memory.release_freed_memory()
        times.append(time.perf_counter() - start)
        rss.append(memory.rss_bytes() / 2**30)
    return {"step_s": statistics.median(times), "rss_first": rss[0], "rss_last": rss[-1],
            "peak": memory.peak_rss_bytes() / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-gemma3")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    rounds: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for name, env in SETTINGS.items():
            out = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=os.environ | env,
                                 capture_output=True, text=True, check=True).stdout
            rounds[name].append(json.loads(out.strip().splitlines()[-1]))
    results = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
               for name, runs in rounds.items()}
    base = results["posttrain"]["step_s"]
    print(f"{args.model}, {args.steps} steps of {args.micro_batches} micro-batches "
          f"(token counts drawn anew), median of {args.repeats} rounds")
    print(f"{'setting':<16} {'step s':>7} {'x':>6} {'RSS step 1':>11} {'RSS last':>9} {'GiB/step':>9} {'peak':>6}")
    for name, r in results.items():
        growth = (r["rss_last"] - r["rss_first"]) / max(1, args.steps - 1)
        print(f"{name:<16} {r['step_s']:>7.3f} {r['step_s'] / base:>6.2f} {r['rss_first']:>11.2f} "
              f"{r['rss_last']:>9.2f} {growth:>9.3f} {r['peak']:>6.2f}")


if __name__ == "__main__":
    main()
