"""One block of attention with its log-sum-exp, forward and backward: what ring attention
(`context_parallel.py`) computes at each step of the ring, for the queries it holds against the
key/value chunk that has just arrived.

A block is either causal (queries and keys are the same positions, in order: the ring's first
step) or fully visible (every query sees every key); the ring needs another mask only at a
sliding window's edge (`masked_forward` / `masked_backward`: float32 matmuls of a tile of queries
against the keys of their windows, with the mask). The
forward returns `(out, lse)`: `out [b, h, sq, d]` (the inputs' dtype from a fused kernel, float32
from `matmul`), `lse [b, h, sq]` float32.
The backward takes the *final* output and log-sum-exp (after every block is merged), which makes
each block's softmax the whole row's softmax restricted to the block, so its (dq, dk, dv) are that
block's exact share of the gradient (the flash-attention backward; Dao 2023).

Three implementations, chosen per (device, dtype) by `block_kernel`:

- `cpu_flash`: torch's fused CPU kernel (`aten._scaled_dot_product_flash_attention_for_cpu` and
  its backward): tiled, so no `[sq, sk]` score matrix is materialised, any float dtype.
- `cuda_flash`: torch's flash kernel on CUDA (`aten._scaled_dot_product_flash_attention`), for
  bfloat16 and float16 (the kernel's dtypes). Written from the op's schema and torch's own ring
  attention, never run here (no GPU): `block_kernel` checks it before first use (below).
- `matmul`: plain float32 matmuls, any device and dtype, `[sq, sk]` scores in memory. The
  fallback, and the reference the other two are checked against.

Before a fused kernel is used for a (device, dtype) the first time, `block_kernel` runs it on small
random blocks (both kinds, forward and backward) against `matmul`; an error or a disagreement logs
one line naming the kernel and the reason and falls back to `matmul` for that (device, dtype).
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import torch

logger = logging.getLogger(__name__)
aten = torch.ops.aten


class BlockKernel(NamedTuple):
    name: str
    # (q, k, v, causal, scale) -> (out, lse)
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (grad_out, q, k, v, out, lse, causal, scale) -> (grad_q, grad_k, grad_v), float32
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


# ------------------------------------------------------------------------------------- matmul
def _scores(q, k, causal, scale, visible=None):
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if visible is not None:
        scores = scores.masked_fill(~visible.to(q.device), float("-inf"))
    return scores


def _matmul_forward(q, k, v, causal, scale, visible=None):
    scores = _scores(q, k, causal, scale, visible)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    if visible is not None:  # a query that sees no key of the block (a window's edge): lse -inf, output 0, not NaN
        probs = probs.nan_to_num(0.0)
    return torch.matmul(probs, v.float()), lse


def _matmul_backward(grad_out, q, k, v, out, lse, causal, scale, visible=None):
    grad_out, q32, k32, v32 = grad_out.float(), q.float(), k.float(), v.float()
    probs = torch.exp(_scores(q, k, causal, scale, visible) - lse[..., None])
    delta = (grad_out * out.float()).sum(dim=-1, keepdim=True)  # rowsum(dO * O)
    grad_scores = probs * (torch.matmul(grad_out, v32.transpose(-1, -2)) - delta)
    return (torch.matmul(grad_scores, k32) * scale, torch.matmul(grad_scores.transpose(-1, -2), q32) * scale,
            torch.matmul(probs.transpose(-1, -2), grad_out))


MATMUL = BlockKernel("matmul", _matmul_forward, _matmul_backward)


def masked_forward(q, k, v, visible, scale):
    """A block where only the pairs `visible [sq, sk]` (bool) attend (a sliding window's edge):
    float32 matmuls, `(out, lse)`; a query that sees none of the keys gets out 0 and lse -inf."""
    return _matmul_forward(q, k, v, False, scale, visible)


def masked_backward(grad_out, q, k, v, out, lse, visible, scale):
    """`masked_forward`'s block share of the gradient, from the final `out` and `lse` (module doc)."""
    return _matmul_backward(grad_out, q, k, v, out, lse, False, scale, visible)


# ------------------------------------------------------------------------------ fused kernels
def _cpu_flash_forward(q, k, v, causal, scale):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k.contiguous(), v.contiguous(), 0.0, causal,
                                                                 scale=scale)
    return out, lse.float()


def _cpu_flash_backward(grad_out, q, k, v, out, lse, causal, scale):
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.to(q.dtype).contiguous(), q, k.contiguous(), v.contiguous(), out.to(q.dtype).contiguous(),
        lse.contiguous(), 0.0, causal, scale=scale)
    return tuple(g.float() for g in grads)


def _cuda_flash_forward(q, k, v, causal, scale):
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k.contiguous(), v.contiguous(), 0.0, causal, False,
                                                             scale=scale)
    return out, lse.float()


def _cuda_flash_backward(grad_out, q, k, v, out, lse, causal, scale):
    # cum_seq_q/k: None, as the dense forward returns them (a defined tensor selects the kernel's
    # variable-length path); without dropout the kernel does not read the RNG state (None too).
    grads = aten._scaled_dot_product_flash_attention_backward(
        grad_out.to(q.dtype).contiguous(), q, k.contiguous(), v.contiguous(), out.to(q.dtype).contiguous(),
        lse.contiguous(), None, None, q.shape[-2], k.shape[-2], 0.0, causal, None, None, scale=scale)
    return tuple(g.float() for g in grads)


CPU_FLASH = BlockKernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward)
CUDA_FLASH = BlockKernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward)

_chosen: dict[tuple[str, torch.dtype], BlockKernel] = {}


def _candidate(device: torch.device, dtype: torch.dtype) -> BlockKernel:
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16):
        return CPU_FLASH
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return CUDA_FLASH
    return MATMUL


def disagreement(kernel: BlockKernel, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `kernel` cannot stand in for `MATMUL` on (device, dtype), or None when it agrees on
    small random blocks: causal and fully visible, forward and backward, uneven query/key lengths."""
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    g = torch.Generator().manual_seed(0)
    for causal, (sq, sk) in ((True, (24, 24)), (False, (12, 24)), (False, (24, 12))):
        q, k, v = (torch.randn(2, 3, s, 16, generator=g).to(device, dtype) for s in (sq, sk, sk))
        grad_out = torch.randn(2, 3, sq, 16, generator=g).to(device)
        try:
            out, lse = kernel.forward(q, k, v, causal, 0.25)
            ref_out, ref_lse = MATMUL.forward(q, k, v, causal, 0.25)
            got = kernel.backward(grad_out, q, k, v, ref_out, ref_lse, causal, 0.25)
            want = MATMUL.backward(grad_out, q, k, v, ref_out, ref_lse, causal, 0.25)
        except Exception as error:  # noqa: BLE001 - any failure means: do not use this kernel
            return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        pairs = [("out", out.float(), ref_out.float()), ("lse", lse.reshape(ref_lse.shape), ref_lse),
                 *((f"grad_{n}", a, b) for n, a, b in zip("qkv", got, want))]
        for name, a, b in pairs:
            if a.shape != b.shape:
                return f"{name} has shape {tuple(a.shape)}, expected {tuple(b.shape)}"
            error = ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()
            if not error <= tolerance:
                return f"{name} differs by {error:.2g} (causal={causal}, {sq}x{sk})"
    return None


def block_kernel(device: torch.device, dtype: torch.dtype) -> BlockKernel:
    """The fused kernel for (device, dtype) when it passes `disagreement`'s check, else `MATMUL`;
    checked once per process and (device type, dtype)."""
    key = (device.type, dtype)
    if key not in _chosen:
        kernel = _candidate(device, dtype)
        reason = None if kernel is MATMUL else disagreement(kernel, device, dtype)
        if reason is not None:
            logger.warning("ring attention: the %s kernel failed its check on %s %s (%s); using float32 matmul "
                           "blocks", kernel.name, device.type, dtype, reason)
            kernel = MATMUL
        _chosen[key] = kernel
    return _chosen[key]
