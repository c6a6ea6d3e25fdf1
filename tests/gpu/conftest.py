"""The GPU smoke suite: skipped where CUDA is absent (every test here needs GPUs).

Run on a machine with 2 GPUs:  ./run.sh pytest tests/gpu
"""

from __future__ import annotations

import pytest


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip each test of this directory that wants more GPUs than this machine has (its
    `gpus` marker; 1 when absent), with the reason in one line."""
    available = cuda_devices()
    for item in items:
        if "/tests/gpu/" not in str(item.path).replace("\\", "/"):
            continue
        marker = item.get_closest_marker("gpus")
        needed = marker.args[0] if marker else 1
        if available < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s), found {available}"))
