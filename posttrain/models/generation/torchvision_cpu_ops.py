"""Lets torchvision's Python code import on the CPU build of torch, in vLLM's CPU environment.

vLLM imports torchvision for every vision-language model (its LLaVA module imports Pixtral's,
which imports transformers' Pixtral image processor, which imports `torchvision.transforms.v2`).
The only torchvision wheels on the package index are built for CUDA torch: their compiled
extension needs `libtorch_cuda.so` and does not load on `torch==2.13.0+cpu`. torchvision then
still imports its pure-Python parts (transforms, which run on torch), except that its import
registers fake kernels for two operators of that extension, `torchvision::nms` and `qnms`, without
checking that they exist, and fails (`operator torchvision::nms does not exist`).

This module declares those two operators' schemas (the ones torchvision's extension defines) just
before torchvision is first imported, so the import completes. Calling them still fails ("no
kernel"), as any compiled torchvision op would: nothing vLLM runs for the supported models uses
them. Copied into the environment's site-packages with a `.pth` line importing it
(`vllm_env.CPU_SITE_FILES`); it must not import torch itself, so that every other interpreter
start in that environment (pip, vLLM's subprocesses) stays as fast as without it.
"""

from __future__ import annotations

import importlib.abc
import sys

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY = None  # the torch.library.Library holding the declarations (kept alive here)


def declare_missing_ops() -> list[str]:
    """Declare each of `SCHEMAS` torch does not know yet; returns the names declared."""
    global _LIBRARY
    import torch

    missing = [schema for schema in SCHEMAS if not _has_op(torch, schema.split("(", 1)[0])]
    if missing:
        _LIBRARY = _LIBRARY or torch.library.Library("torchvision", "FRAGMENT")
        for schema in missing:
            _LIBRARY.define(schema)
    return [schema.split("(", 1)[0] for schema in missing]


def _has_op(torch, name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
        return True
    except (AttributeError, RuntimeError):
        return False


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs `declare_missing_ops` once, when `torchvision` is first imported, then steps aside."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            declare_missing_ops()
        return None  # the normal finders import torchvision itself


def install() -> None:
    if not any(isinstance(finder, _BeforeTorchvision) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
