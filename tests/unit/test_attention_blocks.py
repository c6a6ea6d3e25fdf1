"""Ring attention's per-block kernels (`models/policy/attention_blocks.py`): each against SDPA and
autograd, the choice and its fallback, and the CUDA kernel's calls bound to its schema on meta
tensors (no GPU here)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from posttrain.models.policy import attention_blocks as blocks

CPU = torch.device("cpu")


@pytest.mark.parametrize("kernel", [blocks.MATMUL, blocks.CPU_FLASH], ids=lambda k: k.name)
@pytest.mark.parametrize("causal,sq,sk", [(True, 10, 10), (False, 6, 10), (False, 10, 4)])
def test_a_block_is_attention_and_its_backward_is_autograds(kernel, causal, sq, sk):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, s, 8, generator=g) for s in (sq, sk, sk))
    grad_out = torch.randn(2, 3, sq, 8, generator=g)
    out, lse = kernel.forward(q, k, v, causal, 0.3)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=0.3)
    scores = (q @ k.transpose(-1, -2)) * 0.3
    if causal:
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out.float(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-6)

    want = torch.autograd.grad(ref, leaves, grad_out)
    got = kernel.backward(grad_out, q, k, v, out, lse, causal, 0.3)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_two_blocks_merged_by_log_sum_exp_get_the_whole_rows_gradient_from_the_final_lse():
    """What the ring relies on: with the merged output and log-sum-exp, each block's backward is
    that block's share of the gradient of attention over both blocks."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    grad_out = torch.randn(1, 2, 6, 8, generator=g)
    kernel = blocks.CPU_FLASH
    (out_a, lse_a), (out_b, lse_b) = (kernel.forward(q, k[:, :, half], v[:, :, half], False, 0.3)
                                      for half in (slice(0, 6), slice(6, 12)))
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, scale=0.3)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(ref, leaves, grad_out)
    dq = torch.zeros_like(q)
    for half in (slice(0, 6), slice(6, 12)):
        dq_b, dk_b, dv_b = kernel.backward(grad_out, q, k[:, :, half], v[:, :, half], out, lse, False, 0.3)
        dq += dq_b
        torch.testing.assert_close(dk_b, dk_ref[:, :, half], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dv_b, dv_ref[:, :, half], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dq, dq_ref, rtol=1e-4, atol=1e-5)


def test_the_fused_cpu_kernel_is_chosen_and_passes_its_check():
    blocks._chosen.clear()
    for dtype in (torch.float32, torch.bfloat16):
        assert blocks.disagreement(blocks.CPU_FLASH, CPU, dtype) is None
        assert blocks.block_kernel(CPU, dtype) is blocks.CPU_FLASH
    assert blocks.block_kernel(CPU, torch.float64) is blocks.MATMUL


def test_a_kernel_that_disagrees_falls_back_to_matmul_with_one_line(monkeypatch, caplog):
    def lse_in_the_wrong_layout(q, k, v, causal, scale):
        out, lse = blocks.CPU_FLASH.forward(q, k, v, causal, scale)
        return out, lse.transpose(1, 2).reshape(lse.shape)  # [b, s, h] read as [b, h, s]

    broken = blocks.BlockKernel("broken", lse_in_the_wrong_layout, blocks.CPU_FLASH.backward)
    assert "lse differs" in blocks.disagreement(broken, CPU, torch.float32)
    raising = blocks.BlockKernel("raising", blocks.CPU_FLASH.forward, lambda *a: (_ for _ in ()).throw(
        RuntimeError("no kernel image")))
    assert blocks.disagreement(raising, CPU, torch.float32) == "RuntimeError: no kernel image"

    monkeypatch.setattr(blocks, "_chosen", {})
    monkeypatch.setattr(blocks, "_candidate", lambda device, dtype: broken)
    with caplog.at_level(logging.WARNING, logger=blocks.__name__):
        assert blocks.block_kernel(CPU, torch.float32) is blocks.MATMUL
    assert "the broken kernel failed its check on cpu torch.float32 (lse differs" in caplog.text


@pytest.mark.parametrize("causal", [True, False])
def test_the_cuda_flash_calls_bind_to_the_ops_schemas(causal):
    """The CUDA path cannot run here; on meta tensors torch checks the arguments against each op's
    schema and gives the outputs' shapes and dtypes."""
    q = torch.empty(2, 4, 8, 64, dtype=torch.bfloat16, device="meta")
    # What the dense forward hands its backward: no cumulative lengths (None, not an empty tensor,
    # which would select the variable-length kernel).
    dense = torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, causal, False, scale=0.125)
    assert dense[2] is None and dense[3] is None
    k = torch.empty(2, 4, 8 if causal else 16, 64, dtype=torch.bfloat16, device="meta")
    out, lse = blocks.CUDA_FLASH.forward(q, k, k, causal, 0.125)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, q.shape[:-1], torch.float32)
    grads = blocks.CUDA_FLASH.backward(q, q, k, k, out, lse, causal, 0.125)
    assert [(g.shape, g.dtype) for g in grads] == [(q.shape, torch.float32), (k.shape, torch.float32),
                                                    (k.shape, torch.float32)]
    assert blocks._candidate(torch.device("cuda"), torch.bfloat16) is blocks.CUDA_FLASH
    assert blocks._candidate(torch.device("cuda"), torch.float32) is blocks.MATMUL
