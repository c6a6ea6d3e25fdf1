"""Records from reasoning-gym (`data.dataset=reasoning_gym`): procedurally generated, verifiable tasks.

reasoning-gym (Apache-2.0, the optional extra `posttrain[reasoning_gym]`) generates entry i of a
data set seeded s from `random.Random(s + i)`, so consecutive seeds share entries. Training entries
use seed `data.seed` (streams s .. s + size - 1) and validation entries `data.seed + 10**7`, so the
two never share a generator stream (sizes are capped at 10**7); validation questions that still
occur in training or earlier in validation (small task configs repeat questions) are dropped here,
by the question, whatever template words it (so two wordings of a validation set hold the same
problems). A record
does not carry the entry itself (some entries do not survive a JSON round trip), only how to
regenerate it (`reasoning_gym` field), which the environment does before scoring with the task's
own scorer. A task's `prompt_template` may be a list (one drawn per entry, by the seed) and its
`unseen_prompt_template` more templates held out of training (`data.phrasings`).
"""

from __future__ import annotations

import difflib
import random
from typing import Optional

from posttrain.config.schema import DataConfig, split_seed
from posttrain.data.prompt_template import format_prompt
from posttrain.errors import UserError


def import_reasoning_gym():
    """The reasoning_gym module, or a UserError naming the extra that installs it."""
    try:
        import reasoning_gym
    except ImportError:
        raise UserError(
            "reasoning-gym tasks need the reasoning-gym package: pip install 'posttrain[reasoning_gym]' "
            "(or ./run.sh pip install reasoning-gym==0.1.25)"
        ) from None
    return reasoning_gym


def make_dataset(name: str, config: dict, seed: int, size: int, key: str = "data.reasoning_gym"):
    """`reasoning_gym.create_dataset(name, seed=, size=, **config)` with errors that name `key`."""
    rg = import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(name, list(DATASETS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UserError(f"{key}.name={name!r} is not a reasoning-gym task{hint}")
    try:
        return rg.create_dataset(name, seed=seed, size=size, **config)
    except (TypeError, ValueError, AssertionError) as e:
        raise UserError(f"{key}.config={config!r} is not a valid config of reasoning-gym task {name!r}: {e}") from None


_said: set[str] = set()


def _say_once(message: str) -> None:
    """Print a notice once per process (preflight and set-up both load the data)."""
    if message not in _said:
        _said.add(message)
        print(message, flush=True)


def load_reasoning_gym(data_cfg: DataConfig, split: str, env_name: Optional[str] = None) -> list[dict]:
    """Records of every task in `data.reasoning_gym`: `{"prompt", "answer", "task_name": <task>,
    "env_name": env_name or "reasoning_gym", "reasoning_gym": {task, config, seed, size, index},
    "source": <task>, "source_weight": <task weight>}`."""
    records = []
    for t, task in enumerate(data_cfg.reasoning_gym):
        key = f"data.reasoning_gym[{t}]"
        size = task.size if split == "train" else task.val_size
        if size == 0:
            continue
        seed = split_seed(data_cfg.seed, split)
        dataset = make_dataset(task.name, task.config, seed, size, key)
        exclude = set()
        if split == "validation":
            train = make_dataset(task.name, task.config, split_seed(data_cfg.seed, "train"), task.size, key)
            exclude = {train[i]["question"] for i in range(task.size)}
        dropped = 0
        templates = task.prompt_templates(data_cfg.phrasings)
        # Each entry's template has a stream of its own (the entries are reasoning-gym's either way).
        phrase = random.Random(f"{task.name}:{seed}:phrasing")
        for index in range(size):
            entry = dataset[index]
            template = phrase.choice(templates)
            if entry["question"] in exclude:
                dropped += 1
                continue
            if split == "validation":  # a repeat, even worded by another template, is the same problem
                exclude.add(entry["question"])
            fields = {"question": entry["question"], **{k: v for k, v in entry["metadata"].items() if isinstance(k, str)}}
            if template is not None:
                try:
                    prompt = template.format(**fields)
                except (KeyError, IndexError, ValueError) as e:
                    raise UserError(
                        f"{key}.prompt_template {template!r} failed on {task.name} entry {index}: "
                        f"{type(e).__name__}: {e} (fields: {sorted(fields)})"
                    ) from None
            else:
                prompt = entry["question"]
            prompt = format_prompt(data_cfg, {"prompt": prompt, "question": entry["question"]}, f"{key} ({task.name}) {split} entry {index}")
            answer = entry.get("answer")
            records.append({
                "prompt": prompt, "answer": None if answer is None else str(answer), "task_name": task.name,
                "env_name": env_name or "reasoning_gym",
                "reasoning_gym": {"task": task.name, "config": task.config, "seed": seed, "size": size, "index": index},
                "source": task.name, "source_weight": task.weight,
            })
        if dropped:
            _say_once(f"[posttrain] {key} ({task.name}): {dropped} of {size} validation questions also occur in "
                      "training or earlier in validation and were dropped"
                      + ("; none is left: widen the task's config" if dropped == size else ""))
    return records
