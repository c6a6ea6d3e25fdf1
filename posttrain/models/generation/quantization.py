"""Weight and activation quantization for low-precision generation (`policy.generation.precision`):
pure functions, each with its error bound, and the matmuls that use them.

FP8 (`fp8`, DeepSeek-V3's recipe, arXiv:2412.19437, section 3.3): weights in `float8_e4m3fn` with
one scale per 128 x 128 block, activations quantized per token and group of 128 input features
(1 x 128), both scaled so the block's largest magnitude maps to e4m3's largest finite value, 448.
The matmul accumulates in float32: `torch.nn.functional.scaled_mm` with cuBLAS's block scaling on
a GPU of compute capability >= 9.0 (`fp8_matmul`), or the same arithmetic on dequantized tensors
(`fp8_matmul_emulated`: the tests and benchmarks on CPU, never a run's engine).

Error bound of one e4m3 element (derived here, checked by tests/unit/test_low_precision.py). With
`s = amax / 448` the block's scale, `y = x / s` lies in [-448, 448]. e4m3 keeps 3 mantissa bits:
a normal `|y|` in `[2^e, 2^(e+1))` (e >= -6) is rounded to the nearest multiple of `2^(e-3)`, an
error of at most `2^(e-4) <= 2^-4 |y|`; below `2^-6` (subnormals) the spacing is `2^-9`, an error
of at most `2^-10`. So

    |x - dequantize(quantize(x))| <= max(2^-4 |x|, 2^-10 s)          (FP8_RELATIVE_ERROR, FP8_SUBNORMAL_ERROR)

plus float32 rounding of the division and the product (at most `2^-21` of the block's amax), and
never more than `2^-4` of the block's largest magnitude.

int8 (`int8`, weight-only, W8A16 as gpt-fast's int8): one symmetric scale per output channel,
`s = amax_row / 127`, `q = round(w / s)`, an error of at most `s / 2` per weight. The CPU kernel
(`torch.ops.aten._weight_int8pack_mm`) takes bfloat16 activations and returns bfloat16, so
activations and outputs are rounded to bfloat16 (relative error `2^-9` each).

Blocks and groups pad the tensor with zeros to a multiple of 128 (a padded block's scale comes
from its real elements; an all-zero block gets scale 1, so it dequantizes to exact zeros). Weights
must be finite: a NaN or infinite weight raises ValueError, as there is no scale that represents
it. Non-finite activations give NaN in their token's outputs, as the unquantized matmul would give
inf or NaN there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128  # weight blocks are BLOCK x BLOCK, activation groups 1 x BLOCK
FP8_RELATIVE_ERROR = 2.0**-4  # half an e4m3 ulp, relative, for normal numbers
FP8_SUBNORMAL_ERROR = 2.0**-10  # half the subnormal spacing 2^-9, in units of the scale
FLOAT32_SLACK = 2.0**-21  # float32 rounding of x / s and s * q, relative to the block's amax
INT8_MAX = 127


def _padded(size: int, multiple: int = BLOCK) -> int:
    return -(-size // multiple) * multiple


def _check_finite(tensor: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{what} holds NaN or infinite values: no scale represents them")


def _scales(amax: torch.Tensor, top: float) -> torch.Tensor:
    """`amax / top`, with 1 where `amax` is 0 (an all-zero block dequantizes to exact zeros)."""
    return torch.where(amax > 0, amax / top, torch.ones_like(amax))


# ------------------------------------------------------------------------------------------ fp8
def quantize_fp8_blocks(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a `[N, K]` weight to e4m3 with one scale per `block x block` block.

    Returns `(q [N', K'] float8_e4m3fn, scale [N'/block, K'/block] float32)`, N' and K' rounded
    up to multiples of `block` (zero padding), so `weight ~ q * scale` block by block
    (`dequantize_fp8_blocks`). Raises ValueError on a NaN or infinite weight.
    """
    if weight.dim() != 2:
        raise ValueError(f"quantize_fp8_blocks: expected a [N, K] weight, got shape {tuple(weight.shape)}")
    _check_finite(weight, "the weight")
    rows, cols = weight.shape
    padded = F.pad(weight.float(), (0, _padded(cols, block) - cols, 0, _padded(rows, block) - rows))
    blocks = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    scale = _scales(blocks.abs().amax(dim=(1, 3)), FP8_MAX)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(padded.shape), scale


def dequantize_fp8_blocks(
    q: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`q * scale` per block, cut back to `shape` (the weight's unpadded `[N, K]`)."""
    block_rows, block_cols = q.shape[0] // scale.shape[0], q.shape[1] // scale.shape[1]
    blocks = q.float().view(scale.shape[0], block_rows, scale.shape[1], block_cols) * scale[:, None, :, None]
    return blocks.view(q.shape)[: shape[0], : shape[1]].to(dtype)


def quantize_fp8_groups(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations `[M, K]` to e4m3 per token and group of `group` features.

    Returns `(q [M, K'] float8_e4m3fn, scale [M, K'/group] float32)`, K' a multiple of `group`
    (zero padding): `x ~ q * scale` group by group (`dequantize_fp8_groups`). A token's scales
    depend on that token alone, so a row's numbers never depend on the rows beside it.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8_groups: expected [M, K] activations, got shape {tuple(x.shape)}")
    cols = x.shape[1]
    padded = F.pad(x.float(), (0, _padded(cols, group) - cols))
    groups = padded.view(x.shape[0], -1, group)
    scale = _scales(groups.abs().amax(dim=2), FP8_MAX)
    q = (groups / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(padded.shape), scale


def dequantize_fp8_groups(q: torch.Tensor, scale: torch.Tensor, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q * scale` per group, cut back to `cols` features."""
    groups = q.float().view(q.shape[0], scale.shape[1], -1) * scale[:, :, None]
    return groups.view(q.shape)[:, :cols].to(dtype)


def fp8_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on `|x - dequantize(quantize(x))|` for elements of blocks with decode
    scale `scale` (broadcast to `x`): `max(2^-4 |x|, 2^-10 s)` plus float32 rounding."""
    x, scale = x.float().abs(), scale.float()
    return torch.maximum(FP8_RELATIVE_ERROR * x, FP8_SUBNORMAL_ERROR * scale) + FLOAT32_SLACK * FP8_MAX * scale


def fp8_matmul_emulated(
    x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, out_features: int,
    dequantized_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x [M, K] @ W.T` as the FP8 kernel computes it: x quantized per 1 x 128 group, the
    block-quantized weight, float32 accumulation, the result in x's dtype. `dequantized_weight`
    (`[N, K]` float32) skips dequantizing the weight on every call."""
    in_features = x.shape[1]
    if dequantized_weight is None:
        dequantized_weight = dequantize_fp8_blocks(weight_q, weight_scale, (out_features, in_features))
    x_q, x_scale = quantize_fp8_groups(x)
    return F.linear(dequantize_fp8_groups(x_q, x_scale, in_features), dequantized_weight).to(x.dtype)


def cublas_block_scales(weight_scale: torch.Tensor) -> torch.Tensor:
    """The weight's 128 x 128 scales as cuBLAS's block scaling reads them: K blocks padded to a
    multiple of 4 and K-major (`[ceil4(K/128), N/128]`, stride `(1, ceil4(K/128))`), per torch's
    tests of `scaled_mm` (test/test_scaled_matmul_cuda.py, `_pad_128x128_scales`)."""
    return F.pad(weight_scale, (0, -weight_scale.shape[1] % 4)).t()


def fp8_matmul(
    x: torch.Tensor, weight_q: torch.Tensor, weight_scales_cublas: torch.Tensor, out_features: int,
) -> torch.Tensor:
    """`x [M, K] @ W.T` on a CUDA device with FP8 tensor cores (GPU only: docs/scaling.md,
    "GPU-only paths"): x quantized per 1 x 128 group, `torch.nn.functional.scaled_mm` with
    `BlockWise1x128` (x) and `BlockWise128x128` (W) scales, float32 accumulation, the result in x's
    dtype (bfloat16 or float32).

    `weight_q` is `[N', K']` e4m3 (`quantize_fp8_blocks`), `weight_scales_cublas` its scales
    through `cublas_block_scales`. x's rows are padded to a multiple of 4 and its features to K'
    (cuBLAS's layout rules for block scales).
    """
    rows, cols = x.shape
    padded_rows = _padded(rows, 4)
    x_q, x_scale = quantize_fp8_groups(F.pad(x, (0, weight_q.shape[1] - cols, 0, padded_rows - rows)))
    out = _block_scaled_mm(x_q, weight_q.t(), x_scale.t().contiguous().t(), weight_scales_cublas, x.dtype)
    return out[:rows, :out_features]


def _block_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """`a @ b` with 1 x 128 scales for `a` and 128 x 128 for `b`: `F.scaled_mm` where torch has it
    (its recipe names are `BlockWise1x128` in some releases, `Blockwise_1x128` in others), else
    `torch._scaled_mm`, which reads the block sizes off the scales' shapes."""
    scaled_mm = getattr(F, "scaled_mm", None)
    if scaled_mm is None:
        return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=dtype)
    recipes = F.ScalingType
    row_groups = getattr(recipes, "BlockWise1x128", None) or getattr(recipes, "Blockwise_1x128")
    blocks = getattr(recipes, "BlockWise128x128", None) or getattr(recipes, "Blockwise_128x128")
    return scaled_mm(a, b, scale_a, row_groups, scale_b, blocks, output_dtype=dtype)


# ------------------------------------------------------------------------------------------ int8
def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: `(q [N, K] int8, scale [N] float32)` with
    `weight ~ q * scale[:, None]`, `|error| <= scale / 2`. Raises ValueError on a NaN or infinite weight."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_int8_rows: expected a [N, K] weight, got shape {tuple(weight.shape)}")
    _check_finite(weight, "the weight")
    w = weight.float()
    scale = _scales(w.abs().amax(dim=1), INT8_MAX)
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def int8_matmul(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, unit_scales: torch.Tensor) -> torch.Tensor:
    """`x [M, K] @ W.T` with torch's fused W8A16 CPU kernel (`aten._weight_int8pack_mm`): x in
    bfloat16, the int8 weight, a bfloat16 result, then the float32 per-channel scales (applied
    after the kernel, with `unit_scales` (ones, bfloat16) inside it, so the scales are not
    rounded to bfloat16). Returns x's dtype. K must be a multiple of 16: other widths gave wrong
    results or crashed the kernel (torch 2.13 on CPU: garbage, NaN, a segfault)."""
    if x.shape[1] % 16:
        raise ValueError(f"int8_matmul: {x.shape[1]} input features is not a multiple of 16")
    out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), weight_q, unit_scales)
    return (out.float() * weight_scale).to(x.dtype)


def int8_matmul_dequantized(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """`int8_matmul`'s arithmetic without the kernel (bfloat16 x, float32 accumulation, bfloat16
    result, float32 scales): the weight is converted to float per call, which pays off for the
    many rows of a prefill (`low_precision.INT8_KERNEL_MAX_ROWS`)."""
    out = F.linear(x.to(torch.bfloat16).float(), weight_q.float()).to(torch.bfloat16)
    return (out.float() * weight_scale).to(x.dtype)
