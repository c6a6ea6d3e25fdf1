"""The task-generator registry and what every generator shares: drawing distinct rows, seeded.

A generator is a function `(num_train, num_validation, seed, **options) -> (train rows, validation
rows)` registered with `@register_task_generator(name, env=...)`; `env` is the built-in environment
whose fields its rows carry (the one that scores them unless the config routes them elsewhere).
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

from posttrain.utils.registry import registrar

TaskGenerator = Callable[..., tuple[list[dict], list[dict]]]
TASK_GENERATORS: dict[str, TaskGenerator] = {}
GENERATOR_ENVS: dict[str, str] = {}  # generator name -> the environment its rows are made for

_register = registrar(TASK_GENERATORS, "task generator")


class OptionError(ValueError):
    """A generator option with a value the generator refuses; the message starts with `option=value`."""


def register_task_generator(name: str, env: str) -> Callable[[TaskGenerator], TaskGenerator]:
    """`@register_task_generator("word_problems", env="math")` on a generator function."""

    def decorator(fn: TaskGenerator) -> TaskGenerator:
        _register(name)(fn)
        GENERATOR_ENVS[name] = env
        return fn

    return decorator


def distinct_rows(
    num_train: int, num_validation: int, seed: int, make_row: Callable[[random.Random], dict], name: str,
) -> tuple[list[dict], list[dict]]:
    """`num_train` training and `num_validation` validation rows, all with distinct prompts.

    `make_row(rng)` draws one row; rows whose prompt was already drawn are drawn again. Validation
    rows are drawn first, so the validation set does not change with `num_train`. The stream is
    seeded by `(name, seed)`: two generators given one seed do not draw in lockstep. Raises
    ValueError when the options allow fewer distinct prompts than asked for.
    """
    if num_train < 0 or num_validation < 0:
        raise ValueError(f"need num_train, num_validation >= 0; got {num_train}, {num_validation}")
    rng = random.Random(f"{name}:{seed}")
    wanted = num_train + num_validation
    rows: list[dict] = []
    seen: set[str] = set()
    misses = 0
    while len(rows) < wanted:
        row = make_row(rng)
        if row["prompt"] in seen:
            misses += 1
            if misses > max(1000, 2 * len(seen)):  # this many duplicates in a row: the space is (nearly) used up
                raise ValueError(
                    f"asked for {num_train} train + {num_validation} validation distinct tasks, but {name} makes "
                    f"only about {len(seen)} with these options; ask for fewer (num_train, num_validation) or "
                    "widen the options"
                )
            continue
        misses = 0
        seen.add(row["prompt"])
        rows.append(row)
    return rows[num_validation:], rows[:num_validation]


def check_choices(chosen: Sequence[str], allowed: Sequence[str], option: str) -> list[str]:
    """`chosen` (one name or a list; duplicates dropped, order kept) when non-empty and all in
    `allowed`, else OptionError."""
    chosen = [chosen] if isinstance(chosen, str) else list(chosen)
    unknown = [c for c in chosen if c not in allowed]
    if unknown or not chosen:
        raise OptionError(f"{option}={chosen!r}: choose one or more of {list(allowed)}")
    return list(dict.fromkeys(chosen))


def check_range(value: int, low: int, high: int, option: str) -> int:
    """`value` when it is an int in `[low, high]`, else OptionError naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OptionError(f"{option}={value!r}: must be an integer from {low} to {high}")
    return value

