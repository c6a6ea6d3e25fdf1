"""The base of every config section, and checks several sections share."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_component_name(name: str, key: str) -> None:
    """A registered name, or an import path `module:attr` / `file.py:attr` (resolved by preflight,
    before any worker starts: importing a user's module may be slow)."""
    if ":" in name and (name.count(":") != 1 or not all(name.split(":"))):
        raise ValueError(f"{key}={name!r} is not a registered name or an import path 'module:attr' / 'file.py:attr'")
