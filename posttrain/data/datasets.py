"""Load prompt/answer records for a split, whatever the source (`data.dataset`).

Every source ends up as a list of plain dicts with at least
`{"prompt": <templated prompt>, "answer": <ground truth>, "task_name": data.env_name}`,
plus the source's other fields (available to `data.prompt_template`). Processors
(`posttrain.data.processors`) turn these records into message logs.

Sources:
- `arithmetic`: synthetic problems from `posttrain.data.arithmetic` (seeded by `data.seed`).
- `jsonl`: `data.train_path` / `data.validation_path`, one JSON object per line.
- `hf`: `datasets.load_dataset` on a hub name or a local `.json`/`.jsonl`/`.parquet` file or
  directory. A hub name may carry a config and a split: `openai/gsm8k:main@test`; the split
  defaults to `train` for training and `validation` for validation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal, Sequence

from posttrain.config.schema import DataConfig
from posttrain.data.arithmetic import generate_arithmetic
from posttrain.errors import UserError

Split = Literal["train", "validation"]


class DataError(UserError):
    """Bad data: the message names the file (or data set) and the line or row."""


def load_jsonl(path: str | os.PathLike, required_keys: Sequence[str] = ()) -> list[dict]:
    """Read a JSONL file (blank lines skipped) into a list of dicts.

    Args:
        path: the file.
        required_keys: keys every record must have; a record without one raises `DataError`
            naming the key, the file and the line.
    """
    return [record for _, record in _read_jsonl(path, required_keys)]


def _read_jsonl(path: str | os.PathLike, required_keys: Sequence[str] = ()) -> list[tuple[int, dict]]:
    """`(line number, record)` pairs of a JSONL file; see `load_jsonl`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such JSONL file")
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))  # a kept newline would shift the error's column
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            for key in required_keys:
                if key not in record:
                    raise DataError(f"{path}:{lineno}: missing key {key!r} (record has {sorted(record)})")
            records.append((lineno, record))
    return records


def _load_hf(spec: str, split: Split) -> tuple[list[dict], str]:
    """Rows of a Hugging Face data set (`name[:config][@split]` or a local file/dir) as dicts."""
    # Imported here: `datasets` takes seconds to import and only this source needs it.
    import datasets

    path = Path(spec).expanduser()
    if path.is_file():
        builders = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
        if path.suffix not in builders:
            raise DataError(f"{spec}: data.dataset=hf reads local .json, .jsonl or .parquet files")
        dataset = datasets.load_dataset(builders[path.suffix], data_files=str(path), split="train")
        return [dict(row) for row in dataset], spec
    name, _, split_name = spec.partition("@")
    name, _, config_name = name.partition(":")
    split_name = split_name or split
    try:
        dataset = datasets.load_dataset(str(path) if path.is_dir() else name, config_name or None, split=split_name)
    except (ValueError, FileNotFoundError) as e:
        raise DataError(f"data set {spec!r} (split {split_name!r}) could not be loaded: {e}") from e
    return [dict(row) for row in dataset], f"{spec} ({split_name})"


def read_source_rows(data_cfg: DataConfig, split: Split) -> tuple[list[dict], list[str]]:
    """The raw rows of a `jsonl` or `hf` split and where each comes from (`file:line`, `name row i`).

    `data.train_path` is required; without `data.validation_path` the validation split is empty.
    Shared by the prompt/answer records here and the preference pairs (`posttrain.data.preference`).
    """
    source = data_cfg.train_path if split == "train" else data_cfg.validation_path
    if source is None:
        if split == "train":
            raise DataError(f"data.train_path is required when data.dataset={data_cfg.dataset!r}")
        return [], []
    if data_cfg.dataset == "jsonl":
        numbered = _read_jsonl(source)
        rows, locations = [row for _, row in numbered], [f"{source}:{line}" for line, _ in numbered]
    elif data_cfg.dataset == "hf":
        rows, where = _load_hf(source, split)
        locations = [f"{where} row {i}" for i in range(len(rows))]
    else:
        raise DataError(f"unknown data.dataset {data_cfg.dataset!r}")
    if split == "train" and not rows:
        raise DataError(f"{source}: the training data (data.train_path) has no records")
    return rows, locations


def format_prompt(data_cfg: DataConfig, fields: dict, at: str) -> str:
    """`data.prompt_template` filled with `fields`; a failure is a `DataError` naming `at` (where the row is from)."""
    try:
        return data_cfg.prompt_template.format(**fields)
    except (KeyError, IndexError, ValueError) as e:
        raise DataError(
            f"{at}: data.prompt_template {data_cfg.prompt_template!r} failed: {type(e).__name__}: {e} "
            f"(fields available: {sorted(fields)})"
        ) from None


def _finish(rows: Sequence[dict], locations: Sequence[str], data_cfg: DataConfig) -> list[dict]:
    """Map prompt/answer keys, apply `data.prompt_template`, add `task_name`.

    `locations[i]` says where row i comes from (`file:line`, `name row i`) for error messages.
    """
    records = []
    for row, at in zip(rows, locations):
        for key, option in ((data_cfg.prompt_key, "prompt_key"), (data_cfg.answer_key, "answer_key")):
            if key not in row:
                raise DataError(f"{at}: missing key {key!r} (data.{option}); record has {sorted(row)}")
        answer = row[data_cfg.answer_key]
        prompt = format_prompt(data_cfg, {**row, "prompt": row[data_cfg.prompt_key]}, at)
        # Numbers become strings: verifiers compare text, and JSON may hold 46 or "46".
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        task_name = row.get("task_name", data_cfg.env_name)  # a row may name its own environment
        if not isinstance(task_name, str) or not task_name:
            raise DataError(f"{at}: task_name must be a non-empty string, got {task_name!r}")
        records.append({**row, "prompt": prompt, "answer": answer, "task_name": task_name})
    return records


def load_records(data_cfg: DataConfig, split: Split) -> list[dict]:
    """Records of one split as `{"prompt", "answer", "task_name", ...}` dicts.

    For `jsonl` and `hf` without `data.validation_path`, the validation split is empty.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    if data_cfg.dataset == "arithmetic":
        train, val = generate_arithmetic(
            data_cfg.num_train, data_cfg.num_validation, data_cfg.operations, data_cfg.num_digits, data_cfg.seed
        )
        rows = train if split == "train" else val
        return _finish(rows, [f"arithmetic {split} row {i}" for i in range(len(rows))], data_cfg)
    return _finish(*read_source_rows(data_cfg, split), data_cfg)

