"""Would fewer bytes per weight speed up decoding here? One decode step's matmuls in fp32, bf16 and int8.

    ./run.sh python benchmarks/decode_dtypes.py            # --rows 8 32 --threads 2

Decoding a 135M model reads every weight once per step for at most a few dozen rows, so halving
the bytes (bfloat16) or quartering them (int8) is the usual way to speed it up. Whether it does
depends on the CPU's kernels: this runs the matmuls of one SmolLM2-135M decode step (30 layers of
q, k, v, o, gate, up and down projections plus the 49152-wide lm_head; random weights, the shapes
are what matters) at each dtype, side by side, and prints milliseconds and the speed-up over fp32.
int8 is torch's dynamic quantization of `nn.Linear` (int8 weights, activations quantised per call),
skipped where this torch build lacks it.
"""

from __future__ import annotations

import argparse
import warnings

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch

from bench_timing import best_seconds

HIDDEN, KV, INTERMEDIATE, LAYERS, VOCAB = 576, 192, 1536, 30, 49152  # SmolLM2-135M
LAYER_SHAPES = [  # (in_features, out_features) of q, k, v, o, gate, up, down
    (HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN),
    (HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN),
]


def decode_step_linears() -> list[torch.nn.Linear]:
    return [torch.nn.Linear(i, o, bias=False) for i, o in LAYER_SHAPES * LAYERS + [(HIDDEN, VOCAB)]]


def int8_linears(linears: list[torch.nn.Linear]) -> list[torch.nn.Module] | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch deprecates the quantized tensor API
            quantized = torch.ao.quantization.quantize_dynamic(
                torch.nn.ModuleList(linears), {torch.nn.Linear}, dtype=torch.qint8)
        return list(quantized)
    except (AttributeError, RuntimeError) as e:
        print(f"int8: skipped ({e})")
        return None


def step_seconds(linears: list[torch.nn.Module], inputs: dict[int, torch.Tensor], repeats: int) -> float:
    def step():
        for linear in linears:
            linear(inputs[linear.in_features])

    with torch.inference_mode():
        return best_seconds(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32], help="rows per decode step")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    fp32 = decode_step_linears()
    variants = {"fp32": fp32, "bf16": [linear.to(torch.bfloat16) for linear in decode_step_linears()]}
    int8 = int8_linears(fp32)
    if int8 is not None:
        variants["int8 (dynamic)"] = int8
    megabytes = sum(linear.weight.numel() for linear in fp32) * 4 / 2**20
    print(f"one decode step's matmuls: {len(fp32)} linears, {megabytes:.0f} MiB of fp32 weights, "
          f"{args.threads} threads, best of {args.repeats}")
    print(f"{'rows':>5} {'dtype':<15} {'ms':>8} {'speed-up vs fp32':>17}")
    for rows in args.rows:
        inputs = {n: torch.randn(rows, n) for n in (HIDDEN, INTERMEDIATE)}
        baseline = None
        for name, linears in variants.items():
            dtype = torch.bfloat16 if name == "bf16" else torch.float32
            seconds = step_seconds(linears, {n: x.to(dtype) for n, x in inputs.items()}, args.repeats)
            baseline = baseline or seconds
            print(f"{rows:>5} {name:<15} {seconds * 1e3:>8.1f} {baseline / seconds:>16.2f}x")


if __name__ == "__main__":
    main()
