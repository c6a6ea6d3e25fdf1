"""The time plan (`posttrain plan`, posttrain/plan/timing.py) against published step times.

    PYTHONPATH=. python benchmarks/plan_vs_published.py            # GPU rows and this project's CPU rows
    PYTHONPATH=. python benchmarks/plan_vs_published.py --gpu-only # without the CPU rows (no measuring)

For each published run it plans the config written for it (examples/plans/*.yaml; each says in a
comment its source and what of the published config it could not express) with the mean prompt
and response lengths the source gives, and prints predicted against published step time and
tokens/s per GPU, and predicted / published. One set of efficiency constants
(`timing.EFFICIENCY`) for every row. The CPU rows plan this project's own measured runs on this
machine's measured CPU (`gpus.cpu_spec`): their published numbers are the docs' measurements.

Tokens/s per GPU is NeMo-RL's: the step's prompt and response tokens / step time / GPUs. The
summary gives the mean generated length; the prompt, ~100-130 tokens, is what its tokens/s x step
time x GPUs / rows leaves over the mean response (OpenMathInstruct-2 with the chat template).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NEMO_RL_V04 = ("https://docs.nvidia.com/nemo/rl/latest/about/performance-summary.html (v0.4 table; its source: "
               "about/performance-summary.md in NVIDIA-NeMo/RL at commit 06beed91)")
NEMO_RL_V06 = "https://docs.nvidia.com/nemo/rl/0.6.0/about/performance-summary.html"


@dataclass(frozen=True)
class PublishedRun:
    label: str
    config: str  # under examples/
    step_s: float
    tokens_per_s_per_gpu: float
    prompt: float  # mean prompt tokens
    response: float  # mean generated tokens
    source: str
    overrides: tuple[str, ...] = ()
    cpu_kind: str = ""  # CPU rows: the quiet machine of QUIET_CPUS they were measured on


GPU_RUNS = (
    PublishedRun("Llama-3.1-8B, 16 H100", "plans/nemo_rl_v0.4_llama3.1_8b_h100x16.yaml", 97.7, 1562, 132, 1060,
                 NEMO_RL_V04),
    PublishedRun("Qwen3-32B, 32 H100", "plans/nemo_rl_v0.4_qwen3_32b_h100x32.yaml", 393, 540, 110, 3206, NEMO_RL_V04),
    PublishedRun("Qwen3-30B-A3B, 32 H100 (v0.4)", "plans/nemo_rl_v0.4_qwen3_30b_a3b_h100x32.yaml", 225, 925, 98, 3154,
                 NEMO_RL_V04),
    PublishedRun("Qwen3-30B-A3B, 32 H100 (v0.6)", "plans/nemo_rl_v0.6_qwen3_30b_a3b_h100x32.yaml", 192, 1102, 106,
                 3200, NEMO_RL_V06),
    PublishedRun("Qwen3-30B-A3B, 16 GB200 (v0.6)", "plans/nemo_rl_v0.6_qwen3_30b_a3b_gb200x16.yaml", 221, 1910, 97,
                 3200, NEMO_RL_V06),
    PublishedRun("Qwen3-235B-A22B, 128 H100", "plans/nemo_rl_v0.4_qwen3_235b_a22b_h100x128.yaml", 506, 45.7, 110,
                 5671, NEMO_RL_V04),
    PublishedRun("DeepSeek-V3, 256 H100", "plans/nemo_rl_v0.4_deepseek_v3_h100x256.yaml", 154, 11, 102, 745,
                 NEMO_RL_V04),
)
# This project's own measured CPU runs: the docs' numbers on the 2-core AVX-512 machine, the same
# jobs under AVX2 kernels there, and a user's 2-core AVX2 AMD EPYC (issue 49's report).
RECIPE_PLAN = ("policy.model_name=examples/plans/models/smollm2-135m", "cluster.backend=local")
CPU_RUNS = (
    PublishedRun("tiny default GRPO, CPU", "configs/grpo_math_tiny.yaml", 0.133, 0.0, 8, 3,
                 "docs/performance.md, step_breakdown.py: median step 0.133 s (generation 0.033, training 0.086); "
                 "lengths from the tokenized data, not a run's metrics: '19+14=' is 6 tokens + BOS, "
                 "an answer 2-3 digits + EOS", cpu_kind="avx512"),
    PublishedRun("nemotron_mini (SmolLM2-135M, bf16), CPU", "recipes/nemotron_mini.yaml", 20.5, 0.0, 70, 48,
                 "docs/recipes/nemotron-mini.md: median step 20.5 s (generation 7.0, training 13.5); "
                 "70 prompt + 48 generated tokens (step_breakdown.py)", RECIPE_PLAN + ("policy.precision=bfloat16",),
                 cpu_kind="avx512"),
    PublishedRun("tiny default GRPO, CPU AVX2 kernels", "configs/grpo_math_tiny.yaml", 0.199, 0.0, 8, 3,
                 "step_breakdown.py --settings tiny under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 "
                 "MKL_ENABLE_INSTRUCTIONS=AVX2 on the AVX-512 machine, load < 1: median step 0.199 s "
                 "(generation 0.048, training 0.109)", ("policy.precision=float32",), cpu_kind="avx2"),
    PublishedRun("nemotron_mini, fp32 (auto), CPU AVX2 EPYC", "recipes/nemotron_mini.yaml", 73.0, 0.0, 70, 48,
                 "issue 49: a user's 2-core AMD EPYC (AVX2, no AVX-512), policy.precision=float32 (what auto "
                 "picks there): steps of 64, 73 and 100 s, the median taken", RECIPE_PLAN + ("policy.precision=float32",),
                 cpu_kind="avx2"),
)


def quiet_cpu():
    """This project's 2-core AVX-512 machine when quiet, as its docs measured it: float32 matmuls
    at 151 GFLOP/s (docs/recipes/nemotron-mini.md, step_breakdown.py's bound), bfloat16 2.4x that
    (AVX512-BF16; 173 against 71 GFLOP/s measured side by side, same page), weights read at 12.5
    GB/s (docs/performance.md)."""
    from posttrain.plan.gpus import CPU_NETWORK_BW, DeviceSpec

    return DeviceSpec("CPU (quiet 2-core AVX-512, docs)", 2.4 * 151e9, 151e9, 24, 12.5e9, 12.5e9, CPU_NETWORK_BW,
                      nvlink_domain=1 << 30)


def quiet_avx2_cpu():
    """The same machine under AVX2 kernels (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
    MKL_ENABLE_INSTRUCTIONS=AVX2`), quiet: a 1024-square float32 matmul ran at 0.64 of its AVX-512
    rate (162 against 255 GFLOP/s, `gpus.cpu_spec` side by side, load < 1), so 0.64 x 151 GFLOP/s;
    bfloat16 at float32's rate (posttrain multiplies in float32 without bfloat16 instructions);
    memory as before. An AVX2 machine's own clock and caches are not in it (docs/performance.md)."""
    from dataclasses import replace

    avx512 = quiet_cpu()
    fp32 = 0.64 * avx512.fp32_flops
    return replace(avx512, name="CPU (quiet 2-core, AVX2 kernels)", bf16_flops=fp32, fp32_flops=fp32)


QUIET_CPUS = {"avx512": quiet_cpu(), "avx2": quiet_avx2_cpu()}


# This project's own phases measured on one H200 (docs/performance.md, "On one GPU";
# benchmarks/gpu_one.py): (label, preset, what, measured seconds). Decoding: batch 64, random prompts
# of 64-128 tokens (mean 96), 256 new tokens greedy, the native engine; training: one PolicyWorker
# step of 64 rows, 28,407 tokens (prompts 96-128, mean 112, the rest completions), bfloat16.
H200_PHASES = (
    ("100m decode, batch 64 x 256 new tokens (7,190 tok/s)", "100m", "decode", 64 * 256 / 7190),
    ("1b decode, batch 64 x 256 new tokens (5,203 tok/s)", "1b", "decode", 64 * 256 / 5203),
    ("100m training step, 64 rows, 28,407 tokens", "100m", "training", 0.298),
    ("1b training step, 64 rows, 28,407 tokens", "1b", "training", 0.731),
)


def plan_h200_phase(preset: str, what: str) -> float:
    """The time plan of one of `H200_PHASES` on an H200, its phase alone."""
    from posttrain.config import load_config
    from posttrain.plan.gpus import GPU_SPECS
    from posttrain.plan.shape import model_shape
    from posttrain.plan.timing import Lengths, generation_s, layout_of, policy_pass_s

    cfg = load_config("grpo", overrides=[f"policy.model_name={preset}", "cluster.gpus_per_node=1", "sft_warmup=null",
                                         "cluster.gpu_type=H200", "policy.precision=bfloat16"])
    shape, layout, h200 = model_shape(cfg.policy), layout_of(cfg), GPU_SPECS["H200"]
    if what == "decode":
        return generation_s(shape, h200, layout, 64, 64, Lengths(96, 256), 2, 256, 64, None)[0]
    rows, tokens = 64, 28_407
    return policy_pass_s(shape, h200, layout, rows, Lengths(112, tokens / rows - 112), 2, 1, True, False,
                         shape.num_params)[0]


def load_run(run: PublishedRun):
    """(config, model shape) of a published run's plan config."""
    from posttrain.cli import config_algorithm
    from posttrain.config import load_config
    from posttrain.plan.shape import model_shape

    path = ROOT / "examples" / run.config
    cfg = load_config(config_algorithm(str(path)), str(path), list(run.overrides))
    return cfg, model_shape(cfg.policy)


def plan_run(run: PublishedRun, loaded=None, quiet_cpu: bool = True):
    """(time plan, device) of `run`: a CPU row on the quiet machine of its `cpu_kind`
    (`QUIET_CPUS`), or with `quiet_cpu=False` on this machine's CPU as measured now."""
    from posttrain.plan.gpus import device_spec
    from posttrain.plan.timing import Lengths, step_time

    cfg, shape = loaded or load_run(run)
    spec = QUIET_CPUS[run.cpu_kind] if run.cpu_kind and quiet_cpu else device_spec(cfg)
    return step_time(cfg, shape, spec, Lengths(run.prompt, run.response, "published")), spec


# The grid --leave-one-out refits the constants over (the others stay as timing.EFFICIENCY has them).
GRID = {"train_mfu": (0.3, 0.35, 0.4, 0.45, 0.5), "decode_bandwidth": (0.6, 0.7, 0.8), "decode_tail": (2, 2.5, 3),
        "moe": (0.25, 0.35, 0.5), "vllm_step_s": (0.005, 0.01, 0.015, 0.02)}


def leave_one_out() -> None:
    """For each GPU row: the constants of `GRID` that fit the other rows best (least mean |log
    ratio|), and that row's predicted / published step time under them: what to expect of a run
    the constants were not chosen on."""
    import itertools
    import math

    from posttrain.plan.timing import EFFICIENCY

    loaded = [load_run(run) for run in GPU_RUNS]
    kept = dict(EFFICIENCY)
    logs = []
    try:
        for values in itertools.product(*GRID.values()):
            EFFICIENCY.update(zip(GRID, values))
            logs.append([math.log(plan_run(run, one)[0].step_s / run.step_s) for run, one in zip(GPU_RUNS, loaded)])
    finally:
        EFFICIENCY.update(kept)
    combos = list(itertools.product(*GRID.values()))
    errors = []
    print("leave one out (constants refitted on the other rows over " + ", ".join(
        f"{k} {min(v):g}-{max(v):g}" for k, v in GRID.items()) + "):")
    for i, run in enumerate(GPU_RUNS):
        best = min(range(len(combos)), key=lambda c: sum(abs(x) for j, x in enumerate(logs[c]) if j != i))
        errors.append(abs(logs[best][i]))
        print(f"  {run.label:40s} {math.exp(logs[best][i]):5.2f}  ({', '.join(f'{v:g}' for v in combos[best])})")
    print(f"  held-out geometric mean error x{math.exp(sum(errors) / len(errors)):.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-only", action="store_true", help="skip this project's CPU rows")
    parser.add_argument("--leave-one-out", action="store_true",
                        help="also refit the constants without each GPU row over GRID and predict that row")
    parser.add_argument("--cpu", choices=("measured", "quiet"), default="quiet",
                        help="the CPU rows' device: 'quiet' (default) the rates measured on this project's quiet "
                        "2-core machine for each row's CPU kind (QUIET_CPUS), 'measured' this machine now "
                        "(gpus.cpu_spec; under the AVX2 variables it measures AVX2 kernels)")
    args = parser.parse_args()
    quiet = args.cpu == "quiet"
    import os

    os.chdir(ROOT)  # the plan configs name their models relative to the repository
    from posttrain.plan.timing import EFFICIENCY

    print("constants: " + ", ".join(f"{k}={v:g}" for k, v in EFFICIENCY.items()))
    if not args.gpu_only:
        from posttrain.plan import gpus

        for name, cpu in QUIET_CPUS.items() if quiet else (("measured now", gpus.cpu_spec()),):
            print(f"CPU ({name}): float32 {cpu.fp32_flops / 1e9:.0f} GFLOP/s, bfloat16 {cpu.bf16_flops / 1e9:.0f} "
                  f"GFLOP/s, memory {cpu.memory_bw / 1e9:.1f} GB/s" + ("" if quiet else " (a busy machine measures less)"))
    header = (f"{'run':42s} {'pred s':>8s} {'publ s':>8s} {'ratio':>6s} {'pred tok/s/GPU':>15s} "
              f"{'publ':>8s} {'ratio':>6s}  phases (gen / refit / logprobs / train s)")
    print(header)
    ratios = []
    for run in GPU_RUNS + (() if args.gpu_only else CPU_RUNS):
        t, _ = plan_run(run, quiet_cpu=quiet)
        ratio = t.step_s / run.step_s
        ratios.append((run.label, ratio))
        tok = t.tokens_per_s_per_device
        tok_ratio = f"{tok / run.tokens_per_s_per_gpu:6.2f}" if run.tokens_per_s_per_gpu else f"{'-':>6s}"
        publ_tok = f"{run.tokens_per_s_per_gpu:8,.1f}" if run.tokens_per_s_per_gpu else f"{'-':>8s}"
        phases = " / ".join(f"{t.phases.get(p, 0):.3g}" for p in ("generation", "refit", "logprobs", "training"))
        print(f"{run.label:42s} {t.step_s:8.3g} {run.step_s:8.3g} {ratio:6.2f} {tok:15,.1f} {publ_tok} {tok_ratio}  "
              f"{phases}")
    if not args.gpu_only:
        # The default job end to end: 86 s for the command, less its SFT warm start (20.5 s) and
        # start-up (about 4.5 s), is 250 GRPO steps with validations at steps 0, 25, ..., 250
        # (docs/getting-started.md).
        t, _ = plan_run(CPU_RUNS[0], quiet_cpu=quiet)
        validations = 250 // 25 + 1
        predicted = 250 * t.step_s + validations * t.validation_s
        print(f"{'tiny default, 250 steps + 11 validations':42s} {predicted:8.3g} {61.0:8.3g} {predicted / 61.0:6.2f}"
              f"  (measured: 86 s less the 20.5 s warm start and ~4.5 s start-up)")
    print("this project's phases on one H200 (docs/performance.md, \"On one GPU\"):")
    for label, preset, what, measured in H200_PHASES:
        predicted = plan_h200_phase(preset, what)
        print(f"  {label:52s} predicted {predicted:7.3f} s, measured {measured:7.3f} s, ratio {predicted / measured:5.2f}")
    gpu = [r for label, r in ratios if "CPU" not in label]
    import math

    spread = math.exp(sum(abs(math.log(r)) for r in gpu) / len(gpu))
    print(f"GPU rows: predicted / published step time {min(gpu):.2f} - {max(gpu):.2f}, "
          f"geometric mean error x{spread:.2f}")
    if args.leave_one_out:
        leave_one_out()
    print("sources:")
    for run in GPU_RUNS + (() if args.gpu_only else CPU_RUNS):
        print(f"  {run.label}: {run.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
