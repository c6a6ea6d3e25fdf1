"""How many compiled matmul kernels oneDNN keeps: `ONEDNN_PRIMITIVE_CACHE_CAPACITY`.

Under bfloat16 autocast on CPU, torch runs matmuls through oneDNN, which compiles a kernel (a
"primitive") for each shape it meets and caches it, 1024 of them by default. RL steps meet new
shapes all the time (dynamic batching and generation give every micro-batch and prefill its own
token count), and each cached primitive holds onto working memory: 0.4-0.6 MiB for a 640-wide
layer, a few MiB for a 262,144-token vocabulary's head. So the resident set grew step after step
until the cache was full: Gemma 3 270M in bfloat16 from 8.0 to 11.0 GiB over its first 20-30 steps
(0.05-0.1 GiB a step), while float32, which runs MKL's sgemm and no oneDNN cache, stayed flat.
64 primitives hold a whole forward and backward pass (about 15 matmul shapes per token count) for
a few token counts. Compiling again has a cost, largest where matmuls are smallest: tiny-gemma3's
step took 1.00 s against 0.91 with the cache of 1024 (a shared machine, so rough), and 2.30 s with
no cache at all (`benchmarks/host_memory.py`). The bound does not stop all growth: AMX's kernels
keep some memory per shape outside the cache (gone with oneDNN held below AMX).

oneDNN reads the variable when it makes its first primitive, so `posttrain/__init__.py` sets it on
import (it works after `import torch` too, before the first bfloat16 matmul); a value of the user's
own wins, and Ray workers get the same (`distributed/ray_utils.py`).

Imported by `posttrain/__init__.py`: it must stay free of posttrain imports and of torch.
"""

ONEDNN_DEFAULTS = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
