"""A decode step's output head: the vocabulary's logits, in slices of the head's weight where that is
faster on this machine and gives the same bits.

Why: a decode step multiplies a few rows (the running samples) by the whole vocabulary. For a large
vocabulary MKL runs that product out of cache and, at these shapes, on one thread: on a 2-core AVX2
AMD EPYC, SmolLM2-135M's 49,152 x 576 head took 37 ms at 32 rows (of a 180 ms decode step) and
25 ms as 2,048-row slices of the weight, each slice's product in cache and on both cores
(`benchmarks/output_head.py`). Each logit is still one dot product over the hidden size, but whether
a kernel sums it in the same order for a slice as for the whole product is up to the BLAS, so the
slices are used only where, on this machine, they gave the whole product's bits at the row counts a
decode step feeds and ran faster (`slices_pay_off`, measured once per head shape, dtype and thread
count). The decoders then stay the model's forward bit for bit (`decoders.py`).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn.functional as F

SLICE_ROWS = 2048  # vocabulary rows per slice: 1024-4096 ran alike on SmolLM2's head; 8192 and more did not
MIN_VOCAB = 4 * SLICE_ROWS  # smaller heads fit in cache whole
MIN_ROWS = 2  # one row is a matrix-vector product, faster whole (0.88x in slices on SmolLM2's head)
PROBE_ROWS = (1, 3, 8, 17, 32)  # row counts whose logits must match bit for bit before slices are used
_choices: dict[tuple, bool] = {}  # (weight shape, dtype, bias, torch threads) -> use slices


def sliced_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  rows: int = SLICE_ROWS) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed `rows` output features at a time."""
    return torch.cat([F.linear(x, weight[start:start + rows], None if bias is None else bias[start:start + rows])
                      for start in range(0, weight.shape[0], rows)], dim=-1)


def head_logits(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`head(hidden)`: in slices of its weight for `MIN_ROWS` rows or more when `slices_pay_off` for it,
    else the module's own call."""
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        return head(hidden)
    weight = head.weight
    if weight.device.type != "cpu" or weight.shape[0] < MIN_VOCAB or hidden.numel() < MIN_ROWS * hidden.shape[-1]:
        return head(hidden)
    key = (tuple(weight.shape), weight.dtype, head.bias is not None, torch.get_num_threads())
    use = _choices.get(key)
    if use is None:
        use = _choices[key] = slices_pay_off(weight, head.bias)
    return sliced_linear(hidden, weight, head.bias) if use else head(hidden)


@torch.inference_mode()
def slices_pay_off(weight: torch.Tensor, bias: Optional[torch.Tensor] = None, repeats: int = 2) -> bool:
    """Whether `sliced_linear` gives `F.linear`'s exact result for `PROBE_ROWS` rows of inputs and runs
    faster at the largest of them (best of `repeats` timed calls each, interleaved, after a warm-up).
    Which is faster changes no result: both give the same bits, or the slices are not used."""
    generator = torch.Generator().manual_seed(0)
    probes = [torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype) for rows in PROBE_ROWS]
    for x in probes:
        if not torch.equal(sliced_linear(x, weight, bias), F.linear(x, weight, bias)):
            return False
    x = probes[-1]
    best = {"whole": float("inf"), "slices": float("inf")}
    for _ in range(repeats):
        for name, product in (("whole", F.linear), ("slices", sliced_linear)):
            start = time.perf_counter()
            product(x, weight, bias)
            best[name] = min(best[name], time.perf_counter() - start)
    return best["slices"] < best["whole"]
