"""Facts about a model name that need neither torch nor the weights: is it a hub id, a training
checkpoint, which `step_N` is the latest, how large is its vocabulary. Kept apart from `hf.py`
(which imports transformers) so that `posttrain.preflight` answers in milliseconds."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

# A hub id is `name` or `owner/name` made of letters, digits, `-`, `_`, `.`.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def parse_tiny_name(name: str, tiny_arch: str = "llama") -> tuple[str, str] | None:
    """`(preset, arch)` if `name` names a built-in tiny model (`tiny`, `tiny-qwen2`, `small-pairs`,
    `small-llama-pairs`, ...; without an arch, `tiny_arch`), else None. The tokenizer suffix is
    `tiny_tokenizer_kind`'s."""
    from posttrain.models.presets import ARCHS, PRESETS, TINY_TOKENIZERS

    preset, *rest = name.split("-")
    if preset not in PRESETS:
        return None
    if rest and rest[-1] in TINY_TOKENIZERS[1:]:
        rest.pop()
    if not rest:
        return preset, tiny_arch
    return (preset, rest[0]) if len(rest) == 1 and rest[0] in ARCHS else None


def tiny_tokenizer_kind(name: str) -> str:
    """The tokenizer of a built-in tiny model name: `pairs` for a name ending in `-pairs`, else `char`."""
    from posttrain.models.presets import TINY_TOKENIZERS

    suffix = name.rsplit("-", 1)[-1]
    return suffix if "-" in name and suffix in TINY_TOKENIZERS[1:] else "char"


def model_vocab_size(name: str, tiny_arch: str = "llama") -> Optional[int]:
    """The vocabulary size (width of the logits) of `name` from its `config.json`, without loading
    weights: a preset's, a local directory's or checkpoint's, or a hub id's cached config; None
    when it cannot be known yet (a hub id not in the cache)."""
    if parse_tiny_name(name) is not None:
        from posttrain.models.tiny import build_tiny_tokenizer

        return len(build_tiny_tokenizer(tiny_tokenizer_kind(name)))
    config = model_config_dict(name)
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") if config else None
    return int(size) if size else None


def model_split_sizes(name: str) -> Optional[dict[str, Optional[int]]]:
    """The sizes tensor parallelism divides (`parallel_sizes.TP_SPLIT_KEYS`) of `name`, from its
    preset or its `config.json` (see `model_vocab_size`); None when they cannot be known yet."""
    from posttrain.models.parallel_sizes import TP_SPLIT_KEYS
    from posttrain.models.presets import PRESETS, VL_PRESETS

    tiny = parse_tiny_name(name)
    if tiny is not None:
        config: Optional[dict] = PRESETS[tiny[0]]
    elif name in VL_PRESETS:  # TP splits a vision-language model's language model only
        config = VL_PRESETS[name]["text"]
    else:
        config = model_config_dict(name)
        if config is not None:
            config = config.get("text_config") or config
    return None if config is None else {key: config.get(key) for key in TP_SPLIT_KEYS}


def model_config_dict(name: str) -> Optional[dict]:
    """The `config.json` of a local directory or checkpoint, a pretrained preset's converted copy
    in the cache (`gemma3-270m`; preflight converts it first), or a hub id's cached one (None when
    there is none to read)."""
    import json

    from posttrain.models.presets import PRETRAINED_PRESETS

    path = Path(name).expanduser()
    candidates: list[Path] = []
    if name in PRETRAINED_PRESETS:  # as `hf.resolve_model_path` takes it: the preset before a directory
        from posttrain.utils.cache import cache_dir

        candidates.append(cache_dir() / "models" / name / "config.json")
    elif path.is_dir():
        candidates.append(path / "config.json")
        checkpoint = checkpoint_policy_dir(path)
        if checkpoint is not None:
            candidates += sorted(checkpoint.rglob("config.json"))
    else:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
        if isinstance(cached, str):
            candidates.append(Path(cached))
    for candidate in candidates:
        if candidate.is_file():
            return json.loads(candidate.read_text())
    return None


def vocabulary_problem(student: tuple[str, str, Optional[int]], teacher: tuple[str, str, Optional[int]]) -> Optional[str]:
    """One line when the student's and the teacher's vocabulary sizes, `(key, name, size)`, differ."""
    (s_key, s_name, s_size), (t_key, t_name, t_size) = student, teacher
    if s_size is None or t_size is None or s_size == t_size:
        return None
    return (f"{t_key}={t_name!r} has a vocabulary of {t_size} tokens but {s_key}={s_name!r} has {s_size}: "
            "distillation compares the two models token by token, so they need the same vocabulary "
            "with distillation.tokenizer_alignment=never (auto, the default, aligns them by text: docs/algorithms.md)")


def checkpoint_policy_dir(path: Path) -> Optional[Path]:
    """The policy checkpoint inside a `step_N` directory (or the policy directory itself), else None."""
    for candidate in (path / "policy", path):
        if (candidate / "model" / ".metadata").is_file():
            return candidate
    return None


def converted_checkpoint_dir(checkpoint_dir: str | os.PathLike) -> Path:
    """Where `converted_checkpoint` keeps the Hugging Face copy of a policy checkpoint (converted or
    not yet): keyed by its resolved path and modification time, so a re-saved step converts again."""
    import hashlib

    from posttrain.utils.cache import cache_dir

    path = Path(checkpoint_dir).resolve()
    weights = path / "model"
    stamp = f"{path}:{weights.stat().st_mtime_ns if weights.exists() else path.stat().st_mtime_ns}"
    return cache_dir() / "checkpoint_hf" / hashlib.sha1(stamp.encode()).hexdigest()[:16]


def latest_step_dir(run_dir: Path) -> Optional[Path]:
    """The `step_N` subdirectory with the largest N, if `run_dir` is a checkpoint directory."""
    steps = [(int(p.name[5:]), p) for p in run_dir.glob("step_*") if p.name[5:].isdigit() and p.is_dir()]
    return max(steps)[1] if steps else None
