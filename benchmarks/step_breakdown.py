"""Where a GRPO step spends its time, each part beside its compute bound.

    python benchmarks/step_breakdown.py [--settings tiny 135m nemotron_mini] [--steps N] [--out benchmarks/step_breakdown.png]

Settings (validation and checkpointing off, logs in a temporary directory):
- tiny: the embedded default (`examples/configs/grpo_math_tiny.yaml`, its cached SFT warm start),
  16 prompts x 8 generations, 16 new tokens at most; 20 steps by default.
- 135m: `examples/configs/grpo_smollm2_135m.yaml`, SmolLM2-135M-Instruct (docs/models.md,
  "A real pretrained model, offline") on additions in words through its chat template, 4 prompts x 8
  generations, up to 128 new tokens ending at eos, one optimizer step per batch, dynamic
  batching; 5 steps by default.
- nemotron_mini: the recipe (`examples/recipes/nemotron_mini.yaml`, docs/recipes/nemotron-mini.md):
  SmolLM2-135M-Instruct on seven environments, 8 prompts x 4 generations, up to 3 turns (tool
  calls) of 128 new tokens; 5 steps by default. Its generation bound counts one forward over each
  step's mean tokens, as for the others; the turns' separate prefills are not in it.

Each part's median over steps 2..N (step 1 is warm-up) comes from `timing/train/<part>` in the
run's metrics.jsonl; controller overhead is the total step time minus the parts. The bound of a
part is its FLOPs divided by the matmul rate measured here, in this process at the torch threads
the run's workers get (`cluster.cpus_per_worker`: every core with the local backend, which both
settings use), on this model's matmul shapes:
- forward over S sequences of T tokens: S * (2 * P_mm * T + 2 * layers * attention width * T^2),
  with P_mm the weights of the model's Linear layers (lm_head included) and causal attention;
- generation: one forward (prefill + decode with a KV cache do the same matmuls);
- logprobs: one forward per pass run (previous logprobs when the batch spans several optimizer
  steps, reference logprobs when the KL penalty is on); policy training: 3 forwards;
- refit: the weights' bytes divided by the measured memcpy rate (one copy, the speed of light);
  0 with the local backend, whose engine reads the policy's tensors in place;
- reward and controller overhead: no FLOPs, bound 0.
T is the mean prompt plus generated tokens of that step (from metrics.jsonl). Also printed, a
floor for generation that FLOPs miss: decode steps x the measured time of one decode step's
matmuls (a few rows through every Linear of the model, each weight read from memory).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch
from bench_timing import best_seconds

PARTS = ("generation", "refit", "logprobs", "policy_training", "reward")
COMMON = [
    "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.enabled=false",
    "logger.tensorboard_enabled=false", "logger.progress_bar=false", "logger.report=false",
]
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "configs"
SETTINGS = {  # name: (config file, None for the embedded default; default number of steps)
    "tiny": (None, 20),
    "135m": (EXAMPLES / "grpo_smollm2_135m.yaml", 5),
    "nemotron_mini": (EXAMPLES.parent / "recipes" / "nemotron_mini.yaml", 5),
}


@dataclass
class ModelShape:
    """What the FLOP and byte counts need from a model's architecture."""

    matmul_params: int  # weights of nn.Linear layers (a tied lm_head counted here as well)
    unique_params: int  # parameters a refit moves
    layers: int
    attention_width: int  # heads x head dim (the query side of QK^T and AV)
    hidden: int
    intermediate: int
    vocab: int
    linear_shapes: list[tuple[int, int]]  # (out, in) of every nn.Linear, in forward order


def model_shape(model_dir: str) -> ModelShape:
    """Count parameters of `model_dir`'s architecture on the meta device (no weights loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return ModelShape(
        matmul_params=sum(m.weight.numel() for m in linears),
        unique_params=sum(p.numel() for p in model.parameters()),
        layers=config.num_hidden_layers, attention_width=config.num_attention_heads * head_dim,
        hidden=config.hidden_size, intermediate=config.intermediate_size, vocab=config.vocab_size,
        linear_shapes=[(m.out_features, m.in_features) for m in linears],
    )


def measure_machine(shapes: list[tuple[int, int, int]], copy_bytes: int, linear_shapes: list[tuple[int, int]],
                    decode_rows: int, worker_threads: int) -> dict:
    """At a worker's torch threads and at all cores: float32 matmul GFLOP/s per (rows, k, n) shape,
    memcpy GB/s of `copy_bytes`, and the seconds of one decode step's matmuls (`decode_rows` rows
    through every Linear of the model, its weights read from memory, not cache)."""

    def decode_step() -> None:
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    previous_threads = torch.get_num_threads()
    src = torch.empty(copy_bytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    weights = [torch.randn(out, inp) for out, inp in linear_shapes]  # as many bytes as the model's: not cached
    inputs = {inp: torch.randn(decode_rows, inp) for _, inp in linear_shapes}
    result = {"worker_threads": worker_threads}
    for threads in sorted({worker_threads, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        rates = {}
        for rows, k, n in shapes:
            a, b = torch.randn(rows, k), torch.randn(k, n)
            flops = 2 * rows * k * n
            repeats = max(3, min(50, int(2e9 / flops)))
            rates[(rows, k, n)] = flops / best_seconds(lambda: torch.matmul(a, b), repeats) / 1e9
        result[threads] = {
            "gflops": rates,
            "memcpy_gbs": copy_bytes / best_seconds(lambda: dst.copy_(src), 5) / 1e9,
            "decode_step_s": best_seconds(decode_step, 3),
        }
    torch.set_num_threads(previous_threads)
    return result


def run_grpo(config: Path | None, steps: int, log_dir: Path) -> tuple[object, dict[int, dict]]:
    """Run `steps` GRPO steps of `config` (None: the embedded default); (config, metrics per step)."""
    from posttrain.cli import job_target, load_target
    from posttrain.config.loader import load_config
    from posttrain.preflight import preflight
    from posttrain.utils.logger import METRICS_FILE, read_metrics_jsonl

    run_overrides = [*COMMON, f"grpo.max_num_steps={steps}", f"logger.log_dir={log_dir}"]
    cfg = load_config("grpo", config, overrides=run_overrides)
    preflight(cfg)  # converts a pretrained preset into the cache on first use
    load_target(*job_target("grpo", cfg), "grpo")(cfg)  # the synchronous or the asynchronous loop
    return cfg, read_metrics_jsonl(log_dir / METRICS_FILE)


def forward_flops(shape: ModelShape, samples: float, tokens: float) -> float:
    """FLOPs of one forward over `samples` sequences of `tokens` tokens (causal attention)."""
    return samples * (2 * shape.matmul_params * tokens + 2 * shape.layers * shape.attention_width * tokens**2)


def breakdown(cfg, metrics: dict[int, dict], shape: ModelShape, gflops: float, memcpy_gbs: float) -> dict:
    """Per part: medians over steps 2..N of measured seconds, GFLOP and bound seconds."""
    steps = sorted(metrics)[1:]
    logprob_passes = (cfg.policy.train_global_batch_size < metrics[steps[0]]["train/num_samples"]) + (
        cfg.loss_fn.reference_policy_kl_penalty > 0)
    from posttrain.config.schema import resolve_backend

    # The local backend's engine reads the policy's tensors in place: a refit moves no bytes.
    refit_bytes = 0 if resolve_backend(cfg) == "local" else shape.unique_params * 4  # float32
    per_step: dict[str, dict[str, list[float]]] = {}
    for step in steps:
        m = metrics[step]
        fwd = forward_flops(shape, m["train/num_samples"],
                            m["train/mean_prompt_length"] + m["train/mean_gen_tokens_per_sample"])
        flops = {"generation": fwd, "refit": 0.0, "logprobs": logprob_passes * fwd, "policy_training": 3 * fwd,
                 "reward": 0.0, "controller overhead": 0.0}
        bound = {part: f / (gflops * 1e9) for part, f in flops.items()}
        measured = {part: m.get(f"timing/train/{part}", 0.0) for part in PARTS}
        bound["refit"] = refit_bytes / (memcpy_gbs * 1e9) if measured["refit"] > 0 else 0.0  # lazy: none on step 1
        measured["controller overhead"] = m["timing/train/total_step_time"] - sum(measured.values())
        measured["total step"] = m["timing/train/total_step_time"]
        flops["total step"], bound["total step"] = sum(flops.values()), sum(bound.values())
        for part in measured:
            row = per_step.setdefault(part, {"measured": [], "gflop": [], "bound": []})
            row["measured"].append(measured[part])
            row["gflop"].append(flops[part] / 1e9)
            row["bound"].append(bound[part])
    table = {part: {k: statistics.median(v) for k, v in row.items()} for part, row in per_step.items()}
    table["_tokens"] = {key: statistics.median(metrics[s][f"train/{key}"] for s in steps)
                        for key in ("num_samples", "mean_prompt_length", "mean_gen_tokens_per_sample")}
    table["_refit_mb"] = refit_bytes / 2**20
    return table


def print_table(name: str, model: str, shape: ModelShape, table: dict, num_steps: int) -> None:
    tok = table["_tokens"]
    print(f"\n{name}: {model}, {shape.unique_params / 1e6:.1f}M parameters ({shape.matmul_params / 1e6:.1f}M in "
          f"matmuls), {tok['num_samples']:.0f} samples x ({tok['mean_prompt_length']:.1f} prompt + "
          f"{tok['mean_gen_tokens_per_sample']:.1f} generated) tokens; medians of steps 2..{num_steps}")
    print(f"{'part':20s} {'measured s':>10s} {'GFLOP':>9s} {'bound s':>9s} {'measured/bound':>15s} {'share':>6s}")
    total = table["total step"]["measured"]
    for part in (*PARTS, "controller overhead", "total step"):
        r = table[part]
        work = f"{r['gflop']:.1f}"
        if part == "refit":
            work = f"{table['_refit_mb']:.0f} MiB" if table["_refit_mb"] else "shared"
        ratio = f"{r['measured'] / r['bound']:.1f}x" if r["bound"] > 0 else "-"
        print(f"{part:20s} {r['measured']:10.3f} {work:>9s} {r['bound']:9.3f} {ratio:>15s} "
              f"{r['measured'] / total:6.1%}")
    gaps = {p: table[p]["measured"] - table[p]["bound"] for p in (*PARTS, "controller overhead")}
    worst = max(gaps, key=gaps.get)
    print(f"largest excess over its bound: {worst}, {gaps[worst]:.3f} s "
          f"({gaps[worst] / sum(gaps.values()):.0%} of all the steps' excess)")


def plot(tables: dict[str, dict], out: Path) -> None:
    """One panel per setting: the measured step and its bound as stacked bars of part medians, in seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = (*PARTS, "controller overhead")
    colors = dict(zip(parts, plt.get_cmap("tab10").colors))
    fig, axes = plt.subplots(1, len(tables), figsize=(2.6 * len(tables) + 2.2, 4.5), squeeze=False)
    for ax, (name, table) in zip(axes[0], tables.items()):
        for x, kind in enumerate(("measured", "bound")):
            bottom = 0.0
            for part in parts:
                height = max(table[part][kind], 0.0)
                ax.bar(x, height, bottom=bottom, color=colors[part], width=0.6)
                bottom += height
            ax.text(x, bottom, f"{bottom:.3g} s", ha="center", va="bottom", fontsize=8)
        ax.set_xticks([0, 1], ["measured", "compute\nbound"])
        ax.set_title(name)
        ax.set_ylabel("seconds per step (median)")
        ax.margins(y=0.08)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in parts]
    fig.legend(handles, parts, loc="center right", fontsize=8)
    fig.suptitle("Where a GRPO step spends its time")
    fig.tight_layout(rect=(0, 0, 1 - 1.6 / fig.get_figwidth(), 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"\nwrote {out}")


def run_setting(name: str, steps: int | None) -> dict:
    """Measure the machine on this setting's matmul shapes, run its GRPO steps, print its table."""
    from posttrain.config.loader import load_config
    from posttrain.job import worker_threads
    from posttrain.models.hf import resolve_model_path

    config, default_steps = SETTINGS[name]
    steps = steps or default_steps
    cfg = load_config("grpo", config, overrides=COMMON)
    # For `tiny`, the preset: its SFT warm start (what the run trains) has the same architecture.
    shape = model_shape(resolve_model_path(cfg.policy.model_name, cfg.policy.tiny_arch))
    threads = worker_threads(cfg)
    batch = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    rows = min(2048, batch * cfg.policy.max_total_sequence_length)  # training / prefill: many tokens at once
    decode_rows = min(cfg.policy.generation.batch_size, batch)  # decoding: one token per sequence
    big = [(rows, shape.hidden, shape.intermediate), (rows, shape.hidden, shape.vocab)]
    machine = measure_machine(big, min(shape.unique_params * 4, 256 * 2**20), shape.linear_shapes, decode_rows,
                              threads)
    for n in sorted(k for k in machine if isinstance(k, int)):
        rates = ", ".join(f"{r}x{k}x{c} {g:.0f}" for (r, k, c), g in machine[n]["gflops"].items())
        print(f"[{name}] {n} thread(s){' (a worker)' if n == threads else ''}: matmul GFLOP/s {rates}; "
              f"memcpy {machine[n]['memcpy_gbs']:.1f} GB/s; one decode step's matmuls ({decode_rows} rows) "
              f"{machine[n]['decode_step_s'] * 1e3:.1f} ms", flush=True)
    at_worker = machine[threads]
    gflops = max(at_worker["gflops"][s] for s in big)
    print(f"[{name}] bound rate: {gflops:.0f} GFLOP/s (best of the {rows}-row shapes at {threads} thread(s), "
          f"a policy worker's threads in this run)", flush=True)

    with tempfile.TemporaryDirectory(prefix=f"step_breakdown_{name}_") as tmp:
        start = time.perf_counter()
        run_cfg, metrics = run_grpo(config, steps, Path(tmp))
        print(f"[{name}] {steps} steps in {time.perf_counter() - start:.0f}s", flush=True)
    table = breakdown(run_cfg, metrics, shape, gflops, at_worker["memcpy_gbs"])
    print_table(name, cfg.policy.model_name, shape, table, steps)

    tok = table["_tokens"]
    decode_steps = math.ceil(tok["num_samples"] / decode_rows) * tok["mean_gen_tokens_per_sample"]
    step_s = at_worker["decode_step_s"]
    print(f"generation floor from decoding: >= {decode_steps:.0f} decode steps x {step_s * 1e3:.1f} ms (the matmuls "
          f"of {decode_rows} rows through all {shape.matmul_params * 4 / 2**20:.0f} MiB of weights, "
          f"{2 * shape.matmul_params * decode_rows / step_s / 1e9:.0f} GFLOP/s) = {decode_steps * step_s:.3f} s",
          flush=True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=None,
                        help="GRPO steps per setting, the first is warm-up (default: tiny 20, 135m 5)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/step_breakdown.png"), help="the PNG")
    args = parser.parse_args()
    if args.steps is not None and args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is warm-up)")

    from posttrain.errors import UserError

    tables = {}
    for name in args.settings:
        try:
            tables[name] = run_setting(name, args.steps)
        except UserError as e:  # e.g. the 135m weights package is not installed: say so, run the others
            print(f"[{name}] skipped: {e}", flush=True)
    if tables:
        plot(tables, args.out)


if __name__ == "__main__":
    main()
