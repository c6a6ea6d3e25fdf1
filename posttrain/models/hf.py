"""Loading models and tokenizers by name: built-in tiny presets, local directories, hub ids.

`policy.model_name` accepts
- a built-in preset: `tiny`, `small`, `100m`, optionally with the arch, `tiny-qwen2`,
  `small-llama` (otherwise `policy.tiny_arch` decides). Built once into the cache by
  `posttrain.models.tiny.ensure_tiny_model`. Presets win over a directory of the same name
  in the working directory; write `./tiny` to mean the directory.
- a pretrained preset converted from a GGUF file that a package ships (`smollm2-135m-instruct`;
  `posttrain.models.gguf_import.ensure_pretrained`), converted once into the cache;
- a local Hugging Face directory (anything that exists, or starts with `/`, `.` or `~`);
- a hub id (`Qwen/Qwen2.5-1.5B`), passed through to transformers unchanged.
"""

from __future__ import annotations

import os
from typing import Optional
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from posttrain.utils.model_build import MODEL_BUILD_LOCK
from posttrain.models.presets import PRETRAINED_PRESETS
from posttrain.models.tiny import ARCHS, PRESETS, ensure_tiny_model

from posttrain.models.paths import HUB_ID as _HUB_ID


def parse_tiny_name(name: str, tiny_arch: str = "llama") -> tuple[str, str] | None:
    """`(preset, arch)` if `name` names a built-in tiny model (`tiny`, `tiny-qwen2`, ...), else None."""
    preset, _, arch = name.partition("-")
    if preset not in PRESETS:
        return None
    if not arch:
        return preset, tiny_arch
    return (preset, arch) if arch in ARCHS else None


def resolve_model_path(name_or_path: str | os.PathLike, tiny_arch: str = "llama") -> str:
    """Turn `policy.model_name` into something `from_pretrained` accepts.

    Args:
        name_or_path: preset name, local directory or hub id (see the module docstring).
        tiny_arch: arch of a preset given without one (`llama` default, or `qwen2`).

    Raises:
        FileNotFoundError: a path-like name that does not exist.
        NotADirectoryError: a local path that is a file.
    """
    name = os.fspath(name_or_path)
    tiny = parse_tiny_name(name, tiny_arch)
    if tiny is not None:
        return str(ensure_tiny_model(*tiny))
    if name in PRETRAINED_PRESETS:
        from posttrain.models.gguf_import import ensure_pretrained

        return str(ensure_pretrained(name))
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NotADirectoryError(f"model path {name!r} is a file; expected a Hugging Face model directory")
        return str(path.resolve())
    if _HUB_ID.match(name):
        return name  # left to transformers: downloads from the hub or finds it in the HF cache
    raise FileNotFoundError(
        f"model {name!r} is neither an existing local directory, a built-in preset "
        f"({', '.join(sorted(PRESETS))}, optionally -{'/-'.join(ARCHS)}; or {', '.join(sorted(PRETRAINED_PRESETS))}) nor a hub id like 'owner/name'"
    )


def _require_files(path: str, any_of: tuple[str, ...], what: str) -> None:
    """For a local directory, check that it holds at least one of `any_of` (hub ids are not checked)."""
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in any_of):
        from posttrain.utils.cache import cache_dir

        inside_cache = Path(path).resolve().is_relative_to(cache_dir().resolve())
        raise FileNotFoundError(
            f"{path!r} is not a Hugging Face {what} directory: none of {', '.join(any_of)} found in it"
            + ("; it is a broken cache entry: `posttrain doctor --fix` removes it and the next run rebuilds it"
               if inside_cache else "")
        )


def load_tokenizer(name_or_path: str | os.PathLike, tiny_arch: str = "llama") -> PreTrainedTokenizerBase:
    """Load a tokenizer; right padding, and the eos token doubles as pad token when there is none."""
    path = resolve_model_path(name_or_path, tiny_arch)
    _require_files(path, ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"), "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {name_or_path!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def load_causal_lm(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tiny_arch: str = "llama",
    attn_implementation: Optional[str] = None,
) -> PreTrainedModel:
    """Load a causal LM with `AutoModelForCausalLM` in `dtype` on `device` (training mode off),
    with the attention kernel `attn_implementation` (None: the model's default)."""
    path = resolve_model_path(name_or_path, tiny_arch)
    _require_files(path, ("config.json",), "model")
    options = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with MODEL_BUILD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **options)
    return model.to(device).eval()


_PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_dtype(precision: str, device: str | torch.device) -> torch.dtype:
    """Map `policy.precision` to a dtype.

    `auto` means bfloat16 on a CUDA device that supports it and float32 elsewhere (CPU bf16
    matmuls are slow and lossy, and tests compare against float32 references).
    """
    if precision == "auto":
        device = torch.device(device)
        if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if precision not in _PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of auto, {', '.join(_PRECISIONS)}")
    return _PRECISIONS[precision]
