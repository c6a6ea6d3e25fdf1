"""Loading models and tokenizers by name: built-in tiny presets, local directories, hub ids.

`policy.model_name` accepts
- a built-in preset: `tiny`, `small`, `100m`, `1b`, optionally with the arch, `tiny-qwen2`,
  `small-llama` (otherwise `policy.tiny_arch` decides). Built once into the cache by
  `posttrain.models.tiny.ensure_tiny_model`. Presets win over a directory of the same name
  in the working directory; write `./tiny` to mean the directory.
- a vision-language preset: `tiny-vl` (`posttrain.models.vision.ensure_tiny_vlm`), built once
  into the cache; load it with `load_vision_model` / `load_processor` (below), as any vision-language model;
- a pretrained preset converted from a GGUF file that a package ships (`smollm2-135m-instruct`;
  `posttrain.models.gguf_import.ensure_pretrained`), converted once into the cache;
- a local Hugging Face directory (anything that exists, or starts with `/`, `.` or `~`);
- a hub id (`Qwen/Qwen2.5-1.5B`), passed through to transformers unchanged.

`policy.rope_scaling` (e.g. YaRN) is merged into the model config's RoPE parameters when a model
is built (`apply_rope_scaling`): by the policy workers and the generation engines alike.
"""

from __future__ import annotations

import os
from typing import Any, Optional
from pathlib import Path

import torch
from transformers import (
    AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, PreTrainedModel,
    PreTrainedTokenizerBase,
)

from posttrain.data.image_prompts import processor_from
from posttrain.cpu_precision import auto_cpu_precision
from posttrain.errors import UserError
from posttrain.utils.model_build import MODEL_BUILD_LOCK
from posttrain.models.presets import PRETRAINED_PRESETS, VL_PRESETS
from posttrain.models.tiny import ARCHS, PRESETS, ensure_tiny_model

from posttrain.models.paths import HUB_ID as _HUB_ID
from posttrain.models.paths import parse_tiny_name, tiny_tokenizer_kind


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
        return str(ensure_tiny_model(*tiny, tokenizer=tiny_tokenizer_kind(name)))
    if name in VL_PRESETS:
        from posttrain.models.vision import ensure_tiny_vlm

        return str(ensure_tiny_vlm(name))
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
        f"({', '.join(sorted(PRESETS))}, optionally -{'/-'.join(ARCHS)}; or {', '.join(sorted(PRETRAINED_PRESETS | VL_PRESETS))}) nor a hub id like 'owner/name'"
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
    """Load a tokenizer; right padding, and the eos token doubles as pad token when there is none.
    A vision-language preset's tokenizer is built in code, as its cached directory's was: loading it
    never builds the model (whose vision tower is pretrained at build, tens of seconds), so the
    preflight's checks answer before that."""
    if os.fspath(name_or_path) in VL_PRESETS:
        from posttrain.models.vision import build_vl_processor

        tokenizer = build_vl_processor(os.fspath(name_or_path)).tokenizer
    else:
        path = resolve_model_path(name_or_path, tiny_arch)
        _require_files(path, ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"), "tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {name_or_path!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def apply_rope_scaling(config: Any, rope_scaling: Optional[dict[str, Any]]) -> Any:
    """`config` with `policy.rope_scaling` merged over its RoPE parameters (its `rope_theta` and
    other keys kept), validated by transformers; returned as is when `rope_scaling` is empty.

    YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
    arXiv:2309.00071): `{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings":
    32768}`; transformers' other types (`linear`, `dynamic`, `llama3`, `longrope`) work the same
    way. A `ValueError` names `policy.rope_scaling` and the problem (a missing key, a model
    without RoPE or with per-attention-type RoPE parameters)."""
    if not rope_scaling:
        return config
    current = getattr(config, "rope_parameters", None)
    if not isinstance(current, dict) or not current:
        raise ValueError(f"policy.rope_scaling: the {config.model_type} model has no RoPE parameters to scale")
    nested = config.nested_rope_parameter_keys(current)
    if nested:
        raise ValueError(f"policy.rope_scaling: the {config.model_type} model has RoPE parameters per attention type "
                         f"({', '.join(nested)}); set its rope_parameters in its config.json instead")
    config.rope_parameters = {**current, **rope_scaling}
    try:
        config.validate_rope()
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"policy.rope_scaling={rope_scaling}: {e.args[0] if e.args else e}") from None
    return config


def rope_config_overrides(path: str, rope_scaling: dict[str, Any]) -> dict[str, Any]:
    """The HF config keys that carry `rope_scaling` for the model at `path`, for an engine that
    takes config overrides (vLLM's `hf_overrides`): `rope_parameters` merged as `apply_rope_scaling`
    merges it (transformers 5), or `rope_scaling` beside the config's own `rope_theta` (transformers
    4, whose configs keep the two apart)."""
    current = getattr(AutoConfig.from_pretrained(path), "rope_parameters", None)
    if isinstance(current, dict):
        return {"rope_parameters": {**current, **rope_scaling}}
    return {"rope_scaling": dict(rope_scaling)}


def load_causal_lm(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tiny_arch: str = "llama",
    attn_implementation: Optional[str] = None,
    rope_scaling: Optional[dict[str, Any]] = None,
) -> PreTrainedModel:
    """Load a causal LM with `AutoModelForCausalLM` in `dtype` on `device` (training mode off),
    with the attention kernel `attn_implementation` (None: the model's default) and the RoPE
    scaling `rope_scaling` (`policy.rope_scaling`; None: the model's own, see `apply_rope_scaling`)."""
    path = resolve_model_path(name_or_path, tiny_arch)
    _require_files(path, ("config.json",), "model")
    options: dict[str, Any] = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if rope_scaling:
        options["config"] = apply_rope_scaling(AutoConfig.from_pretrained(path), rope_scaling)
    model = _from_pretrained(AutoModelForCausalLM, path, dtype, options, lambda kind: (
        f"model {os.fspath(name_or_path)!r} ({kind}) is not a causal language model (AutoModelForCausalLM has no "
        "class for it); vision-language models load with load_vision_model (load_policy_lm picks either)"))
    return model.to(device).eval()


def load_policy_lm(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", tiny_arch: str = "llama", **options: Any) -> PreTrainedModel:
    """The model a policy trains and generates with: a vision-language model (`tiny-vl`, or a
    config with a vision tower; `load_vision_model`) or else a causal LM (`load_causal_lm`, which
    takes `options`: `attn_implementation`, `rope_scaling`)."""
    from posttrain.models.vision_inputs import is_vision_language_model

    if is_vision_language_model(os.fspath(name_or_path), tiny_arch):
        if options.get("rope_scaling"):
            raise UserError("policy.rope_scaling is not supported for vision-language models")
        return load_vision_model(name_or_path, dtype=dtype, device=device,
                                 attn_implementation=options.get("attn_implementation"))
    return load_causal_lm(name_or_path, dtype=dtype, device=device, tiny_arch=tiny_arch, **options)


def _from_pretrained(auto_class: Any, path: str, dtype: torch.dtype, options: dict[str, Any], not_this_kind) -> PreTrainedModel:
    """`auto_class.from_pretrained` under the build lock; a config the class has no model for is a
    one-line UserError, `not_this_kind(config class name)`, instead of transformers' list of every class."""
    try:
        with MODEL_BUILD_LOCK:
            return auto_class.from_pretrained(path, dtype=dtype, **options)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        raise UserError(not_this_kind(type(AutoConfig.from_pretrained(path)).__name__)) from None


def load_vision_model(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: Optional[str] = None,
) -> PreTrainedModel:
    """Load a vision-language model with `AutoModelForImageTextToText` in `dtype` on `device`
    (training mode off), with the attention kernel `attn_implementation` (None: the model's
    default). `name_or_path`: `tiny-vl`, a local directory or a hub id (`posttrain.models.hf.
    resolve_model_path`). A model transformers has no image-text-to-text class for is a UserError."""
    path = resolve_model_path(name_or_path)
    _require_files(path, ("config.json",), "model")
    options: dict[str, Any] = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = _from_pretrained(AutoModelForImageTextToText, path, dtype, options, lambda kind: (
        f"model {os.fspath(name_or_path)!r} is not a vision-language model transformers knows "
        "(AutoModelForImageTextToText has no class for its config)"))
    return model.to(device).eval()


def load_processor(name_or_path: str | os.PathLike) -> Any:
    """Load a vision-language model's processor (image processor and tokenizer) with `AutoProcessor`:
    `tiny-vl`, a local directory or a hub id. Its tokenizer pads on the right, with the eos token
    as pad token when it has none (as `hf.load_tokenizer`). A processor that needs a package this
    environment lacks (Qwen2-VL's needs torchvision) is a one-line UserError naming it."""
    path = resolve_model_path(name_or_path)
    _require_files(path, ("preprocessor_config.json", "processor_config.json"), "processor")
    return processor_from(path, name_or_path)



_PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_dtype(precision: str, device: str | torch.device) -> torch.dtype:
    """Map `policy.precision` to a dtype.

    `auto` means bfloat16 on a CUDA device that supports it, bfloat16 on a CPU with bfloat16
    matmul instructions (AVX512-BF16 or AMX: `cpu_precision.py`), float32 elsewhere (there
    PyTorch's bfloat16 GEMM is scalar code, ~45x slower than float32).
    """
    if precision == "auto":
        device = torch.device(device)
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
        return _PRECISIONS[auto_cpu_precision()[0]]
    if precision not in _PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of auto, {', '.join(_PRECISIONS)}")
    return _PRECISIONS[precision]
