"""GDPO vs summed rewards: the same GRPO run on two reward components, with the advantage from the
weighted sum of the rewards (`grpo.adv_estimator.name=grpo`) and from GDPO (each component normalised
within its group first, `gdpo`), side by side.

The task is the Python API's README example (the tiny model from scratch on 2-digit additions),
scored by two reward functions on the completion's leading number: `first_digit` (its first digit is
right) and `last_digit` (its last digit is right), weights 1 and 1; a third, `exact` (the whole
number is right) has weight 0: it moves nothing and is only reported. Prints each component's greedy
validation mean before and after training for both, and GDPO minus sum.

    ./run.sh python benchmarks/gdpo_vs_sum.py --steps 30 --seeds 42 43 44 --variants grpo gdpo gdpo-no-batch-norm
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
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
    print(f"\n{args.steps} steps, seeds {args.seeds}; greedy validation mean of each reward component "
          "(mean +- sd over seeds)")
    print(f"{'component':<22}" + "".join(f"{variant:>22}" for variant in results))
    for key in results[args.variants[0]][0]:
        cells = []
        for runs in results.values():
            values = [r[key] for r in runs]
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):.3f} +- {sd:.3f}")
        print(f"{key:<22}" + "".join(f"{cell:>22}" for cell in cells))


if __name__ == "__main__":
    main()
