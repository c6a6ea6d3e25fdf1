"""Sync vs async GRPO on the embedded default task, side by side in one run on the same cores.

    ./run.sh python benchmarks/async_grpo.py [--steps 250] [--runs sync sync2 async]

Each run is `posttrain grpo` on the embedded default (2-digit additions, the cached SFT warm
start, 16 prompts x 8 generations, 250 steps, validation on 500 problems every 25 steps), in its
own process, one after the other, with checkpointing off:

- `sync`:  the default: one policy worker and its generation engine colocated on one bundle;
           generation and training take turns (one CPU thread each).
- `sync2`: sync with two data-parallel policy workers (and two colocated engines): sync's way of
           using both cores in every phase.
- `async`: `examples/configs/grpo_async_tiny.yaml`: one policy worker and one generation worker,
           each on its own core, overlapping; groups at most one step old.

Printed per run: steps/s (median step time), training time (sum of step times, validation
excluded, the same work for all), the wall time of the whole command, validation accuracy at
each validation, and the training time until the run first reaches the sync run's final
accuracy. Ratios are against `sync`. On a shared 2-core machine timings move by tens of percent
from run to run: compare ratios measured in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = {
    "sync": [],
    "sync2": ["policy.num_workers=2"],
    "async": ["--config", str(REPO / "examples/configs/grpo_async_tiny.yaml")],
}


def run(name: str, steps: int, workdir: Path) -> dict:
    log_dir = workdir / name
    cmd = [sys.executable, "-m", "posttrain", "grpo", *RUNS[name], f"grpo.max_num_steps={steps}",
           f"logger.log_dir={log_dir}", "checkpointing.enabled=false", "logger.progress_bar=false",
           "logger.report=false"]
    print(f"[bench] {name}: {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=os.environ.copy())
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"[bench] {name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    rows: dict[int, dict] = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    step_times = [rows[s]["timing/train/total_step_time"] for s in sorted(rows) if s > 0]
    elapsed, train_time = {}, 0.0
    for s in sorted(rows):
        train_time += rows[s].get("timing/train/total_step_time", 0.0)
        elapsed[s] = train_time
    # The default validation is greedy (one answer per prompt): posttrain.utils.metric_names.
    accuracy = {s: rows[s]["validation/accuracy_greedy"] for s in sorted(rows) if "validation/accuracy_greedy" in rows[s]}
    return {"wall": wall, "median_step": statistics.median(step_times), "train_time": train_time,
            "accuracy": accuracy, "elapsed": elapsed}


def time_to_reach(result: dict, target: float) -> float | None:
    """Training seconds until the first validation at or above `target` (None: never)."""
    for step, acc in result["accuracy"].items():
        if acc >= target - 1e-9:
            return result["elapsed"][step]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="posttrain-async-bench-") as tmp:
        results = {name: run(name, args.steps, Path(tmp)) for name in args.runs}

    base = results.get("sync") or next(iter(results.values()))
    target = list(base["accuracy"].values())[-1]
    print(f"\nGRPO on the default task, {args.steps} steps, same machine, one run after the other")
    print(f"{'run':<6} {'median step':>11} {'steps/s':>8} {'x sync':>7} {'train s':>8} {'wall s':>7} "
          f"{'final acc':>9} {'to sync final':>13}")
    for name, r in results.items():
        reach = time_to_reach(r, target)
        final = list(r["accuracy"].values())[-1]
        print(f"{name:<6} {r['median_step']:>10.3f}s {1 / r['median_step']:>8.2f} "
              f"{base['median_step'] / r['median_step']:>6.2f}x {r['train_time']:>8.1f} {r['wall']:>7.1f} "
              f"{final:>9.1%} {('%.1fs' % reach) if reach is not None else 'never':>13}")
    print("\nvalidation accuracy by step:")
    steps = sorted({s for r in results.values() for s in r["accuracy"]})
    print("step   " + " ".join(f"{name:>7}" for name in results))
    for s in steps:
        print(f"{s:<6} " + " ".join(f"{r['accuracy'].get(s, float('nan')):>7.1%}" for r in results.values()))


if __name__ == "__main__":
    main()
