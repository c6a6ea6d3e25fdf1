"""A showcase job over several seeds: mean, standard deviation, min and max of every accuracy it
reports (before and after, per task where there are tasks) and of its wall time.

    ./run.sh python benchmarks/seeds.py main --seeds 1 2 3 4 5
    ./run.sh python benchmarks/seeds.py vl --seeds 1 2 3 4 5 --cpu avx2      # as on an AVX2-only CPU
    ./run.sh python benchmarks/seeds.py recipe --seeds 1 2 3 --json results/recipe_seeds.json

Each run is the showcase's own command with `seed=S` (the one key that reseeds every random
choice of training: prompt order, sampling, the SFT warm start's data order; the problems and the
validation set stay: docs/getting-started.md, "Seeds"), its logs and checkpoints in a directory
of its own, one run after the other. All runs share one empty posttrain cache, made for this
script, so the first run's time includes building the tiny model (a few seconds); `--cache DIR`
keeps one between invocations (the warm starts of the same seeds are then trained once).

`--cpu avx2` runs every job with `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`: on an
AVX-512 machine PyTorch's vectorised kernels and oneDNN's matmuls then take their AVX2 code, as
on an AVX2-only CPU (docs/performance.md, "CPU kinds", says how close that comes). `--cpu native`
(default) leaves the kernels alone. The printed header names the CPU and the kernels used.

Showcases (`--list` prints them with their commands): main (`posttrain grpo`, the embedded
default), reasoning_gym (the reasoning-gym example: docs/environments.md), vl (the vision
example), vl_position and vl_color (its config on `shape_position` and `shape_color`, tasks it was not tuned on), custom (the custom-environment example), ppo, ppo_async, dpo, rm,
distill, distill_xtok (the cross-tokenizer distillation example), api (the README's Python API
example, from scratch), cispo and grpo_two_steps (CISPO's example and GRPO's clip with the same
two optimizer steps per step: docs/algorithms.md), lora and grpo_v1 (LoRA adapters only,
against the full weights of the config it extends), grpo_async (async GRPO against grpo_v1),
main_vllm and vl_vllm (the embedded default and the vision example with vLLM generating), length_penalty (the embedded default with Kimi
k1.5's length penalty), sft and sft_muon (`posttrain sft`'s embedded default with AdamW and with
Muon), recipe (the nemotron_mini recipe, about 33 minutes a seed on 2 AVX-512
cores, 47 under AVX2 kernels), and the three variants of the gemma3_base recipe (RL from a base model,
docs/recipes/gemma3-base.md; 10-12 minutes a seed): gemma_base (Gemma 3 270M base, no SFT),
gemma_sft (after a 20-step SFT warm start) and gemma_smollm2 (SmolLM2-135M-Instruct, same tasks
and budget):

    ./run.sh python benchmarks/seeds.py gemma_base --seeds 1 2 3 --json results/gemma_base.json --keep runs/gemma_base \
        --train-metric train/format_rate/math --train-metric train/format_rate/quiz

Seeds run at different times add up: `--combine a.json b.json` prints the table over the runs
saved by earlier `--json` files (same showcase, kernels and overrides), running nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AVX2_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

# The README's Python API example (from scratch, 20 steps), seeded through the config dict.
API_EXAMPLE = """
import sys
from posttrain import GRPO

def first_digit(prompts, completions, answer, **columns):
    return [float(c.strip()[:1] == a[0]) for c, a in zip(completions, answer)]

rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 100) for b in (13, 47, 81)]
trainer = GRPO(model="tiny", reward_funcs=[first_digit], train_dataset=rows[::2], eval_dataset=rows[1::2],
               config={"sft_warmup": None, "grpo.max_num_steps": 20, "policy.optimizer.lr": 1e-3,
                       "policy.scheduler.name": "constant",  # the default's cosine decay: too short a run
                       "seed": int(sys.argv[1]), "logger.log_dir": sys.argv[2] + "/logs",
                       "checkpointing.checkpoint_dir": sys.argv[2] + "/checkpoints"})
trainer.train()
"""


@dataclass(frozen=True)
class Showcase:
    """A job as the docs run it: a `posttrain` command and its config (relative to the repository),
    run in `cwd` (relative to the repository)."""

    command: str
    config: str | None = None
    cwd: str = "."
    overrides: tuple[str, ...] = ()  # the showcase's own key=value overrides, before the command line's

    def argv(self, seed: int, workdir: Path, overrides: tuple[str, ...] = ()) -> list[str]:
        if self.command == "api":
            return [sys.executable, "-c", API_EXAMPLE, str(seed), str(workdir)]
        argv = [sys.executable, "-m", "posttrain", self.command]
        if self.config:
            argv += ["--config", str(REPO / self.config)]
        return argv + [*self.overrides, f"seed={seed}", f"logger.log_dir={workdir}/logs", "logger.progress_bar=false",
                       f"checkpointing.checkpoint_dir={workdir}/checkpoints", *overrides]


def vision_example_on(generator: str) -> Showcase:
    """The vision example's config on a multiple-choice task it was not tuned on. Its questions list
    the options, hence the longer rows; the warm start teaches the bare letter, as the example's
    teaches the bare count, so the grader takes one."""
    return Showcase("grpo", "examples/configs/grpo_vl_tiny.yaml", overrides=tuple(
        override for job in ("", "sft_warmup.")
        for override in (f"{job}data.generator={generator}", f"~{job}data.generator_options",
                         f"{job}data.env_name=mcqa", f"{job}policy.max_total_sequence_length=256")
    ) + ("env.mcqa.grading_mode=lenient",))


SHOWCASES = {
    "main": Showcase("grpo"),
    "vl": Showcase("grpo", "examples/configs/grpo_vl_tiny.yaml"),
    "vl_position": vision_example_on("shape_position"),
    "vl_color": vision_example_on("shape_color"),
    "custom": Showcase("grpo", "examples/custom/grpo_custom.yaml", cwd="examples/custom"),
    "ppo": Showcase("ppo", "examples/configs/ppo_tiny.yaml"),
    "ppo_async": Showcase("ppo", "examples/configs/ppo_async_tiny.yaml"),
    "dpo": Showcase("dpo", "examples/configs/dpo_tiny.yaml"),
    "rm": Showcase("rm", "examples/configs/rm_tiny.yaml"),
    "distill": Showcase("distill", "examples/configs/distill_tiny.yaml"),
    "distill_xtok": Showcase("distill", "examples/configs/distill_xtok_tiny.yaml"),
    "api": Showcase("api"),
    # CISPO (docs/algorithms.md) against GRPO's clip with the same two optimizer steps per GRPO step.
    "cispo": Showcase("grpo", "examples/configs/grpo_cispo_tiny.yaml"),
    "grpo_two_steps": Showcase("grpo", "examples/configs/grpo_math_tiny_v1.yaml",
                               overrides=("policy.train_global_batch_size=64", "policy.train_micro_batch_size=64")),
    "reasoning_gym": Showcase("grpo", "examples/configs/grpo_reasoning_gym_tiny.yaml"),
    # LoRA adapters only (docs/algorithms.md) against the full weights of the config they extend.
    "lora": Showcase("grpo", "examples/configs/grpo_lora_tiny.yaml"),
    "grpo_v1": Showcase("grpo", "examples/configs/grpo_math_tiny_v1.yaml"),
    # Async GRPO (docs/performance.md) against the sync config it extends, grpo_v1.
    "grpo_async": Showcase("grpo", "examples/configs/grpo_async_tiny.yaml"),
    # The embedded default with vLLM generating (docs/generation.md) against "main". Give it a
    # --cache to keep: the first run builds vLLM's isolated environment there (minutes).
    "main_vllm": Showcase("grpo", overrides=("policy.generation.backend=vllm",)),
    # The vision example with vLLM generating from the images (docs/vision.md), against "vl".
    "vl_vllm": Showcase("grpo", "examples/configs/grpo_vl_tiny.yaml", overrides=("policy.generation.backend=vllm",)),
    # The length penalty (docs/algorithms.md) on the embedded default, against "main" (same seeds,
    # a shared --cache, --train-metric train/mean_gen_tokens_per_sample).
    "length_penalty": Showcase("grpo", overrides=("reward_shaping.length_penalty.enabled=true",
                                                  "reward_shaping.length_penalty.weight=0.5")),
    # SFT's embedded default with AdamW (its optimizer) and with Muon (docs/algorithms.md, the
    # optimizer paragraph).
    "sft": Showcase("sft"),
    "sft_muon": Showcase("sft", overrides=("policy.optimizer.name=muon",)),
    "recipe": Showcase("grpo", "examples/recipes/nemotron_mini.yaml"),
    # No checkpoints: each would hold 3 GB (Gemma's weights and AdamW state), 27 GB for 3 variants x 3 seeds.
    "gemma_base": Showcase("grpo", "examples/recipes/gemma3_base.yaml", overrides=("checkpointing.enabled=false",)),
    "gemma_sft": Showcase("grpo", "examples/recipes/gemma3_base_sft.yaml", overrides=("checkpointing.enabled=false",)),
    "gemma_smollm2": Showcase("grpo", "examples/recipes/gemma3_base.yaml",
                              overrides=("checkpointing.enabled=false", "policy.model_name=smollm2-135m-instruct")),
}


def validation_metrics(metrics_file: Path) -> dict[str, float]:
    """Every validation accuracy of a run (`validation*/accuracy*`, per task too, and a distillation's
    `validation/teacher_accuracy`), in percent, and its validation loss (`validation*/loss`: SFT's
    answer NLL), as `NAME@first` (the first validation: before training), `NAME@last` (the last
    one) and `NAME@gain` (last - first)."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for line in metrics_file.read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if not (key.startswith("validation") and isinstance(value, (int, float))) or "_count" in key:
                continue
            if "/accuracy" in key or "/teacher_accuracy" in key:
                value = 100 * value
            elif not key.endswith("/loss"):
                continue
            first.setdefault(key, value)
            last[key] = value
    out = {}
    for key in first:
        out[f"{key}@first"], out[f"{key}@last"] = first[key], last[key]
        out[f"{key}@gain"] = last[key] - first[key]
    return out


def train_means(metrics_file: Path, names: tuple[str, ...], window: int = 10) -> dict[str, float]:
    """Each named per-step metric (e.g. `train/approx_entropy`) averaged over the first and the last
    `window` steps that logged it, as `NAME@first` and `NAME@last` (single steps are noisy)."""
    values: dict[str, list[float]] = {name: [] for name in names}
    for line in metrics_file.read_text().splitlines():
        row = json.loads(line)
        for name in names:
            if isinstance(row.get(name), (int, float)):
                values[name].append(float(row[name]))
    out = {}
    for name, series in values.items():
        if series:
            out[f"{name}@first"] = statistics.fmean(series[:window])
            out[f"{name}@last"] = statistics.fmean(series[-window:])
    return out


def run_one(showcase: Showcase, seed: int, workdir: Path, env: dict[str, str],
            overrides: tuple[str, ...] = (), timeout: float | None = None,
            train_metrics: tuple[str, ...] = ()) -> dict[str, float]:
    """One seed of a showcase: wall seconds, `validation_metrics` of its metrics.jsonl (the main job's,
    not its warm start's) and `train_means` of `train_metrics`. A failed run, or one stopped at
    `timeout` seconds, raises RunFailed."""
    workdir.mkdir(parents=True)
    started = time.monotonic()
    try:
        out = subprocess.run(showcase.argv(seed, workdir, overrides), cwd=REPO / showcase.cwd, env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as stopped:
        text = (stopped.stdout or b"").decode(errors="replace") + (stopped.stderr or b"").decode(errors="replace")
        (workdir / "output.log").write_text(text)
        raise RunFailed(f"seed {seed} stopped after {timeout:.0f} s; its logs: {workdir}") from None
    seconds = time.monotonic() - started
    (workdir / "output.log").write_text(out.stdout + out.stderr)
    if out.returncode:
        raise RunFailed(f"seed {seed} failed (rc {out.returncode}); its output: {workdir / 'output.log'}\n"
                        f"{(out.stdout + out.stderr)[-2000:]}")
    metrics = workdir / "logs" / "metrics.jsonl"
    if not metrics.exists():
        raise RunFailed(f"seed {seed} wrote no {metrics}")
    return {"seconds": seconds, **validation_metrics(metrics), **train_means(metrics, train_metrics)}


class RunFailed(Exception):
    """A seed's run failed or was stopped; the message says where its output is."""


def summary(values: list[float]) -> dict[str, float]:
    """mean, sd (sample; 0 for one value), min, max, n."""
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def print_table(runs: dict[int, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Prints the `summary` of every metric over the runs (seconds first) and returns it."""
    names = sorted(set().union(*runs.values()), key=lambda k: (k != "seconds", k))
    table = {name: summary([run[name] for run in runs.values() if name in run]) for name in names}
    print(f"\n{'metric':64s} {'mean':>7s} {'sd':>6s} {'min':>7s} {'max':>7s}  n")
    for name, row in table.items():
        digits = 1 if name == "seconds" or "accuracy" in name else 3  # percents and seconds; others (entropy) small
        print(f"{name:64s} {row['mean']:7.{digits}f} {row['sd']:6.{digits}f} {row['min']:7.{digits}f} "
              f"{row['max']:7.{digits}f}  {row['n']}")
    return table


def save(path: Path, saved: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=1))


def combined_runs(files: list[Path]) -> tuple[dict, dict[int, dict[str, float]]]:
    """The showcase, kernels and overrides that several `--json` files share (e.g. seeds run in
    separate sessions), and their runs by seed. Files that disagree, or hold the same seed twice,
    end the script with one line naming them."""
    runs: dict[int, dict[str, float]] = {}
    first: dict | None = None
    for path in files:
        try:
            saved = json.loads(path.read_text())
            same = {key: saved[key] for key in ("showcase", "kernels", "overrides")}
            seeds = {int(seed): run for seed, run in saved["runs"].items()}
        except OSError as error:
            sys.exit(f"[seeds] {path}: cannot read it ({error.strerror})")
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            sys.exit(f"[seeds] {path}: not a --json file of this script ({type(error).__name__}: {error})")
        if first is None:
            first, first_cpu = same, saved.get("cpu", "?")
            print(f"[seeds] {same['showcase']} combined from {len(files)} files; kernels: {same['kernels']}; "
                  f"CPU of the first: {first_cpu}")
        elif same != first:
            sys.exit(f"[seeds] {path}: {same} differs from the first file's {first}")
        twice = sorted(set(seeds) & set(runs))
        if twice:
            sys.exit(f"[seeds] {path}: seeds {twice} are in an earlier file too")
        runs.update(seeds)
    return {**first, "cpu": first_cpu}, dict(sorted(runs.items()))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("showcase", nargs="?", choices=sorted(SHOWCASES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--cpu", choices=["native", "avx2"], default="native",
                        help="avx2: PyTorch's and oneDNN's AVX2 kernels (as on an AVX2-only CPU)")
    parser.add_argument("--json", type=Path, help="also write every run and the summary here")
    parser.add_argument("--list", action="store_true", help="print the showcases and their commands")
    parser.add_argument("--parallel", type=int, default=1,
                        help="seeds run at once (default 1; more only where the machine has the room, e.g. a GPU "
                             "machine's cores: each run's wall time then includes the sharing)")
    parser.add_argument("--keep", type=Path, help="keep every run's logs and metrics under this directory")
    parser.add_argument("--timeout", type=float, help="stop a run after this many seconds (it counts as failed)")
    parser.add_argument("--train-metric", action="append", default=[], metavar="NAME",
                        help="also summarise this per-step metric (e.g. train/approx_entropy), averaged over "
                             "each run's first and last 10 steps; repeatable")
    parser.add_argument("--cache", type=Path,
                        help="the posttrain cache of every run (default: a new empty one): a directory kept "
                             "between invocations shares their SFT warm starts, e.g. when comparing options "
                             "over the same seeds")
    parser.add_argument("--combine", type=Path, nargs="+", metavar="JSON",
                        help="run nothing: the table over the runs saved in these --json files (seeds run at "
                             "different times), written to --json too when given")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run (e.g. cluster.gpus_per_node=1)")
    args = parser.parse_intermixed_args()  # overrides may come after the options
    if args.combine:
        same, runs = combined_runs(args.combine)
        table = print_table(runs)
        if args.json:  # the shape of a run's file, so that it combines again
            save(args.json, {**same, "combined": [str(f) for f in args.combine], "seeds": list(runs), "runs": runs,
                             "failed": [], "summary": table})
        return
    if args.list or args.showcase is None:
        for name, showcase in SHOWCASES.items():
            print(f"{name:8s} {' '.join(showcase.argv(0, Path('RUN'))[1:])}  (in {showcase.cwd})")
        return
    showcase = SHOWCASES[args.showcase]
    if showcase.command == "api" and args.overrides:  # before any run: its config is a dict in the script
        sys.exit("[seeds] the api showcase takes no overrides")
    taken = [f"seed_{seed}" for seed in args.seeds if args.keep and (args.keep / f"seed_{seed}").exists()]
    if taken:  # before any run, not after the first ones have spent their time
        sys.exit(f"[seeds] --keep {args.keep} already holds {', '.join(taken)}: give another directory or remove them")
    env = {key: value for key, value in os.environ.items() if key not in AVX2_KERNELS}
    if args.cpu == "avx2":
        env.update(AVX2_KERNELS)
    from posttrain.cpu_precision import bfloat16_matmul_support

    print(f"[seeds] {args.showcase} over seeds {args.seeds}; CPU: {cpu_name()}, {os.cpu_count()} cores; kernels: "
          f"{args.cpu}; bfloat16 matmuls: {bfloat16_matmul_support(environ=env)[1]}", flush=True)
    if args.overrides:
        print(f"[seeds] overrides: {' '.join(args.overrides)}", flush=True)
    runs: dict[int, dict[str, float]] = {}
    failed: list[int] = []
    with tempfile.TemporaryDirectory(prefix="posttrain_seeds_") as tmp:
        env["POSTTRAIN_CACHE"] = str(args.cache.resolve()) if args.cache else f"{tmp}/cache"
        root = args.keep or Path(tmp)

        def one(seed: int) -> None:
            try:
                runs[seed] = run_one(showcase, seed, root / f"seed_{seed}", env, tuple(args.overrides), args.timeout,
                                     tuple(args.train_metric))
            except RunFailed as failure:
                failed.append(seed)
                print(f"[seeds] {failure}", flush=True)
                return
            shown = {k: round(v, 1) for k, v in runs[seed].items() if k == "seconds" or k.endswith("accuracy_greedy@last")
                     or k.endswith("accuracy@last") or k.endswith("accuracy_greedy@first") or k.endswith("accuracy@first")}
            print(f"[seeds] seed {seed}: {shown}", flush=True)

        # Parallel runs share the cache safely: one of them builds an entry, the others wait on
        # its lock (posttrain.utils.cache).
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(one, args.seeds))
        runs = dict(sorted(runs.items()))
    if not runs:
        sys.exit(f"[seeds] every seed failed: {sorted(failed)}")
    table = print_table(runs)
    if args.json:
        save(args.json, {"showcase": args.showcase, "cpu": cpu_name(), "kernels": args.cpu, "seeds": args.seeds,
                         "overrides": args.overrides, "runs": runs, "failed": sorted(failed), "summary": table})
    if failed:
        sys.exit(f"[seeds] seeds {sorted(failed)} failed; the table holds the other {len(runs)}")


if __name__ == "__main__":
    main()
