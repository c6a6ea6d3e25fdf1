"""Load prompt/answer records for a split, whatever the source (`data.dataset`).

Every source ends up as a list of plain dicts with at least
`{"prompt": <templated prompt>, "answer": <ground truth>, "task_name": data.env_name}`,
plus the source's other fields (available to `data.prompt_template`). Processors
(`posttrain.data.processors`) turn these records into message logs.

Sources:
- `arithmetic`: synthetic problems from `posttrain.data.arithmetic` (seeded by `data.seed`).
- `jsonl`: `data.train_path` / `data.validation_path`, one JSON object per line. Rows in
  NeMo-Gym's shape (`responses_create_params.input` messages plus verifier fields) load as they
  are: their messages become the prompt, `expected_answer` the answer, and the verifier fields
  pick the task (see `nemo_gym_task`).
- `hf`: `datasets.load_dataset` on a hub name or a local `.json`/`.jsonl`/`.parquet` file or
  directory. A hub name may carry a config and a split: `openai/gsm8k:main@test`; the split
  defaults to `train` for training and `validation` for validation.
- `reasoning_gym`: procedurally generated tasks of the reasoning-gym package (`data.reasoning_gym`).
- `env`: episodes made by the environment `data.env_name` itself (games: one board or game seed
  per row; `data.num_train`, `data.num_validation`, `data.seed`).
- `generated`: rows of a seeded task generator (`data.generator`, `data.generator_options`;
  `posttrain.data.generators`) for a built-in environment: word problems, multiple choice, JSON
  output, instruction following, functions to write, calculator use. A single generated source's
  rows are task `<generator>`, scored by the generator's environment.
- `data.blend`: several of the above, each with its task name, environment and sampling weight.

Routing: a record's `task_name` names its task (metrics are per task) and `env_name` the
`env.<name>` section that scores it (by default the task name). Records of a blend or of several
reasoning-gym tasks carry `source` / `source_weight`, which the GRPO loader samples by.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence

from posttrain.config.schema import DataConfig
from posttrain.data.arithmetic import generate_arithmetic
from posttrain.data.images import MAX_PIXELS, has_images, image_row, image_rows, prompt_text
from posttrain.data.prompt_template import format_prompt
from posttrain.errors import DataError

Split = Literal["train", "validation"]
# Makes the rows of data.dataset=env: (data section, split) -> (rows, where each comes from).
EnvRows = Callable[[DataConfig, Split], tuple[list[dict], list[str]]]


def load_jsonl(path: str | os.PathLike, required_keys: Sequence[str] = ()) -> list[dict]:
    """Read a JSONL file (blank lines skipped) into a list of dicts.

    Args:
        path: the file.
        required_keys: keys every record must have; a record without one raises `DataError`
            naming the key, the file and the line.
    """
    return [record for _, record in read_jsonl_numbered(path, required_keys)]


def read_jsonl_numbered(path: str | os.PathLike, required_keys: Sequence[str] = ()) -> list[tuple[int, dict]]:
    """`(line number, record)` pairs of a JSONL file; see `load_jsonl`."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a directory, not a JSONL file")
    if not path.is_file():
        raise DataError(f"{path}: no such JSONL file")
    records = []
    with path.open(encoding="utf-8-sig") as f:  # a byte-order mark (editors on Windows write one) is skipped
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



def load_image_jsonl(path: str | os.PathLike, max_pixels: int = MAX_PIXELS) -> list[dict]:
    """The rows of a JSONL file of image rows, each by `image_row`; relative image paths start at
    the file's directory, errors name `file:line`."""
    numbered = read_jsonl_numbered(path)
    return image_rows([row for _, row in numbered], [f"{path}:{line}" for line, _ in numbered],
                      base_dir=Path(path).resolve().parent, max_pixels=max_pixels)

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
        numbered = read_jsonl_numbered(source)
        rows, locations = [row for _, row in numbered], [f"{source}:{line}" for line, _ in numbered]
    elif data_cfg.dataset == "hf":
        rows, where = _load_hf(source, split)
        locations = [f"{where} row {i}" for i in range(len(rows))]
    else:
        raise DataError(f"unknown data.dataset {data_cfg.dataset!r}")
    if split == "train" and not rows:
        raise DataError(f"{source}: the training data (data.train_path) has no records")
    return rows, locations


def nemo_gym_task(row: dict) -> Optional[str]:
    """The built-in task a NeMo-Gym row's verifier fields call for, or None (then data.env_name)."""
    verifier = row.get("verifier_metadata") if isinstance(row.get("verifier_metadata"), dict) else {}
    if "instruction_id_list" in verifier or "instruction_id_list" in row:
        return "instructions"
    if "unit_tests" in verifier:
        return "code"
    if "schema_str" in row:
        return "structured"
    if "options" in row:
        return "mcqa"
    if isinstance(row.get("metadata"), dict) and "source_dataset" in row["metadata"]:
        return "reasoning_gym"
    return None


def chat_messages(messages: Any, at: str) -> list[dict]:
    """`messages` checked as a non-empty list of `{role, content}` chat messages (a `developer`
    message becomes `system`); `at` names where they are from in the `DataError`."""
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ("system", "developer", "user", "assistant")
        for m in messages
    ):
        raise DataError(f"{at} must be a non-empty list of {{role, content}} messages")
    return [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]} for m in messages]


def _nemo_gym_fields(row: dict, at: str) -> dict:
    """`messages`, `prompt` (the last user message) and `answer` of a row in NeMo-Gym's shape."""
    params = row["responses_create_params"]
    messages = params.get("input") if isinstance(params, dict) else None
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    messages = chat_messages(messages, f"{at}: responses_create_params.input")
    users = [m["content"] for m in messages if m["role"] == "user"]
    fields = {"messages": messages, "prompt": users[-1] if users else messages[-1]["content"],
              "answer": row.get("expected_answer", row.get("answer"))}
    tools = params.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and (t.get("name") or isinstance(t.get("function"), dict)) for t in tools):
            raise DataError(f"{at}: responses_create_params.tools must be a list of function schemas with a 'name'")
        fields["tools"] = tools
    return fields


HTTP_ENV = "http"  # the environment that sends NeMo-Gym rows to their resources servers (http_env.py)

# Record keys that are not passed to environments as metadata (the prompt is in the message log).
# `origin` says where a record comes from (`file:line`, `name row i`), for error messages.
NOT_METADATA = ("prompt", "answer", "task_name", "env_name", "messages", "responses_create_params", "source",
                "source_weight", "stop_strings", "origin")


def env_metadata(record: dict) -> dict:
    """What an environment receives for a record: its fields (verifier data: tests, options, schema,
    instructions, ...) and `ground_truth` (the answer, or None)."""
    return {**{k: v for k, v in record.items() if k not in NOT_METADATA}, "ground_truth": record.get("answer")}


def _finish(rows: Sequence[dict], locations: Sequence[str], data_cfg: DataConfig, env: Optional[str] = None) -> list[dict]:
    """Map prompt/answer keys, apply `data.prompt_template`, add `task_name` and `env_name`.

    `locations[i]` says where row i comes from (`file:line`, `name row i`) for error messages. Rows
    without a task of their own get `data.env_name` and are scored by `env` (default: that name).
    """
    records = []
    for row, at in zip(rows, locations):
        fields = dict(row)
        if has_images(row):  # messages with image parts and the decoded images (posttrain.data.images)
            fields = image_row(row, at)
            fields["prompt"] = prompt_text(fields["messages"])
            row = fields
        if "responses_create_params" in row:
            fields.update(_nemo_gym_fields(row, at))
            prompt_key, answer_key = "prompt", "answer"
            # Rows go to their resources servers with data.env_name=http, else to the built-in
            # environment their verifier fields call for.
            default_task = data_cfg.env_name if data_cfg.env_name == HTTP_ENV else nemo_gym_task(row) or data_cfg.env_name
        else:
            prompt_key, answer_key = data_cfg.prompt_key, data_cfg.answer_key
            default_task = data_cfg.env_name
        task_name = row.get("task_name", default_task)  # a row may name its own task
        if not isinstance(task_name, str) or not task_name:
            raise DataError(f"{at}: task_name must be a non-empty string, got {task_name!r}")
        if prompt_key not in fields:
            raise DataError(f"{at}: missing key {prompt_key!r} (data.prompt_key); record has {sorted(row)}")
        if answer_key not in fields and task_name == "math":  # other environments read other fields
            raise DataError(f"{at}: missing key {answer_key!r} (data.answer_key); record has {sorted(row)}")
        answer = fields.get(answer_key)
        if answer is None and task_name == "math":  # caught here, not by the verifier mid-training
            raise DataError(f"{at}: {answer_key!r} (data.answer_key) is null; a math row needs its answer")
        prompt_value = fields[prompt_key]
        if isinstance(prompt_value, list) and "images" not in fields:  # chat messages (TRL's conversational format): the conversation
            fields["messages"] = chat_messages(prompt_value, f"{at}: {prompt_key}")
            users = [m["content"] for m in fields["messages"] if m["role"] == "user"]
            prompt_value = users[-1] if users else fields["messages"][-1]["content"]
        prompt = format_prompt(data_cfg, {**fields, "prompt": prompt_value}, at)
        # Numbers become strings: verifiers compare text, and JSON may hold 46 or "46".
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        env_name = row.get("env_name") or (env if env and "task_name" not in row else None) or task_name
        if env_name == HTTP_ENV and "responses_create_params" in row:
            fields["nemo_gym_row"] = row  # resources servers get the whole row, as NeMo-Gym sends it
        records.append({**fields, "prompt": prompt, "answer": answer, "task_name": task_name, "env_name": env_name,
                        "origin": at})
    return records


def load_records(data_cfg: DataConfig, split: Split, env_rows: Optional[EnvRows] = None) -> list[dict]:
    """Records of one split as `{"prompt", "answer", "task_name", "env_name", ...}` dicts.

    For `jsonl` and `hf` without `data.validation_path`, the validation split is empty. The
    validation split holds each problem once (`distinct_problems`), the training split every row.
    `env_rows(data_cfg, split) -> (rows, locations)` makes the rows of `data.dataset=env` (the
    environments' `make_rows`; `posttrain.environments.registry.env_rows_maker(cfg.env)`).
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    records = _load_split(data_cfg, split, env_rows)
    # Training repeats are the user's weighting; a repeated validation problem would only count twice.
    return distinct_problems(records) if split == "validation" else records


def _load_split(data_cfg: DataConfig, split: Split, env_rows: Optional[EnvRows]) -> list[dict]:
    if data_cfg.blend:
        return _load_blend(data_cfg, split, env_rows)
    if data_cfg.dataset == "env":
        return _finish(*_rows_from_env(env_rows, data_cfg, split), data_cfg)
    if data_cfg.dataset == "arithmetic":
        train, val = generate_arithmetic(
            data_cfg.num_train, data_cfg.num_validation, data_cfg.operations, data_cfg.num_digits, data_cfg.seed
        )
        rows = train if split == "train" else val
        return _finish(rows, [f"arithmetic {split} row {i}" for i in range(len(rows))], data_cfg)
    if data_cfg.dataset == "reasoning_gym":
        from posttrain.data.reasoning_gym import load_reasoning_gym

        return load_reasoning_gym(data_cfg, split)
    if data_cfg.dataset == "generated":
        rows, env = _generated_rows(data_cfg, split)
        # The rows are task <generator> (an import path: data.env_name), scored by its environment.
        task = data_cfg.env_name if env is None else data_cfg.generator
        return _finish(rows, [f"data.generator={data_cfg.generator} {split} row {i}" for i in range(len(rows))],
                       data_cfg.model_copy(update={"env_name": task, "prompt_key": "prompt", "answer_key": "answer"}),
                       env)
    return _finish(*read_source_rows(data_cfg, split), data_cfg)


def _generated_rows(data_cfg: DataConfig, split: Split, key: str = "data") -> tuple[list[dict], Optional[str]]:
    """(rows, the generator's environment or None) of `data.dataset=generated`."""
    # Imported here: only this source needs the generators.
    from posttrain.data.generators import generated_split

    return generated_split(data_cfg, split, key)


def problem_key(record: dict) -> str:
    """What makes two records the same problem: the task, the prompt as the model sees it (its chat
    messages and rendered prompt) and the ground truth: the answer, or for a record without one the
    fields its environment reads (a game's seed, a code task's tests, a preference pair's responses),
    since those then tell problems with one prompt apart."""
    truth = record.get("answer")
    if truth is None:
        truth = env_metadata(record)
    parts = [record.get("task_name"), record.get("env_name"), record.get("messages"), record.get("prompt"), truth]
    if record.get("images"):  # the pixels are part of the prompt: one question about two scenes is two problems
        import hashlib

        parts.append([hashlib.sha1(image.tobytes()).hexdigest() + str(image.size) for image in record["images"]])
    return json.dumps(parts, sort_keys=True, default=repr)


_said: set[str] = set()  # notices already printed: preflight and the job's set-up both load the data


def distinct_problems(records: list[dict], what: str = "problems") -> list[dict]:
    """The first record of each problem (`problem_key`), in their order; says once how many repeats
    were dropped. Validation scores each problem once (a repeat would weigh it double in
    `validation/accuracy_*`)."""
    seen: set[str] = set()
    kept = []
    for record in records:
        key = problem_key(record)
        if key not in seen:
            seen.add(key)
            kept.append(record)
    dropped = len(records) - len(kept)
    message = (f"[posttrain] validation: {dropped} repeated {what} dropped ({len(records)} rows, {len(kept)} distinct)")
    if dropped and message not in _said:
        _said.add(message)
        print(message, flush=True)
    return kept


def _rows_from_env(env_rows: Optional[EnvRows], data_cfg: DataConfig, split: Split) -> tuple[list[dict], list[str]]:
    if env_rows is None:
        raise DataError("data.dataset=env: this command has no environments to make rows (use it with grpo / eval)")
    return env_rows(data_cfg, split)


def _load_blend(data_cfg: DataConfig, split: Split, env_rows: Optional[EnvRows] = None) -> list[dict]:
    """The records of every `data.blend` component, each tagged with its `source` and sampling weight
    (a reasoning-gym component shares its weight among its tasks by their own weights)."""
    from posttrain.config.schema import blend_component

    records = []
    for i in range(len(data_cfg.blend)):
        name, weight, env, sub = blend_component(data_cfg, i)
        if sub.dataset == "arithmetic":
            rows = generate_arithmetic(sub.num_train, sub.num_validation, sub.operations, sub.num_digits, sub.seed)
            rows = rows[0] if split == "train" else rows[1]
            part = _finish(rows, [f"data.blend[{i}] ({name}) {split} row {j}" for j in range(len(rows))], sub, env)
        elif sub.dataset == "reasoning_gym":
            from posttrain.data.reasoning_gym import load_reasoning_gym

            # rows route to env.reasoning_gym unless the component names another environment
            part = load_reasoning_gym(sub, split, env_name=env if "env" in data_cfg.blend[i] else None)
        elif sub.dataset == "generated":  # scored by the generator's environment unless the component names one
            rows, generator_env = _generated_rows(sub, split, f"data.blend[{i}]")
            env = env if "env" in data_cfg.blend[i] else generator_env or env
            part = _finish(rows, [f"data.blend[{i}] ({name}) {split} row {j}" for j in range(len(rows))],
                           sub.model_copy(update={"prompt_key": "prompt", "answer_key": "answer"}), env)
        elif sub.dataset == "env":  # rows made by the component's environment (a game)
            rows, _ = _rows_from_env(env_rows, sub.model_copy(update={"env_name": env}), split)
            part = _finish(rows, [f"data.blend[{i}] ({name}) {split} row {j}" for j in range(len(rows))], sub, env)
        else:
            if split == "validation" and sub.validation_path is None:
                continue
            part = _finish(*read_source_rows(sub, split), sub, env)
        total = sum(r.get("source_weight", 1.0) for r in {r.get("source"): r for r in part}.values()) or 1.0
        for record in part:
            inner = record.get("source")
            record["source"] = f"{name}/{inner}" if inner else name
            record["source_weight"] = weight * record.get("source_weight", 1.0) / total
        records += part
    return records
