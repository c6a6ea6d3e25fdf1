"""GDPO vs summed rewards: the same GRPO run on two reward components, with the advantage from the
weighted sum of the rewards (`grpo.adv_estimator.name=grpo`) and from GDPO (each component normalised
within its group first, `gdpo`), side by side.

Two tasks (`--task`):

- `rare` (default): a rare correctness reward beside a judge that is right only by chance. The
  embedded default's task (2-digit additions) from a short SFT warm start (`--warm-steps`, default
  250, so few answers are right yet), scored by `correct` (the answer's last number is the sum) and
  `judge` (1 or 0 from a hash of the prompt and completion: an unreliable judge or reward model that
  scores text regardless of its correctness), weights 1 and 1. Summed, the judge's coin flips make up
  most of each group's reward variance and dilute the rare correct answers' advantage; GDPO scales
  each component to unit variance within the group first. The variant `grpo-correct-only` (judge
  weight 0) is the reference without the noise.
- `digits`: the Python API's README example (the tiny model from scratch), scored by `first_digit`
  and `last_digit` of the completion's leading number (weights 1 and 1) and `exact` (weight 0,
  reported only). Here the two advantages stay close (docs/algorithms.md, GDPO).

Prints, over the seeds (`seed=S`: sampling, prompt order and the warm start's data order), each
component's greedy validation mean before and after training per variant, and each variant minus sum
(`grpo`) paired by seed, as mean +- sd [min, max] (n stated), with the CPU and the kernels it ran.

    ./run.sh python benchmarks/gdpo_vs_sum.py --task rare --steps 60 --seeds 1 2 3 4 5
    ./run.sh python benchmarks/gdpo_vs_sum.py --task digits --steps 30 --seeds 1 2 3 4 5 --variants grpo gdpo gdpo-no-batch-norm
"""

from __future__ import annotations

import argparse
import hashlib
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


def last_number(completion: str) -> str:
    found = re.findall(r"-?\d+", completion)
    return found[-1] if found else ""


def correct(prompts, completions, answer, **columns):
    """The math environment's `last_number` check: the completion's last number is the answer."""
    return [float(last_number(c) == a) for c, a in zip(completions, answer)]


def judge(prompts, completions, **columns):
    """A judge right only by chance: the same text always gets the same score, unrelated to it."""
    return [float(hashlib.sha256(f"{p}\x00{c}".encode()).digest()[0] & 1) for p, c in zip(prompts, completions)]


# The advantage options each compared variant sets, and the weight of every reward component but
# the first (default 1 each).
VARIANTS = {
    "grpo": ({"grpo.adv_estimator.name": "grpo"}, None),
    "gdpo": ({"grpo.adv_estimator.name": "gdpo"}, None),
    "gdpo-no-batch-norm": ({"grpo.adv_estimator.name": "gdpo", "grpo.adv_estimator.batch_normalize": False}, None),
    "grpo-correct-only": ({"grpo.adv_estimator.name": "grpo"}, 0.0),
}


def trainer_for(task: str, variant: str, steps: int, seed: int, warm_steps: int, log_dir: str) -> GRPO:
    options, other_weight = VARIANTS[variant]
    common = {"grpo.max_num_steps": steps, "grpo.val_period": steps, "seed": seed, **options,
              "logger.log_dir": log_dir, "checkpointing.enabled": False,
              "logger.tensorboard_enabled": False, "logger.progress_bar": False}
    weight = 1.0 if other_weight is None else other_weight
    if task == "rare":
        # The embedded default's data and the warm start it was measured with (grpo_math_tiny_v1.yaml:
        # lr 1e-3, no accuracy target, constant GRPO lr), only shorter: a full one leaves few wrong answers.
        from posttrain.api.common import override
        from posttrain.config.loader import EXAMPLE_CONFIG_DIR, load_config

        config = load_config("grpo", EXAMPLE_CONFIG_DIR / "grpo_math_tiny_v1.yaml", [
            override(key, value) for key, value in {"sft_warmup.sft.max_num_steps": warm_steps, **common}.items()])
        return GRPO(reward_funcs=[correct, judge], reward_weights=[1.0, weight], config=config)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 100) for b in (13, 47, 81)]
    return GRPO(model="tiny", reward_funcs=[first_digit, last_digit, exact], reward_weights=[1.0, weight, 0.0],
                train_dataset=rows[::2], eval_dataset=rows[1::2],
                config={"sft_warmup": None, "policy.optimizer.lr": 1e-3, **common})


def run(task: str, variant: str, steps: int, seed: int, warm_steps: int, log_root: str) -> dict[str, float]:
    trainer = trainer_for(task, variant, steps, seed, warm_steps, f"{log_root}/{task}_{variant}_{seed}")
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
    parser.add_argument("--task", default="rare", choices=["rare", "digits"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warm-steps", type=int, default=250, help="the `rare` task's SFT warm start")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--variants", nargs="+", default=["grpo", "gdpo"], choices=list(VARIANTS))
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {variant: [] for variant in args.variants}
    with tempfile.TemporaryDirectory() as log_root:
        for seed in args.seeds:
            for variant in results:  # interleaved, so a busy machine slows all alike
                t0 = time.perf_counter()
                results[variant].append(run(args.task, variant, args.steps, seed, args.warm_steps, log_root))
                print(f"[gdpo_vs_sum] {variant} seed {seed}: {time.perf_counter() - t0:.0f} s "
                      f"{results[variant][-1]}", flush=True)
    print(f"\n{args.task}: {args.steps} steps, seeds {args.seeds} (n = {len(args.seeds)}); {cpu_name()}, "
          f"torch CPU kernels {torch.backends.cpu.get_cpu_capability()}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("greedy validation mean of each reward component, mean +- sd [min, max] over seeds")
    header = list(results) + [f"{v} - grpo" for v in results if v != "grpo" and "grpo" in results]
    print(f"{'component':<18}" + "".join(f"{h:>32}" for h in header))
    for key, cells in table(results):
        print(f"{key:<18}" + "".join(f"{cell:>32}" for cell in cells))


if __name__ == "__main__":
    main()
