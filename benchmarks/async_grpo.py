"""Sync vs async GRPO (and PPO) on the embedded default's task, side by side in one run on the same cores.

    ./run.sh python benchmarks/async_grpo.py [--steps 250] [--runs sync sync2 async]
    ./run.sh python benchmarks/async_grpo.py --task nemotron_mini --runs sync async partial
    ./run.sh python benchmarks/async_grpo.py --task ppo --seeds 42 1 2

Each run is `posttrain grpo` on `examples/configs/grpo_math_tiny_v1.yaml`, the config the async
example extends (the embedded default's 2-digit additions with its fixed 350-step SFT warm start,
cached, and a constant learning rate; 16 prompts x 8 generations, 250 steps, validation on 500
problems every 25 steps), in its own process, one after the other, with checkpointing off:

- `sync`:  one policy worker and its generation engine colocated on one bundle (the default
           placement); generation and training take turns (one CPU thread each).
- `sync2`: sync with two data-parallel policy workers (and two colocated engines): sync's way of
           using both cores in every phase.
- `async`: `examples/configs/grpo_async_tiny.yaml`: one policy worker and one generation worker,
           each on its own core, overlapping; groups at most one step old.

With `--task nemotron_mini` the same runs use the nemotron_mini recipe
(`examples/recipes/nemotron_mini.yaml`: SmolLM2-135M-Instruct, seven environments, 8 prompts x 4
generations; docs/recipes/nemotron-mini.md), validated once at the end (`--steps`, default 10)
on its 529 held-out problems, and a fourth run is offered:

- `partial`: sync with partial rollouts (`grpo.partial_rollouts.enabled=true`): a step's
             generation ends once 75% of its groups are complete; the rest continue next step.

With `--task ppo` the runs are `posttrain ppo` on its embedded default (`ppo_tiny.yaml`: the same
task and warm start, with a critic): `sync` (colocated) and `async`
(`examples/configs/ppo_async_tiny.yaml`: one generation worker beside the policy's bundle, which
the critic shares; groups at most one step old).

`--seeds` runs every run once per training seed (`grpo.seed`: prompt order and sampling; the SFT
warm start, and so the starting accuracy, stays the cached one) and adds mean +- sd over them.

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
# Sync runs use the config async extends, so the comparison changes placement and nothing else.
SYNC = ["--config", str(REPO / "examples/configs/grpo_math_tiny_v1.yaml")]
RUNS = {
    "sync": SYNC,
    "sync2": [*SYNC, "policy.num_workers=2"],
    "async": ["--config", str(REPO / "examples/configs/grpo_async_tiny.yaml")],
}
RECIPE = ["--config", str(REPO / "examples/recipes/nemotron_mini.yaml")]
IMPORTANCE_CORRECTION = ["loss_fn.use_importance_sampling_correction=true",
                         "loss_fn.truncated_importance_sampling_type=tis",
                         "loss_fn.truncated_importance_sampling_ratio=2.0"]
RECIPE_RUNS = {  # the same recipe, one change each; validated once, at the end
    "sync": RECIPE,
    "sync2": [*RECIPE, "policy.num_workers=2"],
    "async": [*RECIPE, "grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=1",
              "policy.generation.colocated.enabled=false", "policy.generation.colocated.num_workers=1",
              *IMPORTANCE_CORRECTION],
    "partial": [*RECIPE, "grpo.partial_rollouts.enabled=true", *IMPORTANCE_CORRECTION],
}
PPO_RUNS = {
    "sync": [],
    "async": ["--config", str(REPO / "examples/configs/ppo_async_tiny.yaml")],
}
TASKS = {"default": RUNS, "nemotron_mini": RECIPE_RUNS, "ppo": PPO_RUNS}
COMMANDS = {"default": "grpo", "nemotron_mini": "grpo", "ppo": "ppo"}


def run(name: str, args: list[str], steps: int, workdir: Path, command: str = "grpo") -> dict:
    log_dir = workdir / name
    cmd = [sys.executable, "-m", "posttrain", command, *args, f"grpo.max_num_steps={steps}",
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
    episodes = [rows[s]["train/num_samples"] for s in sorted(rows) if s > 0 and "train/num_samples" in rows[s]]
    return {"wall": wall, "median_step": statistics.median(step_times), "train_time": train_time,
            "accuracy": accuracy, "elapsed": elapsed,
            "samples_per_s": sum(episodes) / train_time if episodes and train_time else float("nan")}


def time_to_reach(result: dict, target: float) -> float | None:
    """Training seconds until the first validation at or above `target` (None: never)."""
    for step, acc in result["accuracy"].items():
        if acc >= target - 1e-9:
            return result["elapsed"][step]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=list(TASKS), default="default")
    parser.add_argument("--steps", type=int, default=None, help="250 (default task), 10 (nemotron_mini)")
    parser.add_argument("--runs", nargs="+", default=None, choices=sorted({n for t in TASKS.values() for n in t}),
                        help="default: sync sync2 async (default task), sync async partial (nemotron_mini), "
                             "sync async (ppo)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="training seeds (grpo.seed), each run once per seed (default: the config's)")
    args = parser.parse_args()
    runs = TASKS[args.task]
    names = args.runs or (["sync", "async", "partial"] if args.task == "nemotron_mini" else list(runs))
    unknown = [n for n in names if n not in runs]
    if unknown:
        sys.exit(f"[bench] --runs {' '.join(unknown)}: not offered for --task {args.task} (offered: {' '.join(runs)})")
    steps = args.steps or (10 if args.task == "nemotron_mini" else 250)
    # The recipe validates 210 problems (about two minutes): once, at the end, at equal steps.
    extra = ([f"grpo.val_period={steps}", "grpo.val_at_start=false"] if args.task == "nemotron_mini" else [])
    command = COMMANDS[args.task]
    seeds = args.seeds or [None]
    by_seed: dict = {}
    with tempfile.TemporaryDirectory(prefix="posttrain-async-bench-") as tmp:
        for seed in seeds:
            seeded = [f"grpo.seed={seed}"] if seed is not None else []
            by_seed[seed] = {name: run(f"{name}_seed{seed}" if seed is not None else name,
                                       [*runs[name], *extra, *seeded], steps, Path(tmp), command) for name in names}
    for seed, results in by_seed.items():
        print_results(results, command, args.task, steps, seed)
    if len(seeds) > 1:
        print(f"\nover seeds {seeds}: mean +- sd (n={len(seeds)})")
        print(f"{'run':<7} {'first acc':>13} {'final acc':>13} {'train s':>13} {'wall s':>13}")
        for name in names:
            cells = []
            for key in ("first", "final", "train_time", "wall"):
                values = [first_final(r[name])[key] if key in ("first", "final") else r[name][key]
                          for r in by_seed.values()]
                scale = 100 if key in ("first", "final") else 1
                cells.append(f"{scale * statistics.fmean(values):.1f} +- {scale * statistics.stdev(values):.1f}")
            print(f"{name:<7} " + " ".join(f"{c:>13}" for c in cells))


def first_final(result: dict) -> dict[str, float]:
    values = list(result["accuracy"].values())
    return {"first": values[0], "final": values[-1]}


def print_results(results: dict, command: str, task: str, steps: int, seed) -> None:
    base = results.get("sync") or next(iter(results.values()))
    target = list(base["accuracy"].values())[-1]
    seeded = f", grpo.seed={seed}" if seed is not None else ""
    print(f"\n{command} on the {task} task, {steps} steps{seeded}, same machine, one run after the other")
    print(f"{'run':<7} {'median step':>11} {'steps/s':>8} {'x sync':>7} {'samples/s':>9} {'train s':>8} "
          f"{'wall s':>7} {'final acc':>9} {'to sync final':>13}")
    for name, r in results.items():
        reach = time_to_reach(r, target)
        final = list(r["accuracy"].values())[-1]
        print(f"{name:<7} {r['median_step']:>10.3f}s {1 / r['median_step']:>8.2f} "
              f"{base['median_step'] / r['median_step']:>6.2f}x {r['samples_per_s']:>9.2f} {r['train_time']:>8.1f} "
              f"{r['wall']:>7.1f} {final:>9.1%} {('%.1fs' % reach) if reach is not None else 'never':>13}")
    print("\nvalidation accuracy by step:")
    steps = sorted({s for r in results.values() for s in r["accuracy"]})
    print("step   " + " ".join(f"{name:>7}" for name in results))
    for s in steps:
        print(f"{s:<6} " + " ".join(f"{r['accuracy'].get(s, float('nan')):>7.1%}" for r in results.values()))


if __name__ == "__main__":
    main()
