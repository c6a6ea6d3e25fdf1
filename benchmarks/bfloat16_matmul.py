"""Training precision on this CPU: one forward + backward of a SmolLM2-sized MLP block in float32,
in plain bfloat16, and in bfloat16 with float32 matmuls (what posttrain does where bfloat16 is
slow), side by side, with what `policy.precision=auto` picks here.

    ./run.sh python benchmarks/bfloat16_matmul.py [--tokens 2048] [--repeats 5]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ./run.sh python benchmarks/bfloat16_matmul.py   # as an AVX2 CPU

The block is two linear layers of SmolLM2-135M's shapes (hidden 576, MLP 1536) over `--tokens`
tokens, as one training micro-batch. It prints the median seconds per step of each variant, the
ratios to float32, and the share of the plain bfloat16 step spent in matmuls (torch.profiler).
Then Muon's Newton-Schulz iteration over one SmolLM2-135M layer's seven matrices, in bfloat16 (torch's
Muon) and in float32 (what `policy.optimizer.name=muon` runs on a CPU without bfloat16 matmuls).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from posttrain.cpu_precision import auto_cpu_precision, compute_linears_in_float32, matmul_dtype
from posttrain.models.policy.muon import newton_schulz

# One SmolLM2-135M layer's matrices (q, k, v, o, gate, up, down): what Muon orthogonalises.
LAYER_SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))


def block(dtype: torch.dtype, tokens: int, float32_matmuls: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False), torch.nn.SiLU(),
                                torch.nn.Linear(1536, 576, bias=False)).to(dtype)
    if float32_matmuls:
        compute_linears_in_float32(model)
    return model, torch.randn(tokens, 576, dtype=dtype, requires_grad=True)


def step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).float().pow(2).mean().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    variants = {"float32": (torch.float32, False), "bfloat16": (torch.bfloat16, False),
                "bfloat16, float32 matmuls": (torch.bfloat16, True)}
    built = {name: block(dtype, args.tokens, f32) for name, (dtype, f32) in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for name, (model, x) in built.items():
        step(model, x)  # warm-up
    for _ in range(args.repeats):  # interleaved, so a busy moment hits every variant alike
        for name, (model, x) in built.items():
            start = time.perf_counter()
            step(model, x)
            times[name].append(time.perf_counter() - start)
    precision, why = auto_cpu_precision()
    print(f"CPU kernels: {torch.backends.cpu.get_cpu_capability()}; policy.precision=auto -> {precision} ({why})")
    base = statistics.median(times["float32"])
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{name:28s} {median * 1e3:9.1f} ms/step   {median / base:6.2f}x float32")
    from torch.profiler import ProfilerActivity, profile

    model, x = built["bfloat16"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, x)
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    matmuls = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))
    print(f"plain bfloat16: {100 * matmuls / max(total, 1):.0f}% of the step in aten::mm/addmm")
    newton_schulz_times(args.repeats)


def newton_schulz_times(repeats: int) -> None:
    updates = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(LAYER_SHAPES)]
    muon = torch.optim.Muon([torch.nn.Parameter(u) for u in updates])
    times: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
    for repeat in range(repeats + 1):  # the first is a warm-up
        for dtype in times:
            start = time.perf_counter()
            for update in updates:
                newton_schulz(update, muon.defaults["ns_coefficients"], muon.defaults["ns_steps"], muon.defaults["eps"], dtype)
            if repeat:
                times[dtype].append(time.perf_counter() - start)
    here = matmul_dtype(torch.bfloat16, "cpu")  # MuonWithAdamW's default iteration dtype on this CPU
    base = statistics.median(times[torch.float32])
    print(f"Muon's Newton-Schulz, one SmolLM2-135M layer (posttrain runs it in {str(here).removeprefix('torch.')} here):")
    for dtype, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {str(dtype).removeprefix('torch.'):9s} {median * 1e3:9.1f} ms   {median / base:6.2f}x float32")


if __name__ == "__main__":
    main()
