"""The memory plan (`posttrain plan`) against what the job takes: the plan's peak per phase next to
the peak resident set the job measures of itself in that phase, and the plan's peak (and the phase
that sets it) against the whole command's peak RSS. CPU jobs on the local backend (one process).

    ./run.sh python benchmarks/memory_plan.py                                  # the default job, 2 steps
    ./run.sh python benchmarks/memory_plan.py --config examples/recipes/nemotron_mini.yaml \\
        grpo.max_num_steps=1 grpo.max_val_samples=20                           # one validation batch of 140

The job runs as a user types it (`python -m posttrain <algorithm> --config ... overrides`, its
own process, no checkpoints, a temporary log directory). Measured: each step's
`memory/<phase>/peak_rss_gb` (the process's peak resident set in that phase), validation's
`memory/validation/peak_rss_gb`, and the command's peak RSS (`ru_maxrss` of the child: the whole
job, SFT warm start included when it runs). `--metrics FILE` compares the plan with a metrics.jsonl
already written instead of running the job. One run of the recipe with validation at step 0 and at
the end on 140 prompts takes about 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import posttrain  # noqa: F401  (before torch: OpenMP's passive wait, see posttrain/__init__.py)

GiB = 2**30


def run_job(algorithm: str, config: str | None, overrides: list[str], log_dir: Path) -> tuple[float, float]:
    """Run the job; (its peak RSS in bytes, wall seconds)."""
    cmd = [sys.executable, "-m", "posttrain", algorithm, *(["--config", config] if config else []), *overrides,
           f"logger.log_dir={log_dir}", "logger.progress_bar=false", "checkpointing.enabled=false"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"[memory_plan] the job failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, wall


def measured_peaks(metrics_file: Path) -> dict[str, float]:
    """The highest `memory/<phase>/peak_rss_gb` of each phase and `memory/controller_peak_rss_gib`
    over the file's rows, in bytes."""
    peaks: dict[str, float] = {}
    for line in metrics_file.read_text().splitlines():
        for key, value in json.loads(line).items():
            if key.startswith("memory/") and key.endswith(("peak_rss_gb", "peak_rss_gib")):
                name = key.split("/")[1]
                peaks[name] = max(peaks.get(name, 0.0), value * GiB)
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config (default: the embedded example of the algorithm)")
    parser.add_argument("--algorithm", default=None, help="default: the config's section (cli.config_algorithm)")
    parser.add_argument("--metrics", type=Path, help="compare with this metrics.jsonl instead of running the job")
    parser.add_argument("overrides", nargs="*", help="config overrides (default for the embedded job: 2 steps)")
    args = parser.parse_args()

    from posttrain.cli import config_algorithm
    from posttrain.config import load_config
    from posttrain.plan import check_memory, format_plan

    algorithm = args.algorithm or config_algorithm(args.config)
    overrides = args.overrides or ([] if args.config else ["grpo.max_num_steps=2"])
    plan, problem = check_memory(load_config(algorithm, args.config, overrides))
    print(format_plan(plan))
    if problem:
        print(f"[memory_plan] {problem}")
    with tempfile.TemporaryDirectory(prefix="posttrain_memory_plan_") as tmp:
        rss, wall = None, None
        metrics_file = args.metrics
        if metrics_file is None:
            metrics_file = Path(tmp) / "logs" / "metrics.jsonl"
            print(f"[memory_plan] running posttrain {algorithm} {' '.join(overrides)}", flush=True)
            rss, wall = run_job(algorithm, args.config, overrides, metrics_file.parent)
        measured = measured_peaks(metrics_file)
        # A warm start logs under <log_dir>/<key>: its process's peak so far (`memory/controller_peak_rss_gib`).
        warm = {w.key: measured_peaks(metrics_file.parent / w.key / "metrics.jsonl").get("controller_peak_rss_gib")
                for w in plan.warm_starts if w.plan is not None and (metrics_file.parent / w.key / "metrics.jsonl").exists()}

    rows = [(f"{w.key} (peak)", w.plan.node_peak(), warm.get(w.key)) for w in plan.warm_starts if w.plan is not None]
    rows += [(phase, planned, measured.get(phase)) for job, phase, planned in plan.phase_peaks() if job == plan.job]
    print(f"\n{'phase':20s} {'plan GiB':>9s} {'measured peak RSS GiB':>22s} {'plan/measured':>14s}")
    for label, planned, got in rows:
        ratio = f"{planned / got - 1:+14.0%}" if got else f"{'':>14s}"
        print(f"{label:20s} {planned / GiB:9.3f} {got / GiB if got else float('nan'):22.3f} {ratio}")
    job, phase, peak = plan.run_peak()
    whole = rss or max(measured.values())
    where = "the command's ru_maxrss" if rss else "the highest memory/ peak in the metrics"
    print(f"plan peak {peak / GiB:.3f} GiB ({job}, {phase}); measured peak RSS {whole / GiB:.3f} GiB ({where}"
          f"{f', {wall:.0f} s' if wall else ''}): plan {peak / whole - 1:+.0%}")


if __name__ == "__main__":
    main()
