"""A step's time on a quiet machine and beside a CPU hog on every core, for three thread settings,
side by side in one run.

    ./run.sh python benchmarks/busy_machine.py [--steps 12] [--settings default spinning one_thread]

The step is the embedded default's SFT warm start (`sft_warmup` of `posttrain grpo`: the tiny
model, 64 rows in micro-batches of 32), run as `posttrain sft` on that section in a fresh process,
as a user would, with no validation or checkpoints. Settings:
- default: what posttrain does by itself (every core; OpenMP threads spin about 0.1 ms, then
  sleep: `OMP_WAIT_POLICY=PASSIVE` with `GOMP_SPINCOUNT=10000`);
- passive: threads sleep as soon as they wait (`OMP_WAIT_POLICY=PASSIVE` alone: posttrain's
  default before 2026-11-28);
- spinning: the same threads with OpenMP's active waiting (`OMP_WAIT_POLICY=ACTIVE`: what torch
  does when nothing sets the variable, and posttrain's behaviour before it did);
- one_thread: `cluster.cpus_per_worker=1`, the old advice for shared machines;
- adapting: `cluster.adapt_threads_to_load=true` (every core, fewer while other processes keep some
  busy: posttrain/utils/cpu_share.py). It measures the others' load once a second, so give it
  `--steps 150` or so: the median of 12 steps is over before it has looked.
Each runs alone, then beside `--hogs` busy-looping processes (default: one per core). Prints the
median step (`timing/train/total_step_time`, steps 3..N) of each, busy / quiet per setting, and
each busy setting against the best busy one. Timings on a shared machine move from run to run:
compare within one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from posttrain.utils.openmp import environment_with_wait

SETTINGS = {
    "default": ({}, []),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
    "spinning": ({"OMP_WAIT_POLICY": "ACTIVE"}, []),
    "one_thread": ({}, ["cluster.cpus_per_worker=1"]),
    "adapting": ({}, ["cluster.adapt_threads_to_load=true"]),
}


def warm_start_config(workdir: Path) -> Path:
    """The embedded default's `sft_warmup` section as a config file of its own."""
    from posttrain.config.loader import load_config, save_config

    return save_config(load_config("grpo").sft_warmup, workdir / "sft_warmup.yaml")


def median_step(config: Path, workdir: Path, name: str, steps: int) -> float:
    env_vars, overrides = SETTINGS[name]
    log_dir = workdir / name
    workdir.mkdir(parents=True, exist_ok=True)
    env = environment_with_wait(env_vars)
    cmd = [sys.executable, "-m", "posttrain", "sft", "--config", str(config), f"sft.max_num_steps={steps}",
           "sft.val_period=0", "sft.val_at_end=false", "~sft.stop_at_validation",  # no validations: no target
           "checkpointing.enabled=false", f"logger.log_dir={log_dir}",
           "logger.progress_bar=false", *overrides]
    out = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"[busy_machine] {name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["timing/train/total_step_time"] for r in rows if r.get("step", 0) >= 3 and
             "timing/train/total_step_time" in r]
    return statistics.median(times)


def start_hogs(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="SFT steps per run (default 12; steps 3..N count)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy processes (default: one per core)")
    args = parser.parse_args()

    results: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="posttrain_busy_") as tmp:
        workdir = Path(tmp)
        config = warm_start_config(workdir)
        for load in ("quiet", "busy"):
            hogs = start_hogs(args.hogs) if load == "busy" else []
            try:
                for name in args.settings:
                    results[name, load] = median_step(config, workdir / load, name, args.steps)
                    print(f"[busy_machine] {name:<10} {load:<5} {results[name, load]:.3f} s/step", flush=True)
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()

    best_busy = min(results[name, "busy"] for name in args.settings)
    print(f"\nmedian SFT warm-start step, {args.hogs} CPU hogs beside the busy runs, {os.cpu_count()} cores")
    print(f"{'setting':<12}{'quiet s':>9}{'busy s':>9}{'busy/quiet':>12}{'busy/best busy':>16}")
    for name in args.settings:
        quiet, busy = results[name, "quiet"], results[name, "busy"]
        print(f"{name:<12}{quiet:>9.3f}{busy:>9.3f}{busy / quiet:>11.2f}x{busy / best_busy:>15.2f}x")


if __name__ == "__main__":
    main()
