"""Whether this CPU multiplies bfloat16 matrices fast, and what `precision: auto` means on it.

PyTorch hands a bfloat16 matmul to oneDNN only where oneDNN has bfloat16 kernels; elsewhere it
falls back to its own scalar GEMM. On a 2-core AVX2 CPU (and on AVX-512 under
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`) a SmolLM2-sized MLP's forward and backward
took 4.16 s in bfloat16 against 0.093 s in float32 (45x), 92% of it in the backward's matmuls
(`benchmarks/bfloat16_matmul.py`). With bfloat16 matmul instructions (AVX512-BF16, AMX) the same
step is faster in bfloat16 than in float32. So `auto` is bfloat16 only where the CPU has them, and
an explicit `bfloat16` on a CPU without them runs its linear layers' matmuls in float32
(`compute_linears_in_float32`): bfloat16 tensors, float32 speed.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config and the plan ask for `auto` without importing torch
    import torch

# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) from which on it has native bfloat16 matmuls.
_ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512",
                     "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL", "DEFAULT")
_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux x86); empty elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def bfloat16_matmul_support(flags: frozenset[str] | None = None, environ: dict | None = None) -> tuple[bool, str]:
    """(fast, why): whether bfloat16 matmuls run on bfloat16 instructions here, and a short reason.

    Honours the variables that narrow the kernels PyTorch and oneDNN pick (`ATEN_CPU_CAPABILITY`,
    `ONEDNN_MAX_CPU_ISA`, also DNNL_MAX_CPU_ISA), so an AVX-512 machine emulating an AVX2 one
    answers as the AVX2 one would. ARM CPUs answer no until bfloat16 there is measured."""
    flags = cpu_flags() if flags is None else flags
    environ = os.environ if environ is None else environ
    have = [f for f in _BF16_CPU_FLAGS if f in flags]
    if not have:
        machine = platform.machine() or "this CPU"
        return False, f"this CPU ({machine}) has no bfloat16 matmul instructions (AVX512-BF16 or AMX)"
    aten = environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if aten and not aten.startswith("avx512"):
        return False, f"ATEN_CPU_CAPABILITY={aten} limits PyTorch's kernels below AVX-512"
    isa = environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA") or ""
    if isa and isa.upper() not in _ONEDNN_BF16_ISAS:
        return False, f"ONEDNN_MAX_CPU_ISA={isa} hides this CPU's bfloat16 matmul instructions"
    return True, f"this CPU has bfloat16 matmul instructions ({', '.join(have).upper()})"


@functools.lru_cache(maxsize=1)
def cpu_bfloat16_is_fast() -> bool:
    """`bfloat16_matmul_support()` for this process (its environment does not change)."""
    return bfloat16_matmul_support()[0]


# Fixes what `auto` means on a CPU (float32 or bfloat16) for every config of a process and its
# workers, whatever the CPU has: e.g. a test suite whose tolerances are float32's.
AUTO_CPU_PRECISION_VAR = "POSTTRAIN_AUTO_CPU_PRECISION"


def auto_cpu_precision() -> tuple[str, str]:
    """What `precision: auto` trains in on this CPU, and why (one clause for the start-up line)."""
    forced = os.environ.get(AUTO_CPU_PRECISION_VAR)
    if forced in ("float32", "bfloat16"):
        return forced, f"{AUTO_CPU_PRECISION_VAR}={forced}"
    fast, why = bfloat16_matmul_support()
    return ("bfloat16" if fast else "float32"), why


def _linear_in_float32(module: "torch.nn.Linear", x: "torch.Tensor") -> "torch.Tensor":
    import torch

    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else torch.promote_types(x.dtype, module.weight.dtype)
    if dtype != torch.bfloat16:
        return torch.nn.functional.linear(x, module.weight, module.bias)
    # Autograd records the casts, so the backward's matmuls run in float32 as well; the output is
    # rounded to bfloat16 as a bfloat16 matmul's would be.
    bias = None if module.bias is None else module.bias.float()
    with torch.autocast(device_type, enabled=False):
        return torch.nn.functional.linear(x.float(), module.weight.float(), bias).to(dtype)


def compute_linears_in_float32(model: "torch.nn.Module") -> int:
    """Make every `nn.Linear` of `model` multiply in float32 when its input or weight is bfloat16
    (the output keeps the input's dtype). For CPUs without bfloat16 matmul instructions, where
    PyTorch's bfloat16 GEMM is scalar code. Returns how many layers it changed."""
    import torch

    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not getattr(module, "_posttrain_float32_matmul", False):
            module.forward = functools.partial(_linear_in_float32, module)
            module._posttrain_float32_matmul = True
            count += 1
    return count


def float32_matmuls_where_bfloat16_is_slow(model: "torch.nn.Module", dtype: "torch.dtype",
                                           device: "torch.device | str") -> int:
    """`compute_linears_in_float32(model)` when `model` computes in bfloat16 on a CPU without
    bfloat16 matmul instructions (else nothing); returns how many layers it changed."""
    if matmul_dtype(dtype, device) == dtype:
        return 0
    return compute_linears_in_float32(model)


def matmul_dtype(dtype: "torch.dtype", device: "torch.device | str") -> "torch.dtype":
    """The dtype to multiply `dtype` matrices in on `device`: float32 for bfloat16 on a CPU
    without bfloat16 matmul instructions, else `dtype` (for code that calls matmul itself)."""
    import torch

    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not cpu_bfloat16_is_fast():
        return torch.float32
    return dtype
