"""GDPO vs summed rewards: the same GRPO run on two reward components, with the advantage from the
weighted sum of the rewards (`grpo.adv_estimator.name=grpo`) and from GDPO (each component normalised
within its group first, `gdpo`), side by side.

The task is the Python API's README example (the tiny model from scratch on 2-digit additions),
scored by two reward functions on the completion's leading number: `first_digit` (its first digit is
right) and `last_digit` (its last digit is right), weights 1 and 1; a third, `exact` (the whole
number is right) has weight 0: it moves nothing and is only reported. Prints, over the seeds, each
component's greedy validation mean before and after training per variant, and each variant minus sum
(`grpo`) paired by seed, as mean +- sd [min, max] (n stated), with the CPU and the kernels it ran.

    ./run.sh python benchmarks/gdpo_vs_sum.py --steps 30 --seeds 1 2 3 4 5 --variants grpo gdpo gdpo-no-batch-norm
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch
from posttrain import GRPO


def leading_number(completion: str) -> str:
    found = re.match(r"\s*(\d+)", completion)
    return found.group(1) if found else ""


def first_digit(prompts, completions, answer, **columns):
    return [float(leading_number(c)[:1] == a[:1]) for c, a in zip(completions, answer)]


def last_digit(prompts, completions, answer, **columns):
    return [float(leading_number(c)[-1:] == a[-1:]) for c, a in zip(completions, answer)]


def exact(prompts, completions, answer, **columns):
    return [float(leading_number(c) == a) for c, a in zip(completions, answer)]


# The advantage options each compared variant sets.
VARIANTS = {
    "grpo": {"grpo.adv_estimator.name": "grpo"},
    "gdpo": {"grpo.adv_estimator.name": "gdpo"},
    "gdpo-no-batch-norm": {"grpo.adv_estimator.name": "gdpo", "grpo.adv_estimator.batch_normalize": False},
}


def run(variant: str, steps: int, seed: int, log_root: str) -> dict[str, float]:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 100) for b in (13, 47, 81)]
    name = f"{variant}_{seed}"
    trainer = GRPO(model="tiny", reward_funcs=[first_digit, last_digit, exact], reward_weights=[1.0, 1.0, 0.0],
                   train_dataset=rows[::2], eval_dataset=rows[1::2],
                   config={"sft_warmup": None, "grpo.max_num_steps": steps, "grpo.val_period": steps,
                           "grpo.seed": seed, "policy.optimizer.lr": 1e-3, **VARIANTS[variant],
                           "logger.log_dir": f"{log_root}/{name}", "checkpointing.enabled": False,
                           "logger.tensorboard_enabled": False, "logger.progress_bar": False})
    result = trainer.train()
    first, last = result.history[0], result.history[steps]
    keys = [k for k in last if k.startswith("validation/reward_components/")]
    out = {f"{k.rsplit('/', 1)[-1]} before": first[k] for k in keys}
    out.update({f"{k.rsplit('/', 1)[-1]} after": last[k] for k in keys})
    return out


def summary(values: list[float]) -> str:
    """mean +- sd [min, max] (sample sd; 0 for one value)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} +- {sd:.3f} [{min(values):.3f}, {max(values):.3f}]"


def table(results: dict[str, list[dict[str, float]]]) -> list[tuple[str, list[str]]]:
    """One row per component key: each variant's summary over seeds, then each non-`grpo` variant
    minus `grpo` paired by seed (the runs' lists are in the same seed order)."""
    rows = []
    others = [v for v in results if v != "grpo"] if "grpo" in results else []
    for key in next(iter(results.values()))[0]:
        cells = [summary([r[key] for r in runs]) for runs in results.values()]
        cells += [summary([o[key] - g[key] for o, g in zip(results[v], results["grpo"])]) for v in others]
        rows.append((key, cells))
    return rows


def cpu_name() -> str:
    for line in open("/proc/cpuinfo", encoding="utf-8"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--variants", nargs="+", default=["grpo", "gdpo"], choices=list(VARIANTS))
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {variant: [] for variant in args.variants}
    with tempfile.TemporaryDirectory() as log_root:
        for seed in args.seeds:
            for variant in results:  # interleaved, so a busy machine slows all alike
                t0 = time.perf_counter()
                results[variant].append(run(variant, args.steps, seed, log_root))
                print(f"[gdpo_vs_sum] {variant} seed {seed}: {time.perf_counter() - t0:.0f} s "
                      f"{results[variant][-1]}", flush=True)
    print(f"\n{args.steps} steps, seeds {args.seeds} (n = {len(args.seeds)}); {cpu_name()}, "
          f"torch CPU kernels {torch.backends.cpu.get_cpu_capability()}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("greedy validation mean of each reward component, mean +- sd [min, max] over seeds")
    header = list(results) + [f"{v} - grpo" for v in results if v != "grpo" and "grpo" in results]
    print(f"{'component':<18}" + "".join(f"{h:>32}" for h in header))
    for key, cells in table(results):
        print(f"{key:<18}" + "".join(f"{cell:>32}" for cell in cells))


if __name__ == "__main__":
    main()
