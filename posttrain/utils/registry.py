"""Name -> implementation registries (losses, advantage estimators, packers, data processors):
a new variant is one decorated function or class."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def registrar(registry: dict[str, T], kind: str) -> Callable[[str], Callable[[T], T]]:
    """`register(name)` decorator factory for `registry`; a name registered twice is an error.

    `kind` names the entries in that error (e.g. "loss").
    """

    def register(name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in registry:
                raise ValueError(f"{kind} {name!r} is already registered")
            registry[name] = obj
            return obj

        return decorator

    return register
