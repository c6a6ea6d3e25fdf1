"""What the time plan knows of a device: published peak compute, memory bandwidth and link
bandwidths of each GPU type (`GPU_SPECS`, vendor datasheets), and this machine's CPU, measured
(`cpu_spec`). `device_spec(cfg)` picks the one a config runs on (`cluster.gpu_type`).

Peaks are dense (no 2:4 sparsity) tensor-core rates per GPU; link bandwidths are per GPU and per
direction (datasheets quote NVLink both ways: 900 GB/s is 450 GB/s each way). Sources:

- H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/): BF16
  1,979 TFLOPS with sparsity (989 dense), FP32 67 TFLOPS, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s;
  DGX H100: 8 GPUs per NVLink domain, one 400 Gb/s ConnectX-7 (50 GB/s) per GPU.
- H200 SXM: NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200/): the H100's compute, 141 GB
  HBM3e at 4.8 TB/s, NVLink 900 GB/s; DGX H200's 400 Gb/s per GPU.
- B200: NVIDIA DGX B200 datasheet (nvidia.com/en-us/data-center/dgx-b200/): 72 PFLOPS FP8 training
  for 8 GPUs (9 per GPU with sparsity, so BF16 2.25 PFLOPS dense), 1,440 GB HBM3e (180 GB per GPU),
  64 TB/s (8 TB/s per GPU), NVLink 5 1.8 TB/s per GPU, 8x 400 Gb/s ConnectX-7.
- GB200 (NVL72): NVIDIA GB200 NVL72 datasheet (nvidia.com/en-us/data-center/gb200-nvl72/): 360
  PFLOPS FP16/BF16 with sparsity for 72 GPUs (2.5 PFLOPS dense per GPU), 13.4 TB HBM3e (186 GB per
  GPU) at 576 TB/s (8 TB/s), NVLink 5 1.8 TB/s per GPU across all 72 GPUs; 800 Gb/s ConnectX-8 per GPU.
- A100 SXM4 80GB: NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100/): BF16 312 TFLOPS
  dense, FP32 19.5, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s; DGX A100: 200 Gb/s HDR per GPU.
- L40S: NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s/): BF16 362 TFLOPS dense (733
  with sparsity), FP32 91.6, 48 GB GDDR6 at 864 GB/s, no NVLink: PCIe Gen4 x16 (32 GB/s each way);
  200 Gb/s networking assumed (OVX servers' typical ConnectX-7 per 2 GPUs).
- CPU: measured here (`cpu_spec`): the rate of a 1024 x 1024 float32 and bfloat16 matmul on every
  core torch uses (bfloat16 at float32's rate on a CPU without bfloat16 matmul instructions, where
  posttrain multiplies bfloat16 layers in float32), and the bandwidth of a 256 MiB copy (read + write). Peaks from cores x FMA width
  x clock overstate what torch reaches on a 2-core machine, so the measured rate is the peak.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

from posttrain.cpu_precision import cpu_bfloat16_is_fast

TB = 1e12
GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """Peaks of one device (a GPU, or this machine's CPU)."""

    name: str
    bf16_flops: float  # dense tensor-core BF16/FP16 FLOP/s
    fp32_flops: float  # FP32 FLOP/s (what a float32 policy's matmuls run at; torch leaves TF32 off)
    memory_gb: float  # device memory, GB (10^9)
    memory_bw: float  # bytes/s of device memory
    nvlink_bw: float  # bytes/s per GPU, each way, inside an NVLink domain (0: none)
    network_bw: float  # bytes/s per GPU, each way, between nodes (or NVLink domains)
    nvlink_domain: int = 8  # GPUs one NVLink domain joins (an HGX board: 8; GB200 NVL72: 72)
    nvlink_spans_nodes: bool = False  # the domain joins several nodes (GB200 NVL72's 18 trays of 4 GPUs)

    def flops(self, dtype_bytes: int) -> float:
        """Peak FLOP/s of matmuls in a dtype of `dtype_bytes` bytes (4: float32, else bfloat16/float16)."""
        return self.fp32_flops if dtype_bytes >= 4 else self.bf16_flops


GPU_SPECS = {
    "H100": DeviceSpec("H100", 989 * TB, 67 * TB, 80, 3.35 * TB, 450 * GB, 50 * GB),
    "H200": DeviceSpec("H200", 989 * TB, 67 * TB, 141, 4.8 * TB, 450 * GB, 50 * GB),
    "B200": DeviceSpec("B200", 2250 * TB, 75 * TB, 180, 8.0 * TB, 900 * GB, 50 * GB),
    "GB200": DeviceSpec("GB200", 2500 * TB, 80 * TB, 186, 8.0 * TB, 900 * GB, 100 * GB, nvlink_domain=72,
                        nvlink_spans_nodes=True),
    "A100": DeviceSpec("A100", 312 * TB, 19.5 * TB, 80, 2.039 * TB, 300 * GB, 25 * GB),
    "L40S": DeviceSpec("L40S", 362 * TB, 91.6 * TB, 48, 0.864 * TB, 0.0, 25 * GB, nvlink_domain=1),
}
# What `cluster.gpu_type=auto` plans for when the controller sees no GPU it can name.
DEFAULT_GPU = "H100"
# Between CPU worker processes of one node: shared memory, about a memcpy (measured bandwidth);
# between CPU nodes: 25 Gb/s Ethernet, a common cloud VM's.
CPU_NETWORK_BW = 25 / 8 * GB


def gpu_type_of(cfg: Any) -> str:
    """The GPU type `cfg` plans for: `cluster.gpu_type`, or with `auto` the name of torch.cuda's
    first device when it is in `GPU_SPECS` (e.g. "NVIDIA H100 80GB HBM3" -> H100), else `DEFAULT_GPU`."""
    chosen = cfg.cluster.gpu_type
    if chosen != "auto":
        return chosen
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0).upper()
            # Longest names first: "GB200" before "B200".
            for gpu in sorted(GPU_SPECS, key=len, reverse=True):
                if gpu in name:
                    return gpu
    except Exception:  # noqa: BLE001 (no driver: plan for the default)
        pass
    return DEFAULT_GPU


def device_spec(cfg: Any) -> DeviceSpec:
    """The spec of one device of `cfg`'s cluster: its GPU type's, or this CPU's, measured."""
    if cfg.cluster.gpus_per_node > 0:
        return GPU_SPECS[gpu_type_of(cfg)]
    return cpu_spec()


@functools.lru_cache(maxsize=1)
def cpu_spec() -> DeviceSpec:
    """This machine's CPU: matmul rates and memory bandwidth measured in about 0.3 s (best of a few
    repeats, so a busy moment counts less). CPU workers of one node exchange through shared memory
    (the measured bandwidth); nodes over `CPU_NETWORK_BW`."""
    import psutil
    import torch

    def rate(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.mm(a, b)  # warm up (threads, kernels)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        return 2 * n**3 / best

    src = torch.ones(64 * 2**20)  # 256 MiB of float32
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    bandwidth = 2 * src.numel() * 4 / best  # a copy reads and writes every byte
    fp32 = rate(torch.float32)
    # Without bfloat16 matmul instructions posttrain multiplies bfloat16 linears in float32
    # (cpu_precision.float32_matmuls_where_bfloat16_is_slow): PyTorch's bfloat16 GEMM there is
    # scalar code, 45x slower, and no run of ours goes through it.
    bf16 = rate(torch.bfloat16) if cpu_bfloat16_is_fast() else fp32
    return DeviceSpec("CPU (measured)", bf16, fp32, psutil.virtual_memory().total / GB,
                      bandwidth, bandwidth, CPU_NETWORK_BW, nvlink_domain=1 << 30)
