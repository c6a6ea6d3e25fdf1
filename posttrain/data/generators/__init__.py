"""Seeded task generators: prompt rows for the built-in environments that ship with the project.

`data.dataset: generated`, `data.generator: <name>`, `data.generator_options: {...}` (with
`data.num_train`, `data.num_validation`, `data.seed`) makes rows in the shape the generator's
environment reads, with disjoint train and validation splits (distinct problems), the same for the
same seed. Built in (docs/environments.md, "Generated tasks"):

| generator | environment | rows |
|---|---|---|
| `word_problems` | `math` | small-number word problems; `answer` |
| `multiple_choice` | `mcqa` | 2-5 options; `options`, the letter as `answer` |
| `json_output` | `structured` | a short JSON object to write; `schema_str`, the JSON as `answer` |
| `instructions` | `instructions` | IFEval-style constraints; `instruction_id_list`, `kwargs`, a compliant `answer` |
| `functions` | `code` | one-line Python functions; `fn_name`, `tests`, the solution as `answer` |
| `calculator` | `tools` | arithmetic for the calculator tool; `expression`, `answer` |

Visual tasks (`visual.py`: count the shapes, a shape's colour, which shape is left of another, read
a number or a word; rows with an image) are registered apart, in `VISUAL_TASK_GENERATORS`: they
need a vision-language policy (preflight refuses them with a text model in one line).

A generator is a function `(num_train, num_validation, seed, **options) -> (train rows, validation
rows)`; one that also takes `phrasings` gets `data.phrasings` (`all`, `seen`, `unseen`: the built-in
generators word their prompts from several templates each, some held out of training, so a model
can be validated on problems in wordings it never saw; `base.Phrasings`). A user's is named by
import path (`data.generator: "my_tasks.py:make_rows"`); a built-in one is decorated with
`@register_task_generator(name, env=...)`, imported below, and its name added to `TASK_GENERATORS`
of `posttrain.config.schema.data` (which validates `data.generator` without importing this package).
"""

from __future__ import annotations

import copy
import difflib
import inspect
from typing import Any, Literal, Optional

# Importing the built-in generators registers them.
from posttrain.data.generators import (  # noqa: F401
    calculator, functions, instructions, json_output, multiple_choice, visual, word_problems,
)
from posttrain.data.generators.base import (
    GENERATOR_ENVS, TASK_GENERATORS, VISUAL_GENERATOR_ENVS, VISUAL_TASK_GENERATORS, OptionError, TaskGenerator,
    distinct_rows, register_task_generator,
)
from posttrain.errors import DataError
from posttrain.utils.registry import ImportPathError, resolve

__all__ = ["GENERATOR_ENVS", "TASK_GENERATORS", "VISUAL_GENERATOR_ENVS", "VISUAL_TASK_GENERATORS", "generated_split", "get_task_generator", "distinct_rows",
           "register_task_generator"]


# The splits of the last few calls: (generator, sizes, seed, options) -> (train rows, validation rows).
_RECENT: dict[tuple, tuple[list[dict], list[dict]]] = {}


def get_task_generator(name: str) -> TaskGenerator:
    """The generator registered as `name`, or the function at an import path (`module:function`);
    a KeyError suggests the closest registered name."""
    return resolve({**TASK_GENERATORS, **VISUAL_TASK_GENERATORS}, name, "task generator")


def _check_options(fn: TaskGenerator, options: dict[str, Any], key: str) -> None:
    """A `DataError` naming `<key>.generator_options.<option>` for an option `fn` does not take."""
    if "phrasings" in options:
        raise DataError(f"{key}.generator_options.phrasings: set {key}.phrasings instead (all, seen or unseen)")
    parameters = list(inspect.signature(fn).parameters.values())
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        return
    names = [p.name for p in parameters[3:] if p.name != "phrasings"]
    for option in options:
        if option not in names:
            close = difflib.get_close_matches(option, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise DataError(f"{key}.generator_options.{option}: {hint}the generator "
                            f"{getattr(fn, '__name__', fn)!r} takes {names or 'no options'}")


def _takes_phrasings(fn: TaskGenerator) -> bool:
    """Whether `fn` takes `phrasings` (`all`, `seen`, `unseen`: `data.phrasings`), as the built-in generators do."""
    return "phrasings" in inspect.signature(fn).parameters


def generated_split(data_cfg: Any, split: Literal["train", "validation"], key: str = "data") -> tuple[list[dict], Optional[str]]:
    """(rows of one split, the generator's environment or None) of `data.dataset=generated`.

    `data_cfg` is a `DataConfig` (or a blend component's); `key` names it in errors (`data`,
    `data.blend[2]`): an unknown generator or option, or a value a generator refuses, is a `DataError`.
    """
    name = data_cfg.generator
    try:
        fn = get_task_generator(name)
    except (KeyError, ImportPathError) as e:
        raise DataError(f"{key}.generator: {e.args[0]}") from None
    options = dict(data_cfg.generator_options)
    _check_options(fn, options, key)
    if _takes_phrasings(fn):
        options["phrasings"] = data_cfg.phrasings
    elif data_cfg.phrasings != "all":
        raise DataError(f"{key}.phrasings={data_cfg.phrasings!r}: the generator {name!r} has no held-out phrasings (it "
                        f"takes no 'phrasings' argument); set {key}.phrasings=all")
    cache_key = (name, data_cfg.num_train, data_cfg.num_validation, data_cfg.seed, repr(sorted(options.items())))
    if cache_key not in _RECENT:  # both splits come from one call; the loader asks for each in turn
        try:
            splits = fn(data_cfg.num_train, data_cfg.num_validation, data_cfg.seed, **options)
        except OptionError as e:
            raise DataError(f"{key}.generator_options.{e}") from None
        except ValueError as e:
            raise DataError(f"{key}.generator={name!r}: {e}") from None
        _RECENT[cache_key] = splits
        while len(_RECENT) > 16:
            _RECENT.pop(next(iter(_RECENT)))
    rows = copy.deepcopy(_RECENT[cache_key][0 if split == "train" else 1])
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or "prompt" not in row:
            raise DataError(f"{key}.generator={name!r}: {split} row {i} is not a dict with a 'prompt' ({row!r:.80})")
    return rows, GENERATOR_ENVS.get(name, VISUAL_GENERATOR_ENVS.get(name))
