"""The nemotron_mini recipe with each generation precision, side by side in one run: generation time
per step against its floor, wall time, and per-task accuracy at equal steps.

    ./run.sh python benchmarks/recipe_precision.py                      # float32 against the recipe
    ./run.sh python benchmarks/recipe_precision.py --steps 15 --val-samples 40 --variants float32 bfloat16

Variants (`--variants`, each the recipe `examples/recipes/nemotron_mini.yaml` with overrides, in a
process of its own):
- `float32`: `policy.precision=float32`, the recipe before 2026-11-28 (training and generation in
  float32);
- `bfloat16`: float32 training, `policy.generation.precision=bfloat16`, the importance-sampling
  correction on (its default when the precisions differ);
- `bfloat16-nocorr`: the same without the correction (`loss_fn.use_importance_sampling_correction=false`);
- `int8`: float32 training, `policy.generation.precision=int8` (W8A16 on CPU), the correction on.
- `bfloat16-train`: the recipe as it is (`policy.precision=bfloat16`): training under bfloat16
  autocast (float32 master weights and optimizer state) and generation in the same bfloat16
  (`auto`), so the precisions match and the correction stays off, as it would on a GPU. This CPU's
  AVX512-BF16 matmuls run about 2x the float32 rate.
- `bfloat16-train-passive`: the same with OpenMP threads that sleep as soon as they wait
  (`OMP_WAIT_POLICY=PASSIVE` alone, posttrain's setting before 2026-11-28), against the default's
  bounded spin (posttrain/utils/openmp.py).

Each variant trains `--steps` GRPO steps (default: the recipe's 60) from the same start and
validates at its end on both validation sets of the recipe (seen and held-out wordings,
`--val-samples` problems per task and set; default the recipe's 80); step 0 is validated once, by
the first variant (the same model for all). Printed per variant: the median over steps 2..N of
the step and of its generation, the generation floor (one forward over the step's mean tokens at
the float32 matmul rate measured here first: `step_breakdown.py`'s bound; the same floor for
every variant), generation / floor, the run's wall time (validations included) and that time
scaled to the recipe's 60 steps and three validations; then accuracy per task at step 0 and at
the last step, in each validation set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from posttrain.utils.openmp import environment_with_wait  # first: it sets OpenMP's waiting before torch loads OpenMP
from step_breakdown import EXAMPLES, breakdown, measure_machine, model_shape, print_table

RECIPE = EXAMPLES.parent / "recipes" / "nemotron_mini.yaml"
FLOAT32_TRAINING = "policy.precision=float32"  # the recipe's training precision before 2026-11-28
VARIANTS = {
    "float32": [FLOAT32_TRAINING],
    "bfloat16": [FLOAT32_TRAINING, "policy.generation.precision=bfloat16"],
    "bfloat16-nocorr": [FLOAT32_TRAINING, "policy.generation.precision=bfloat16",
                        "loss_fn.use_importance_sampling_correction=false"],
    "int8": [FLOAT32_TRAINING, "policy.generation.precision=int8"],
    "bfloat16-train": [],  # the recipe as it is: policy.precision=bfloat16
    "bfloat16-train-passive": [],
}
# Each variant runs in a process of its own, since OpenMP reads its settings once, when torch loads.
# `-passive`: OpenMP threads sleep as soon as they wait (posttrain's setting before 2026-11-28),
# against its default's short bounded spin (posttrain/__init__.py).
VARIANT_ENV = {"bfloat16-train-passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
QUIET = ["checkpointing.enabled=false", "logger.tensorboard_enabled=false", "logger.progress_bar=false",
         "logger.report=false", "grpo.val_period=0", "grpo.val_at_end=true"]
SETS = ("validation", "validation_unseen_phrasing")


def run_variant(name: str, args, log_dir: Path, validate_start: bool) -> tuple[object, dict, float]:
    from posttrain.cli import job_target, load_target
    from posttrain.config.loader import load_config
    from posttrain.preflight import preflight
    from posttrain.utils.logger import METRICS_FILE, read_metrics_jsonl

    overrides = [*QUIET, *VARIANTS[name], f"grpo.max_num_steps={args.steps}", f"logger.log_dir={log_dir}",
                 f"grpo.val_at_start={str(validate_start).lower()}"]
    if args.val_samples:
        overrides.append(f"grpo.max_val_samples={args.val_samples}")
    cfg = load_config("grpo", RECIPE, overrides=overrides)
    preflight(cfg)
    start = time.perf_counter()
    load_target(*job_target("grpo", cfg), "grpo")(cfg)
    return cfg, read_metrics_jsonl(log_dir / METRICS_FILE), time.perf_counter() - start


def accuracies(row: dict) -> dict[str, dict[str, float]]:
    """{set: {task: accuracy}} of one step's metrics ('blend' is the set's overall accuracy)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in row.items():
        for family in SETS:
            if key == f"{family}/accuracy_greedy":
                out.setdefault(family, {})["blend"] = value
            elif key.startswith(f"{family}/accuracy_greedy/") and not key.endswith("_count"):
                out.setdefault(family, {})[key.rsplit("/", 1)[1]] = value
    return out


def run_alone(args) -> None:
    """One variant, in this process (the parent's `--variant-alone`): its tables, and its results as JSON."""
    from posttrain.config.loader import load_config
    from posttrain.models.hf import resolve_model_path

    name = args.variant_alone
    shape = model_shape(resolve_model_path(load_config("grpo", RECIPE).policy.model_name))
    with tempfile.TemporaryDirectory(prefix=f"recipe_{name}_") as tmp:
        log_dir = args.logs / name if args.logs else Path(tmp)
        run_cfg, metrics, wall = run_variant(name, args, log_dir, validate_start=args.validate_start)
    table = breakdown(run_cfg, metrics, shape, args.gflops, args.memcpy_gbs)
    print_table(name, run_cfg.policy.model_name, shape, table, args.steps)
    steps = sorted(s for s in metrics if s >= 1)
    result = {
        "wall_s": wall,
        "step_s": table["total step"]["measured"],
        "generation_s": table["generation"]["measured"],
        "training_s": table["policy_training"]["measured"],
        "floor_s": table["generation"]["bound"],
        "mismatch": statistics.mean(metrics[s]["train/token_mult_prob_error"] for s in steps
                                    if "train/token_mult_prob_error" in metrics[s]),
        "accuracy": accuracies(metrics[max(metrics)]),
    }
    print(f"[{name}] {wall:.0f} s; median step {result['step_s']:.1f} s, generation {result['generation_s']:.1f} s "
          f"against a {result['floor_s']:.1f} s floor ({result['generation_s'] / result['floor_s']:.1f}x); "
          f"token_mult_prob_error {result['mismatch']:.4f}", flush=True)
    start_accuracy = accuracies(metrics.get(0, {})) if args.validate_start else {}
    args.out.write_text(json.dumps({"result": result, "start_accuracy": start_accuracy}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["float32", "bfloat16-train"], choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps per variant (default: the recipe's 60)")
    parser.add_argument("--val-samples", type=int, default=None, help="problems per task and set (default: the recipe's 80)")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--logs", type=Path, default=None, help="keep each variant's logs in LOGS/<variant> (default: dropped)")
    parser.add_argument("--variant-alone", choices=list(VARIANTS), help=argparse.SUPPRESS)  # a child's one variant
    parser.add_argument("--validate-start", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gflops", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--memcpy-gbs", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant_alone:
        return run_alone(args)

    from posttrain.config.loader import load_config
    from posttrain.job import worker_threads
    from posttrain.models.hf import resolve_model_path

    cfg = load_config("grpo", RECIPE)
    shape = model_shape(resolve_model_path(cfg.policy.model_name, cfg.policy.tiny_arch))
    threads = worker_threads(cfg)
    rows = min(2048, cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt * cfg.policy.max_total_sequence_length)
    shapes = [(rows, shape.hidden, shape.intermediate), (rows, shape.hidden, shape.vocab)]
    machine = measure_machine(shapes, 64 * 2**20, shape.linear_shapes, 32, threads)[threads]
    gflops = max(machine["gflops"][s] for s in shapes)
    print(f"float32 matmul rate {gflops:.0f} GFLOP/s at {threads} thread(s): the floor's rate", flush=True)

    results: dict[str, dict] = {}
    start_accuracy: dict = {}
    for index, name in enumerate(args.variants):
        print(f"\n== {name}: {' '.join(VARIANTS[name]) or 'the recipe as it is'} "
              f"{' '.join(f'{k}={v}' for k, v in VARIANT_ENV.get(name, {}).items())}, {args.steps} steps", flush=True)
        with tempfile.TemporaryDirectory(prefix=f"recipe_{name}_") as tmp:
            out = Path(tmp) / "result.json"
            command = [sys.executable, __file__, "--variant-alone", name, "--steps", str(args.steps), "--out", str(out),
                       "--gflops", str(gflops), "--memcpy-gbs", str(machine["memcpy_gbs"])]
            command += ["--validate-start"] if index == 0 else []
            command += ["--val-samples", str(args.val_samples)] if args.val_samples else []
            command += ["--logs", str(args.logs)] if args.logs else []
            subprocess.run(command, env=environment_with_wait(VARIANT_ENV.get(name, {})), check=True)
            alone = json.loads(out.read_text())
        results[name] = alone["result"]
        if index == 0:
            start_accuracy = alone["start_accuracy"]

    validations = {name: r["wall_s"] - r["step_s"] * args.steps for name, r in results.items()}
    print(f"\n{'variant':16s} {'step s':>7s} {'train s':>7s} {'gen s':>6s} {'floor s':>8s} {'gen/floor':>9s} {'wall s':>7s} "
          f"{'recipe est. min':>15s} {'mismatch':>9s}")
    for name, r in results.items():
        # The recipe: 60 steps and three validations (steps 0, 30, 60); this run validated once
        # (twice for the first variant, whose wall time includes step 0's).
        one_validation = validations[name] / (2 if name == args.variants[0] else 1)
        estimate = (60 * r["step_s"] + 3 * one_validation * (80 / (args.val_samples or 80))) / 60
        print(f"{name:16s} {r['step_s']:7.1f} {r['training_s']:7.1f} {r['generation_s']:6.1f} {r['floor_s']:8.1f} "
              f"{r['generation_s'] / r['floor_s']:8.1f}x {r['wall_s']:7.0f} {estimate:15.0f} {r['mismatch']:9.4f}")
    for family in SETS:
        tasks = sorted(start_accuracy.get(family, {}))
        if not tasks:
            continue
        print(f"\n{family}: accuracy (%) at step 0 and at step {args.steps}")
        print(f"{'task':18s} {'step 0':>7s} " + " ".join(f"{name:>16s}" for name in results))
        for task in tasks:
            cells = " ".join(f"{100 * r['accuracy'].get(family, {}).get(task, float('nan')):16.1f}" for r in results.values())
            print(f"{task:18s} {100 * start_accuracy[family][task]:7.1f} {cells}")
    if args.out:
        args.out.write_text(json.dumps({"start_accuracy": start_accuracy, "steps": args.steps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
