"""`policy.precision: auto` on CPUs, bfloat16 layers that multiply in float32 where bfloat16 GEMMs
are slow, and the one seed key that reseeds a run."""

from __future__ import annotations

import pytest
import torch

from posttrain.config.loader import load_config
from posttrain.job import precision_line
from posttrain.models import hf
from posttrain import cpu_precision
from posttrain.cpu_precision import bfloat16_matmul_support, compute_linears_in_float32, matmul_dtype

AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX512_ONLY = frozenset({"avx2", "avx512f", "avx512bw"})
AVX2_ONLY = frozenset({"avx", "avx2", "fma"})


@pytest.mark.parametrize("flags, environ, fast, says", [
    (AMX, {}, True, "AMX_BF16, AVX512_BF16"),
    (frozenset({"avx512f", "avx512_bf16"}), {}, True, "AVX512_BF16"),
    (AVX512_ONLY, {}, False, "no bfloat16 matmul instructions"),
    (AVX2_ONLY, {}, False, "no bfloat16 matmul instructions"),
    (frozenset(), {}, False, "no bfloat16 matmul instructions"),  # not Linux x86 (ARM, macOS)
    (AMX, {"ATEN_CPU_CAPABILITY": "avx2"}, False, "ATEN_CPU_CAPABILITY=avx2"),
    (AMX, {"ATEN_CPU_CAPABILITY": "avx512"}, True, "AMX_BF16"),
    (AMX, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, False, "ONEDNN_MAX_CPU_ISA=AVX2"),
    (AMX, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, False, "ONEDNN_MAX_CPU_ISA=AVX512_CORE"),
    (AMX, {"DNNL_MAX_CPU_ISA": "avx512_core_amx"}, True, "AMX_BF16"),
])
def test_bfloat16_matmul_support_reads_the_flags_and_the_kernel_limits(flags, environ, fast, says):
    got, why = bfloat16_matmul_support(flags, environ)
    assert got is fast
    assert says in why


def test_auto_precision_follows_the_cpu(monkeypatch):
    monkeypatch.delenv(cpu_precision.AUTO_CPU_PRECISION_VAR, raising=False)  # the suite's conftest sets it
    for fast, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(cpu_precision, "bfloat16_matmul_support", lambda *a, fast=fast: (fast, "because"))
        assert hf.pick_dtype("auto", "cpu") == want
        assert hf.pick_dtype("float32", "cpu") == torch.float32  # an explicit choice stays
        cfg = load_config("grpo", None, ["policy.precision=auto"])
        from posttrain.config.schema import training_precision

        assert training_precision(cfg) == str(want).removeprefix("torch.")
        line = precision_line(cfg)
        assert line == f"[posttrain] policy.precision=auto: {str(want).removeprefix('torch.')}, since because"


def test_explicit_bfloat16_on_a_slow_cpu_says_what_it_does(monkeypatch):
    monkeypatch.setattr(cpu_precision, "bfloat16_matmul_support", lambda *a: (False, "no instructions"))
    line = precision_line(load_config("grpo", None, ["policy.precision=bfloat16"]))
    assert line.startswith("[posttrain] policy.precision=bfloat16: no instructions, so linear layers multiply in float32")
    assert precision_line(load_config("grpo", None, ["policy.precision=float32"])) is None
    monkeypatch.setattr(cpu_precision, "bfloat16_matmul_support", lambda *a: (True, "fast"))
    assert precision_line(load_config("grpo", None, ["policy.precision=bfloat16"])) is None


def test_float32_linears_round_like_bfloat16_and_backpropagate_in_float32():
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8, bias=False)).to(torch.bfloat16)
    patched = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8, bias=False)).to(torch.bfloat16)
    patched.load_state_dict(plain.state_dict())
    assert compute_linears_in_float32(patched) == 2
    assert compute_linears_in_float32(patched) == 0  # once only
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    out = patched(x)
    assert out.dtype == torch.bfloat16
    # What it computes: each layer in float32 from bfloat16 inputs, rounded to bfloat16.
    w0, b0, w1 = (p.detach().float() for p in (plain[0].weight, plain[0].bias, plain[1].weight))
    hidden = (x.float() @ w0.T + b0).bfloat16()
    assert torch.equal(out, (hidden.float() @ w1.T).bfloat16())
    out.float().sum().backward()
    assert patched[0].weight.grad.dtype == torch.bfloat16
    # The same gradients as float32 matmuls of the rounded tensors.
    expected = torch.ones(5, 8) @ w1  # d sum / d hidden
    assert torch.allclose(patched[0].bias.grad.float(), expected.sum(0), atol=1e-2, rtol=1e-2)


def test_float32_linears_under_autocast_return_the_autocast_dtype():
    layer = torch.nn.Linear(8, 4)  # float32 master weights, as the trainer keeps them
    compute_linears_in_float32(layer)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.nn.functional.linear(x, layer.weight, layer.bias).bfloat16())
    assert layer(x).dtype == torch.float32  # no autocast, float32 weights: untouched
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_the_variable_fixes_what_auto_means(monkeypatch):
    monkeypatch.setattr(cpu_precision, "bfloat16_matmul_support", lambda *a: (True, "fast"))
    monkeypatch.setenv(cpu_precision.AUTO_CPU_PRECISION_VAR, "float32")
    assert hf.pick_dtype("auto", "cpu") == torch.float32
    assert precision_line(load_config("grpo", None, ["policy.precision=auto"])) == (
        "[posttrain] policy.precision=auto: float32, since POSTTRAIN_AUTO_CPU_PRECISION=float32")
    monkeypatch.setenv(cpu_precision.AUTO_CPU_PRECISION_VAR, "bfloat16")
    assert hf.pick_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setenv(cpu_precision.AUTO_CPU_PRECISION_VAR, "fp16")  # not a choice: the CPU decides
    assert hf.pick_dtype("auto", "cpu") == torch.bfloat16


def test_matmul_dtype(monkeypatch):
    monkeypatch.setattr(cpu_precision, "cpu_bfloat16_is_fast", lambda: False)
    assert matmul_dtype(torch.bfloat16, "cpu") == torch.float32
    assert matmul_dtype(torch.float32, "cpu") == torch.float32
    monkeypatch.setattr(cpu_precision, "cpu_bfloat16_is_fast", lambda: True)
    assert matmul_dtype(torch.bfloat16, "cpu") == torch.bfloat16


def test_one_seed_key_reseeds_every_section_and_keeps_the_problems():
    base = load_config("grpo")
    cfg = load_config("grpo", None, ["seed=7"])
    assert cfg.grpo.seed == 7 and cfg.sft_warmup.sft.seed == 7 and cfg.sft_warmup.seed == 7
    assert cfg.data.seed == base.data.seed and cfg.sft_warmup.data.seed == base.sft_warmup.data.seed
    assert base.seed is None and base.grpo.seed == 42  # unset: each section's own seed
    distill = load_config("distill", None, ["seed=3"])
    assert distill.distillation.seed == 3
    assert load_config("dpo", None, ["seed=5"]).dpo.seed == 5
    assert load_config("sft", None, ["seed=5"]).sft.seed == 5
