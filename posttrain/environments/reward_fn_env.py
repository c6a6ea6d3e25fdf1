"""Reward functions as an environment: TRL's `reward_funcs`, without writing an `Environment`.

A reward function has TRL's signature

    def reward(prompts, completions, **columns) -> list[float]

`prompts` are the rows' prompts as the data gave them (a string, or chat messages), `completions`
the model's answers (a string each; for chat-message prompts `[{"role": "assistant", "content":
...}]`, as TRL), and every other column of the rows comes as a keyword argument holding one value
per completion (the `data.answer_key` column as `answer`, as text). A function that takes no
`**kwargs` gets only the columns it names. It may be `async`; several functions are summed, each
times its weight. A value of None means "does not apply" and adds nothing (TRL's convention).
Each function's raw rewards are also the reward's named components (`component_names`: the
function's name without its module), which GDPO (`grpo.adv_estimator.name=gdpo`) normalises one by
one before weighting them (TRL's `multi_objective_aggregation="normalize_then_sum"`).

Config (`env.<name>`, the section serving task `<name>`):

    env:
      rewards:
        reward_fn: [my_rewards:accuracy, path/to/file.py:brevity]   # or one string
        weights: [1.0, 0.1]                                            # default: 1 each

Functions are loaded in the controller (`posttrain.utils.registry.import_object`, or the
in-process registry the Python API fills, `register_reward_fn`) and sent to the environment's
worker with it: a thread of the controller (`cluster.backend: local`), where any function works,
or a Ray actor, which needs functions cloudpickle can send (`pickling_problem`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from typing import Any, Callable, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from posttrain.environments.interface import Environment, EnvironmentReturn, last_assistant_text
from posttrain.errors import UserError

# The metadata key under which a reward-function environment receives each row's prompt as the
# data gave it (environments get a row's fields but not its prompt; see `environments.row_fields.add_env_fields`).
PROMPT_KEY = "_prompt"

RewardFn = Callable[..., Any]

# Functions the Python API registered by name, for this process (lambdas and functions of
# `__main__` cannot be imported by name; the name is what the saved config.yaml shows).
_REGISTERED: dict[str, RewardFn] = {}
_REGISTERED_LOCK = threading.Lock()


class RewardFunctionError(UserError):
    """A reward function that cannot be called as one, or returned something other than rewards."""


def reward_fn_name(fn: RewardFn) -> str:
    """`module:qualname` of `fn`, the name a config uses for it."""
    return f"{getattr(fn, '__module__', None) or '__main__'}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def register_reward_fn(fn: RewardFn) -> str:
    """Make `fn` loadable by name in this process and return the name (`reward_fn_name`, with
    `#2`, `#3`, ... when another function already has it: two lambdas of one module)."""
    if not callable(fn):
        raise RewardFunctionError(f"reward function {fn!r} is not callable")
    base = reward_fn_name(fn)
    with _REGISTERED_LOCK:
        name, n = base, 1
        while name in _REGISTERED and _REGISTERED[name] is not fn:
            n += 1
            name = f"{base}#{n}"
        _REGISTERED[name] = fn
    return name


def load_reward_fn(name: str) -> RewardFn:
    """The function `name` names: one `register_reward_fn` registered, else `module:function` or
    `path/to/file.py:function` (`import_object`). Raises ValueError naming what failed."""
    from posttrain.utils.registry import import_object

    if name in _REGISTERED:
        return _REGISTERED[name]
    fn = import_object(name)
    if not callable(fn):
        raise ValueError(f"{name!r} is not a function")
    return fn


class RewardFnConfig(BaseModel):
    """`env.<name>` of a reward-function environment."""

    model_config = ConfigDict(extra="forbid")

    reward_fn: list[str] = Field(
        description="Reward functions, 'module:function' or 'path/to/file.py:function' (one string or a list).",
    )
    weights: Optional[list[float]] = Field(None, description="One weight per function (default None: 1.0 each).")
    _functions: list[RewardFn] = PrivateAttr(default_factory=list)

    @field_validator("reward_fn", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("reward_fn")
    @classmethod
    def _loadable(cls, names: list[str]) -> list[str]:
        if not names:
            raise ValueError("names no function")
        for name in names:
            load_reward_fn(name)  # a ValueError naming what failed
        return names

    @field_validator("weights")
    @classmethod
    def _one_per_function(cls, weights: Optional[list[float]], info: ValidationInfo) -> Optional[list[float]]:
        names = info.data.get("reward_fn") or []
        if weights is not None and len(weights) != len(names):
            raise ValueError(f"{len(weights)} weights for {len(names)} reward functions")
        return weights

    @model_validator(mode="after")
    def _load(self):
        self._functions = [load_reward_fn(name) for name in self.reward_fn]
        return self

    @property
    def functions(self) -> list[RewardFn]:
        return self._functions

    def pickling_problem(self) -> Optional[str]:
        """Why these functions cannot be sent to a Ray worker (the first that fails), or None."""
        from ray import cloudpickle

        for name, fn in zip(self.reward_fn, self._functions):
            try:
                cloudpickle.dumps(fn)
            except Exception as e:  # cloudpickle raises TypeError, PicklingError, AttributeError, ...
                return f"reward function {name} cannot be sent to a Ray worker ({type(e).__name__}: {e})"
        return None


def _call_arguments(fn: RewardFn, name: str, arguments: dict[str, list]) -> dict[str, list]:
    """The keyword arguments `fn` accepts among `arguments`; a parameter it requires that the rows
    do not have is a `RewardFunctionError` naming the function and the columns there are."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature: give them everything
        return arguments
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return arguments
    required = [p.name for p in parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [p for p in required if p not in arguments]
    if missing or any(p.kind is p.POSITIONAL_ONLY for p in parameters.values()):
        raise RewardFunctionError(
            f"reward function {name} takes {', '.join(missing) or 'positional-only parameters'}, but it is called "
            f"with keywords {sorted(arguments)} (TRL's signature: def reward(prompts, completions, **columns))"
        )
    return {key: value for key, value in arguments.items() if key in parameters}


def _rewards(name: str, values: Any, count: int) -> list[Optional[float]]:
    """`values` as `count` floats (None kept: "does not apply"), or a `RewardFunctionError`."""
    if isinstance(values, torch.Tensor):
        values = values.reshape(-1).tolist()
    try:
        values = list(values)
    except TypeError:
        raise RewardFunctionError(
            f"reward function {name} returned {type(values).__name__}, not a list of {count} rewards"
        ) from None
    if len(values) != count:
        raise RewardFunctionError(f"reward function {name} returned {len(values)} rewards for {count} completions")
    rewards: list[Optional[float]] = []
    for i, value in enumerate(values):
        if value is None:
            rewards.append(None)
        elif isinstance(value, numbers.Real) or (hasattr(value, "item") and getattr(value, "size", 1) == 1):
            rewards.append(float(value))
        else:
            raise RewardFunctionError(f"reward function {name} returned {value!r} at index {i}, not a number or None")
    return rewards


class RewardFunctionEnv(Environment):
    """One turn: the sum of the configured reward functions' weighted rewards (see the module doc)."""

    config_class = RewardFnConfig
    receives_prompt = True  # each row's prompt comes in its metadata (`PROMPT_KEY`, see `row_fields.add_env_fields`)

    def __init__(self, cfg: RewardFnConfig):
        self.cfg = cfg
        self.weights = cfg.weights or [1.0] * len(cfg.reward_fn)
        self.component_names = component_names(cfg.reward_fn)

    def step(self, message_logs, metadata) -> EnvironmentReturn:
        n = len(message_logs)
        prompts = [meta.get(PROMPT_KEY) for meta in metadata]
        texts = [last_assistant_text(log) for log in message_logs]
        completions = [[{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
                       for prompt, text in zip(prompts, texts)]
        arguments = {"prompts": prompts, "completions": completions, **columns(metadata)}
        per_function = self.call_all(arguments, n)
        total = [0.0] * n
        for weight, rewards in zip(self.weights, per_function):
            for i, reward in enumerate(rewards):
                if reward is not None and not math.isnan(reward):
                    total[i] += weight * reward
        components = [{name: (math.nan if rewards[i] is None else rewards[i])
                       for name, rewards in zip(self.component_names, per_function)} for i in range(n)]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""} for _ in range(n)], metadata=list(metadata),
            next_stop_strings=[None] * n, rewards=torch.tensor(total, dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool), answers=[text.strip() or None for text in texts],
            reward_components=components, reward_component_weights=dict(zip(self.component_names, self.weights)),
        )

    def call_all(self, arguments: dict[str, list], count: int) -> list[list[Optional[float]]]:
        """Each function's rewards; plain functions in turn, async ones concurrently on one event loop."""
        results: list[Any] = [None] * len(self.cfg.functions)
        pending: dict[int, Any] = {}
        for i, (name, fn) in enumerate(zip(self.cfg.reward_fn, self.cfg.functions)):
            try:
                value = fn(**_call_arguments(fn, name, arguments))
            except RewardFunctionError:
                raise
            except Exception as e:
                raise RewardFunctionError(f"reward function {name} raised {type(e).__name__}: {e}") from e
            if inspect.isawaitable(value):
                pending[i] = value
            else:
                results[i] = value
        if pending:
            async def gather():
                return await asyncio.gather(*pending.values(), return_exceptions=True)

            for i, value in zip(pending, asyncio.run(gather())):
                if isinstance(value, BaseException):
                    raise RewardFunctionError(
                        f"reward function {self.cfg.reward_fn[i]} raised {type(value).__name__}: {value}"
                    ) from value
                results[i] = value
        return [_rewards(name, value, count) for name, value in zip(self.cfg.reward_fn, results)]


def component_names(functions: list[str]) -> list[str]:
    """The reward component name of each function name: the function's own name, without its module
    or enclosing scopes ('my_rewards:accuracy' -> 'accuracy', 'mod:main.<locals>.brevity' -> 'brevity'),
    with '#2', '#3', ... where two functions would share one."""
    names: list[str] = []
    for function in functions:
        base = function.rsplit(":", 1)[-1].split("#")[0].rsplit(".", 1)[-1]
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}#{n}"
        names.append(name)
    return names


def columns(metadata: list[dict]) -> dict[str, list]:
    """The rows' columns as keyword lists (one value per completion; None where a row lacks one):
    every metadata field but the prompt, with `ground_truth` (the `data.answer_key` column) as `answer`."""
    keys: dict[str, None] = {}
    for meta in metadata:
        keys.update(dict.fromkeys(k for k in meta if k not in (PROMPT_KEY, "ground_truth")))
    out = {key: [meta.get(key) for meta in metadata] for key in keys}
    if "answer" not in out and any(meta.get("ground_truth") is not None for meta in metadata):
        out["answer"] = [meta.get("ground_truth") for meta in metadata]
    return out


def reward_fn_section(functions: Union[RewardFn, str, list], weights: Optional[list[float]] = None) -> dict[str, Any]:
    """The `env.<name>` section serving `functions` (callables are registered in this process,
    names kept as they are)."""
    items = functions if isinstance(functions, (list, tuple)) else [functions]
    if not items:
        raise RewardFunctionError("reward_funcs is empty: give at least one reward function")
    names = [item if isinstance(item, str) else register_reward_fn(item) for item in items]
    section: dict[str, Any] = {"reward_fn": names}
    if weights is not None:
        section["weights"] = [float(w) for w in weights]
    return section
