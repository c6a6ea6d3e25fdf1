"""The GPU smoke suite (tests/gpu) is collected everywhere and skipped cleanly without CUDA."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _without_pytest_addopts() -> dict[str, str]:
    """The environment less the outer run's PYTEST_ADDOPTS (`-v`, `--durations`), which would
    change the inner run's summary lines."""
    return {key: value for key, value in os.environ.items() if key != "PYTEST_ADDOPTS"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the suite runs instead")
def test_gpu_suite_is_collected_and_skipped_without_cuda():
    result = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider",
                             "-n", "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**_without_pytest_addopts(), "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    skipped = re.search(r"\b(\d+) skipped", summary)
    assert skipped and "error" not in summary and "passed" not in summary, result.stdout
    # Every GPU test is skipped with its reason; the 2-GPU ones are the 4 engine x placement cases.
    reasons = re.findall(r"SKIPPED \[(\d+)\] tests/gpu/test_gpu_smoke.py:\d+: needs (\d) CUDA GPU\(s\), found 0", result.stdout)
    assert sum(int(count) for count, _ in reasons) == int(skipped.group(1)) >= 5, result.stdout
    assert sum(int(count) for count, gpus in reasons if gpus == "2") == 4, result.stdout
