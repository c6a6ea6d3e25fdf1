"""A decode step's output head, whole against in slices of its weight (`posttrain/models/generation/output_head.py`).

    ./run.sh python benchmarks/output_head.py            # --threads 2 --rows 1 8 32 64 --repeats 20

For the heads of SmolLM2-135M (49,152 x 576) and Gemma 3 270M (262,144 x 640), random float32 weights
(speed does not depend on the values), at each row count: the best of `--repeats` interleaved calls
of `F.linear` on the whole weight and of `sliced_linear` (2,048 rows a slice), their ratio, and
whether the two gave the same bits; then what `output_head.slices_pay_off` picks on this machine.
"""

from __future__ import annotations

import argparse

import posttrain  # noqa: F401 - first: it sets how OpenMP threads wait before torch loads OpenMP
import torch
import torch.nn.functional as F
from bench_timing import best_interleaved

from posttrain.models.generation.output_head import SLICE_ROWS, slices_pay_off, sliced_linear

HEADS = {"SmolLM2-135M": (49152, 576), "Gemma 3 270M": (262144, 640)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{SLICE_ROWS} rows a slice")
    with torch.inference_mode():
        for name, (vocab, hidden) in HEADS.items():
            weight = torch.randn(vocab, hidden)
            for rows in args.rows:
                x = torch.randn(rows, hidden)
                best, _ = best_interleaved({"whole": lambda: F.linear(x, weight), "sliced": lambda: sliced_linear(x, weight)},
                                           max(3, args.repeats * 49152 // vocab))
                whole, sliced = best["whole"], best["sliced"]
                same = torch.equal(F.linear(x, weight), sliced_linear(x, weight))
                print(f"{name:13s} {rows:4d} rows: whole {whole * 1e3:7.2f} ms  sliced {sliced * 1e3:7.2f} ms  "
                      f"whole/sliced {whole / sliced:4.2f}x  same bits: {same}")
            print(f"{name:13s} slices_pay_off: {slices_pay_off(weight)}")


if __name__ == "__main__":
    main()
