"""The task-generator registry and what every generator shares: drawing distinct rows, seeded, and
their wording.

A generator is a function `(num_train, num_validation, seed, **options) -> (train rows, validation
rows)` registered with `@register_task_generator(name, env=...)`; `env` is the built-in environment
whose fields its rows carry (the one that scores them unless the config routes them elsewhere).
A built-in generator also takes `phrasings` (`data.phrasings`): each part of its prompts (the
question's wording, the instruction saying how to answer) comes from several templates
(`Phrasings`), some of them held out of training, so a model can be validated on problems in
wordings it never trained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Hashable, NamedTuple, Optional, Sequence, Union

from posttrain.utils.registry import registrar

TaskGenerator = Callable[..., tuple[list[dict], list[dict]]]
TASK_GENERATORS: dict[str, TaskGenerator] = {}
GENERATOR_ENVS: dict[str, str] = {}  # generator name -> the environment its rows are made for

_register = registrar(TASK_GENERATORS, "task generator")
# Generators of rows with images (`posttrain.data.generators.visual`): kept apart, for a
# vision-language policy only (preflight refuses them with a text model in one line).
VISUAL_TASK_GENERATORS: dict[str, TaskGenerator] = {}
VISUAL_GENERATOR_ENVS: dict[str, str] = {}
_register_visual = registrar(VISUAL_TASK_GENERATORS, "visual task generator")


class OptionError(ValueError):
    """A generator option with a value the generator refuses; the message starts with `option=value`."""


def register_task_generator(name: str, env: str, visual: bool = False) -> Callable[[TaskGenerator], TaskGenerator]:
    """`@register_task_generator("word_problems", env="math")` on a generator function;
    `visual=True` (default False) for one whose rows carry images (`VISUAL_TASK_GENERATORS`)."""

    def decorator(fn: TaskGenerator) -> TaskGenerator:
        (_register_visual if visual else _register)(name)(fn)
        (VISUAL_GENERATOR_ENVS if visual else GENERATOR_ENVS)[name] = env
        return fn

    return decorator


PHRASINGS = ("all", "seen", "unseen")


class Reply(NamedTuple):
    """An answer instruction and a reply that follows it (`{answer}`: the row's answer; `{code}`:
    a function's solution), which the generator's environment scores as correct
    (tests/unit/test_phrasings.py checks each)."""

    text: str
    reply: str


Template = Union[str, Reply]


@dataclass(frozen=True)
class Phrasings:
    """The templates of one part of a prompt: `seen` ones, drawn for training (and validation)
    with `phrasings: seen`, and `unseen` ones, held out of training for validation on wordings the
    model never saw (`phrasings: unseen`); `phrasings: all` draws from both. Every list holds at
    least five seen templates and two unseen ones."""

    seen: tuple[Template, ...]
    unseen: tuple[Template, ...]

    def pool(self, mode: str) -> tuple[Template, ...]:
        return self.seen if mode == "seen" else self.unseen if mode == "unseen" else self.seen + self.unseen


class Phraser:
    """Draws a prompt's wording: `phrase(phrasings)` is one of the templates that `mode` (`all`,
    `seen`, `unseen`) allows. It has a random stream of its own, apart from the one that draws
    the problems, so a seed's problems are the same whatever wording they are given."""

    def __init__(self, rng: random.Random, mode: str):
        self.rng, self.mode = rng, mode

    def __call__(self, phrasings: Phrasings) -> Template:
        return self.rng.choice(phrasings.pool(self.mode))


def check_phrasings(mode: str) -> str:
    """`mode` when it is one of `PHRASINGS`, else OptionError."""
    if mode not in PHRASINGS:
        raise OptionError(f"phrasings={mode!r}: choose one of {list(PHRASINGS)}")
    return mode


def distinct_rows(
    num_train: int, num_validation: int, seed: int,
    make_row: Callable[[random.Random, Phraser], tuple[Hashable, dict]], name: str, phrasings: str = "all",
) -> tuple[list[dict], list[dict]]:
    """`num_train` training and `num_validation` validation rows, all distinct problems.

    `make_row(rng, phrase)` draws one row's problem (numbers, names, ...) from `rng` and its
    wording from `phrase` (a `Phraser` of mode `phrasings`), and returns `(problem, row)`: the
    problem is what tells rows apart whatever their wording (hashable). A row whose problem was
    already drawn is drawn again, so no problem is in both splits even in two wordings, and since
    the wording has a stream of its own, `phrasings: seen` and `phrasings: unseen` give the same
    problems, in the same order, in different wordings. Validation rows are drawn first, so the
    validation set does not change with `num_train`. The streams are seeded by `(name, seed)`:
    two generators given one seed do not draw in lockstep. Raises ValueError when the options
    allow fewer distinct problems than asked for.
    """
    if num_train < 0 or num_validation < 0:
        raise ValueError(f"need num_train, num_validation >= 0; got {num_train}, {num_validation}")
    check_phrasings(phrasings)
    rng = random.Random(f"{name}:{seed}")
    phrase = Phraser(random.Random(f"{name}:{seed}:phrasing"), phrasings)
    wanted = num_train + num_validation
    rows: list[dict] = []
    seen: set[Any] = set()
    misses = 0
    while len(rows) < wanted:
        problem, row = make_row(rng, phrase)
        if problem in seen:
            misses += 1
            if misses > max(1000, 2 * len(seen)):  # this many duplicates in a row: the space is (nearly) used up
                raise ValueError(
                    f"asked for {num_train} train + {num_validation} validation distinct tasks, but {name} makes "
                    f"only about {len(seen)} with these options; ask for fewer (num_train, num_validation) or "
                    "widen the options"
                )
            continue
        misses = 0
        seen.add(problem)
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



def with_instruction(text: str, phrase: Phraser, instructions: Phrasings, fixed: Optional[str], sep: str = " ") -> str:
    """`text` followed by its answer instruction: `fixed` (a generator's `instruction` option; ""
    for none) when given, else one drawn from `instructions`."""
    instruction = fixed if fixed is not None else phrase(instructions).text
    return f"{text}{sep}{instruction}" if instruction else text
