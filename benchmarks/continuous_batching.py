"""The nemotron_mini recipe's validation through the native engine, with and without continuous
batching and the shared prompt prefix, side by side in one run.

    ./run.sh python benchmarks/continuous_batching.py                     # all four variants
    ./run.sh python benchmarks/continuous_batching.py --variants pieces continuous+prefix --samples 40

Each variant is `posttrain eval --config examples/recipes/nemotron_mini_eval.yaml` (the recipe's
held-out problems in its seen wordings, greedy, up to 3 turns with the calculator's results) with
SmolLM2-135M-Instruct generating in bfloat16 (`policy.precision=bfloat16`, as the recipe's
bfloat16 run), 32 rows decoding at once (`policy.generation.batch_size`), on this machine's cores:
- `pieces`: calls of 32 prompts (`eval.batch_size=32`): each decodes until its longest row ends, the
  engine before continuous batching;
- `continuous`: every problem in one call (`eval.batch_size=600`): rows that finish leave the running
  batch and waiting prompts take their places;
- `+prefix`: the first tokens the prompts of a prefill share (system prompt, task instructions)
  prefilled once and copied (`policy.generation.share_prompt_prefix`, on by default); without it,
  each prompt whole.
Both wording sets are evaluated, as one validation of the recipe. Printed per variant: wall time
(model loading included, the same for all), the ratio to the first variant, the mean response
length and greedy accuracy in each set (within a few problems across variants: a different batch
rounds bfloat16 differently).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP

EVAL = Path(__file__).resolve().parent.parent / "examples" / "recipes" / "nemotron_mini_eval.yaml"
VARIANTS = {  # name: (eval.batch_size, shared prompt prefix)
    "pieces": (32, False),
    "pieces+prefix": (32, True),
    "continuous": (600, False),
    "continuous+prefix": (600, True),
}
QUIET = ["logger.progress_bar=false", "logger.report=false", "policy.precision=bfloat16",
         "policy.generation.batch_size=32"]


def run_variant(name: str, samples: int, log_dir: Path) -> tuple[float, dict]:
    """Wall time of the evaluation (both wordings' sets) and its metrics."""
    from posttrain.cli import job_target, load_target
    from posttrain.config.loader import load_config
    from posttrain.preflight import preflight

    batch_size, prefix = VARIANTS[name]
    cfg = load_config("eval", EVAL, overrides=[
        *QUIET, f"eval.batch_size={batch_size}", f"eval.max_samples={samples}", f"logger.log_dir={log_dir}",
        f"policy.generation.share_prompt_prefix={str(prefix).lower()}"])
    preflight(cfg)
    start = time.perf_counter()
    metrics = load_target(*job_target("eval", cfg), "eval")(cfg)
    return time.perf_counter() - start, metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--samples", type=int, default=80, help="problems per task (default: the recipe's 80)")
    args = parser.parse_args()

    results = {}
    for name in args.variants:
        with tempfile.TemporaryDirectory(prefix=f"continuous_{name}_") as tmp:
            print(f"== {name}", flush=True)
            wall, metrics = run_variant(name, args.samples, Path(tmp))
        results[name] = (wall, metrics["validation/avg_length"], metrics["validation/accuracy_greedy"],
                         metrics.get("validation_unseen_phrasing/accuracy_greedy", float("nan")))
        print(f"[{name}] {wall:.0f} s", flush=True)

    first = results[args.variants[0]][0]
    print(f"\n| variant | wall time (s) | speed-up vs {args.variants[0]} | mean response tokens | "
          "greedy accuracy, seen / held-out wordings |")
    print("|---|---:|---:|---:|---:|")
    for name, (wall, length, seen, unseen) in results.items():
        print(f"| {name} | {wall:.0f} | {first / wall:.2f}x | {length:.1f} | {100 * seen:.1f}% / {100 * unseen:.1f}% |")


if __name__ == "__main__":
    main()
