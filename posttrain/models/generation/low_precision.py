"""Low-precision generation engines (`policy.generation.precision`): the native engine's linear
layers in int8 or FP8, quantized from the engine's own copy of the weights at load and after
every refit.

`apply_generation_precision(model, precision, device)` replaces every `nn.Linear` of the decoder
(attention and MLP projections; not the output head, and not a mixture-of-experts router, whose
rounding would change which experts run, as DeepSeek-V3 keeps its gating in higher precision)
with a `LowPrecisionLinear` that computes with quantized weights (`quantization.py`). Embeddings,
norms and the output head stay in the engine's dtype. Experts held as fused 3-D tensors
(transformers' qwen3_moe and mixtral) stay in that dtype too.

Each `LowPrecisionLinear` keeps the original layer's `weight` and `bias` parameters under the
same names, which refits load into (or, with the local backend, share with the policy, in place)
and `verify_refit`'s checksums read; the quantized copy lives in non-persistent buffers, rebuilt
by `requantize(model)` after each refit. So refits, checksums and the refit metadata are those of
the unquantized engine; the cost is the quantized copy's memory beside the weights (a quarter of
the linear layers' float32 bytes for both int8 and fp8), and the training weights are never
touched. Logprobs the engine returns are the low-precision engine's: the trainer sees the gap
(`train/token_mult_prob_error`, `train/gen_kl_error`), which the importance-sampling correction
weighs out (on by default when the precisions differ: `config/schema/jobs.py`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from posttrain.errors import UserError
from posttrain.models.generation import quantization as q

QUANTIZED_PRECISIONS = ("int8", "fp8")
# Calls of at most this many rows (decode steps) use the fused int8 kernel; more (a long prefill)
# convert the weight per call: the kernel's time grows with the rows faster than a float32 matmul's,
# and the two were even at 256 rows on SmolLM2's shapes (benchmarks/generation_precision.py --layers).
INT8_KERNEL_MAX_ROWS = 256
# Input widths that are not a multiple of 16 gave wrong results or crashed the kernel (torch 2.13 on
# this CPU: garbage, NaN, a segfault): such layers never reach it.
INT8_KERNEL_FEATURE_MULTIPLE = 16
FP8_MIN_CAPABILITY = (9, 0)  # cuBLAS's 128 x 128 block scaling (torch's tests run it on sm90)


class LowPrecisionLinear(torch.nn.Module):
    """An `nn.Linear` computing with a quantized copy of its weight.

    Args:
        linear: the layer it replaces; its `weight` and `bias` parameters become this module's (same
            tensors, same names).
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.quantize()

    def quantize(self) -> None:
        """Rebuild the quantized copy from `weight` (after a refit)."""
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x [M, in_features] @ W.T` in low precision, in x's dtype."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(LowPrecisionLinear):
    """int8 weights with a float32 scale per output channel; bfloat16 activations (W8A16). CPU only."""

    def quantize(self) -> None:
        with torch.no_grad():
            weight_q, scale = q.quantize_int8_rows(self.weight)
        self.register_buffer("weight_q", weight_q, persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)
        self.register_buffer("unit_scales", torch.ones_like(scale, dtype=torch.bfloat16), persistent=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= INT8_KERNEL_MAX_ROWS and self.in_features % INT8_KERNEL_FEATURE_MULTIPLE == 0:
            return q.int8_matmul(x, self.weight_q, self.weight_scale, self.unit_scales)
        return q.int8_matmul_dequantized(x, self.weight_q, self.weight_scale)


class Fp8Linear(LowPrecisionLinear):
    """e4m3 weights with one scale per 128 x 128 block, activations quantized per 1 x 128 group.

    Args:
        emulate: compute with the dequantized tensors in float32 (the tests and benchmarks on CPU;
            never chosen by a run, which refuses fp8 without FP8 hardware). Default False:
            `torch.nn.functional.scaled_mm` on the GPU.
    """

    def __init__(self, linear: torch.nn.Linear, emulate: bool = False):
        self.emulate = emulate
        super().__init__(linear)

    def quantize(self) -> None:
        with torch.no_grad():
            weight_q, scale = q.quantize_fp8_blocks(self.weight)
        self.register_buffer("weight_q", weight_q, persistent=False)
        if self.emulate:  # dequantized once: the emulation's speed is not what it measures
            dequantized = q.dequantize_fp8_blocks(weight_q, scale, (self.out_features, self.in_features))
            self.register_buffer("weight_dequantized", dequantized, persistent=False)
            self.register_buffer("weight_scale", scale, persistent=False)
        else:
            self.register_buffer("weight_scale", q.cublas_block_scales(scale), persistent=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.emulate:
            return q.fp8_matmul_emulated(x, self.weight_q, self.weight_scale, self.out_features,
                                         dequantized_weight=self.weight_dequantized)
        return q.fp8_matmul(x, self.weight_q, self.weight_scale, self.out_features)


def fp8_device_problem(device: torch.device | str) -> Optional[str]:
    """None if `device` runs `Fp8Linear`'s kernel, else why not (one phrase naming the device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the engine runs on {device.type}, which has no FP8 matmul"
    capability = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if capability < FP8_MIN_CAPABILITY:
        return (f"{name} has compute capability {capability[0]}.{capability[1]}; FP8 with 128 x 128 block "
                f"scales needs >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}")
    return _fp8_kernel_problem(str(device), name)


@lru_cache(maxsize=None)
def _fp8_kernel_problem(device: str, name: str) -> Optional[str]:
    """Run the kernel once on a small product against its emulation (GPU only): a torch or CUDA
    build without cuBLAS's block scaling fails here, in one line, rather than mid-generation."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 256, generator=generator).to(device, torch.bfloat16)
    w = torch.randn(384, 256, generator=generator).to(device)
    weight_q, scale = q.quantize_fp8_blocks(w)
    try:
        got = q.fp8_matmul(x, weight_q, q.cublas_block_scales(scale), 384).float()
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError) as error:  # torch builds differ
        return f"torch's block-scaled FP8 matmul failed on {name}: {str(error).splitlines()[0]}"
    expected = q.fp8_matmul_emulated(x.float(), weight_q, scale, 384)
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    if not error < 2e-2:  # bfloat16 output rounding is 2^-9; a wrong scale layout is off by far more
        return f"torch's block-scaled FP8 matmul on {name} differs from its emulation by {error:.2e} of the largest output"
    return None


def quantizable_linears(model: torch.nn.Module) -> list[str]:
    """Names of the `nn.Linear` modules `apply_generation_precision` quantizes: every one except the
    output head and mixture-of-experts routers (modules named `gate`)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, module in model.named_modules()
            if type(module) is torch.nn.Linear and module is not head and name.rpartition(".")[2] != "gate"]


def apply_generation_precision(
    model: torch.nn.Module, precision: str, device: torch.device | str, *, emulate_fp8: bool = False,
) -> int:
    """Quantize `model`'s linear layers in place for `precision` (`int8` or `fp8`; others: nothing
    to do). Returns the number of layers replaced.

    Raises `UserError` (one line naming `policy.generation.precision` and the device) for fp8
    without FP8 hardware, unless `emulate_fp8` (tests and benchmarks only), and for int8 off CPU.
    """
    if precision not in QUANTIZED_PRECISIONS:
        return 0
    device = torch.device(device)
    if precision == "fp8" and not emulate_fp8:
        problem = fp8_device_problem(device)
        if problem is not None:
            raise UserError(f"policy.generation.precision=fp8: {problem}; use bfloat16 or float32 (int8 on CPU)")
    if precision == "int8" and device.type != "cpu":
        raise UserError(f"policy.generation.precision=int8 is the native engine's CPU path (torch's W8A16 kernel); "
                        f"the engine runs on {device.type}: use fp8 or bfloat16 there")
    names = quantizable_linears(model)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, leaf)
        setattr(parent, leaf, Int8Linear(linear) if precision == "int8" else Fp8Linear(linear, emulate=emulate_fp8))
    return len(names)


def requantize(model: torch.nn.Module) -> int:
    """Rebuild every `LowPrecisionLinear`'s quantized copy from its weight (after a refit); returns
    how many there are (0 for an unquantized engine)."""
    layers = [m for m in model.modules() if isinstance(m, LowPrecisionLinear)]
    for layer in layers:
        layer.quantize()
    return len(layers)

