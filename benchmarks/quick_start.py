"""The README's quick start (`posttrain grpo`, the embedded default) as a new user runs it, on a quiet
machine and beside a CPU hog on every core, side by side in one run; the numbers the README quotes.

    ./run.sh python benchmarks/quick_start.py [--hogs 2] [--loads quiet busy] [-- KEY=VALUE ...]

KEY=VALUE arguments are config overrides for both runs (e.g. `cluster.adapt_threads_to_load=true`).

Each run starts from an empty cache (`POSTTRAIN_CACHE` in a temporary directory), so it builds the
tiny model and trains the SFT warm start again, as the first `posttrain grpo` after a clone does;
only the virtual environment's one-off install (`./run.sh`'s, ~100 s here, printed by it) is not
in the time. Default settings throughout: nothing tuned for the busy machine. Prints, per load:
wall time of the command, the warm-started model's greedy validation accuracy (GRPO's step 0) and
the final one, and the busy/quiet time ratio (issue 29 asks for at most 2x).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from busy_machine import start_hogs

ACCURACY = "validation/accuracy_greedy"


def run_quick_start(workdir: Path, overrides: list[str]) -> dict[str, float]:
    """`posttrain grpo` in `workdir` with its own empty cache: wall seconds and accuracies."""
    workdir.mkdir(parents=True)
    env = {**os.environ, "POSTTRAIN_CACHE": str(workdir / "cache")}
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "posttrain", "grpo", "logger.progress_bar=false", *overrides], cwd=workdir,
                         capture_output=True, text=True, env=env)
    seconds = time.monotonic() - started
    if out.returncode:
        sys.exit(f"[quick_start] posttrain grpo failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    metrics = [json.loads(line) for line in next(workdir.glob("logs/*/metrics.jsonl")).read_text().splitlines()]
    accuracy = [(row["step"], row[ACCURACY]) for row in metrics if ACCURACY in row]
    return {"seconds": seconds, "start": 100 * accuracy[0][1], "end": 100 * accuracy[-1][1], "steps": accuracy[-1][0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy processes (default: one per core)")
    parser.add_argument("--loads", nargs="+", default=["quiet", "busy"], choices=["quiet", "busy"])
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for both runs")
    args = parser.parse_args()

    results = {}
    with tempfile.TemporaryDirectory(prefix="posttrain_quick_start_") as tmp:
        for load in args.loads:
            hogs = start_hogs(args.hogs) if load == "busy" else []
            try:
                results[load] = run_quick_start(Path(tmp) / load, args.overrides)
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
            r = results[load]
            print(f"[quick_start] {load}: {r['seconds']:.0f} s, accuracy {r['start']:.1f}% -> {r['end']:.1f}% "
                  f"in {r['steps']} GRPO steps", flush=True)

    import torch

    # The kernels' rounding moves the accuracies (benchmarks/seeds.py --cpu avx2 measures both kinds).
    print(f"\nposttrain grpo (embedded default{', ' + ' '.join(args.overrides) if args.overrides else ''}) from an "
          f"empty cache, {os.cpu_count()} cores, torch CPU kernels {torch.backends.cpu.get_cpu_capability()}, "
          f"busy = beside {args.hogs} CPU hogs")
    print(f"{'load':<8}{'wall s':>8}{'step 0 %':>10}{'end %':>8}")
    for load, r in results.items():
        print(f"{load:<8}{r['seconds']:>8.0f}{r['start']:>10.1f}{r['end']:>8.1f}")
    if {"quiet", "busy"} <= set(results):
        print(f"busy / quiet: {results['busy']['seconds'] / results['quiet']['seconds']:.2f}x")


if __name__ == "__main__":
    main()
