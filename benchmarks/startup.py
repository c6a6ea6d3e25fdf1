"""Start-up of `posttrain grpo`: seconds from the command to the first GRPO step, per phase, for the
local backend and for Ray, side by side in one run on the same cores.

    ./run.sh python benchmarks/startup.py [--repeats 3] [--backends local ray]

Each run is the embedded default (`posttrain grpo`: the tiny model's cached SFT warm start, 2-digit
additions) in a fresh process, as a user types it, with 3 steps, no validation before the first
step (`grpo.val_at_start=false`: validation is work, not start-up) and no checkpoints; everything
else as the default (TensorBoard on, progress shown). The job itself times its start-up phases
(`posttrain.utils.startup`, logged as `timing/startup/*` with the first step): from the process's
start to the end of `config` (interpreter, config load and checks), `preflight`, `imports` (torch,
transformers), `backend` (Ray's start, or nothing), `data`, `workers` (policy and generation
loaded), `environments`, `other` (logger, resume check), then `to_first_step` (the sum) and the
first step itself. The benchmark also measures the whole command's wall time from outside.

The warm start is built first if it is not cached yet (a one-off, not timed). Prints the median of
each phase over the repeats and the ratio ray / local of the time to the first step. On a shared
2-core machine timings move by tens of percent from run to run: compare within one invocation.
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

BACKENDS = ("local", "ray")


def run(backend: str, workdir: Path, index: int, steps: int) -> dict[str, float]:
    """One `posttrain grpo` command; its `timing/startup/*` and the command's wall time."""
    log_dir = workdir / f"{backend}_{index}"
    cmd = [sys.executable, "-m", "posttrain", "grpo", f"cluster.backend={backend}", f"grpo.max_num_steps={steps}",
           "grpo.val_at_start=false", "grpo.val_period=0", "grpo.val_at_end=false", "checkpointing.enabled=false",
           f"logger.log_dir={log_dir}", "logger.progress_bar=false"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=os.environ.copy())
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"[startup] {backend} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    first = json.loads((log_dir / "metrics.jsonl").read_text().splitlines()[0])
    phases = {k.removeprefix("timing/startup/"): v for k, v in first.items() if k.startswith("timing/startup/")}
    return {**phases, "command": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per backend, interleaved (default 3)")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per run (default 3)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="posttrain_startup_") as tmp:
        workdir = Path(tmp)
        print("[startup] building (or finding) the cached SFT warm start", flush=True)
        run(args.backends[0], workdir, -1, 1)  # warm start, page cache, .pyc files: not timed
        results: dict[str, list[dict[str, float]]] = {b: [] for b in args.backends}
        for index in range(args.repeats):
            for backend in args.backends:  # interleaved, so slow spells of the machine hit both
                results[backend].append(run(backend, workdir, index, args.steps))
                print(f"[startup] {backend} run {index + 1}: first step after "
                      f"{results[backend][-1]['to_first_step']:.1f}s", flush=True)

    phases = [p for p in results[args.backends[0]][0] if p not in ("to_first_step", "first_step", "command")]
    rows = phases + ["to_first_step", "first_step", "command"]
    median = {b: {p: statistics.median(r.get(p, 0.0) for r in results[b]) for p in rows} for b in args.backends}
    print(f"\nposttrain grpo start-up, median of {args.repeats} runs per backend (seconds)")
    print(f"{'phase':16s}" + "".join(f"{b:>9s}" for b in args.backends))
    for p in rows:
        label = {"to_first_step": "= to 1st step", "first_step": "first step", "command": "whole command"}.get(p, p)
        print(f"{label:16s}" + "".join(f"{median[b][p]:9.2f}" for b in args.backends))
    if set(BACKENDS) <= set(args.backends):
        ratio = median["ray"]["to_first_step"] / median["local"]["to_first_step"]
        print(f"ratio ray / local, command to first step: {ratio:.2f}x")
    print(f"(whole command: {args.steps} steps and shutdown included)")


if __name__ == "__main__":
    main()
