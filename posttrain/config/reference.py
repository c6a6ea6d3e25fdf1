"""The configuration reference (docs/reference/config.md), written from the schema itself: every
section's docstring and every key's description, type and default. The docs build calls
`config_reference_markdown` (docs/hooks.py), so the page cannot drift from the code.
"""

from __future__ import annotations

import enum
import json
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from posttrain.config.schema import SCHEMAS, MasterConfig


@dataclass
class SectionDoc:
    """One config section class and where it appears (`policy`, `teacher`, ...)."""

    cls: type[BaseModel]
    paths: list[str] = field(default_factory=list)
    defaults: dict[str, BaseModel] = field(default_factory=dict)  # path -> default instance given by the parent
    commands: list[str] = field(default_factory=list)  # the commands whose config holds it
    anchor: str = ""  # its heading's id on the reference page


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models in `Model`, `Optional[Model]`, `list[Model]`, `dict[str, Model]`."""
    found = []
    for t in (annotation, *typing.get_args(annotation)):
        for u in (t, *typing.get_args(t)):
            if isinstance(u, type) and issubclass(u, BaseModel) and u not in found:
                found.append(u)
    return found


def walk_schemas() -> tuple[list[SectionDoc], list[tuple[type[BaseModel], str, FieldInfo]]]:
    """Every section reachable from the commands' schemas (in first-seen order) and every leaf key
    as (section class, field name, field). A command's whole config nested in another (`sft_warmup`)
    is a section of its own command, not walked again."""
    sections: dict[type[BaseModel], SectionDoc] = {}
    keys: list[tuple[type[BaseModel], str, FieldInfo]] = []

    def walk(cls: type[BaseModel], path: str, default: Any, command: str) -> None:
        known = cls in sections
        doc = sections.setdefault(cls, SectionDoc(cls))
        if command not in doc.commands:
            doc.commands.append(command)
        if path and path not in doc.paths:
            doc.paths.append(path)
            if isinstance(default, BaseModel):
                doc.defaults[path] = default
        for name, info in cls.model_fields.items():
            nested = _models_in(info.annotation)
            for model in nested:  # walked again from each command, so each section knows its commands
                if not issubclass(model, MasterConfig):
                    walk(model, f"{path}.{name}" if path else name, info.default, command)
            if not nested and not known:
                keys.append((cls, name, info))

    for command, schema in SCHEMAS.items():
        walk(schema, "", None, command)
    used: set[str] = set()
    for doc in sections.values():
        if doc.paths:
            # Two classes at one path (`loss_fn` of grpo and of distill) get the command in the id.
            anchor = _anchor(doc.paths[0])
            doc.anchor = anchor if anchor not in used else f"{anchor}-{doc.commands[0]}"
            used.add(doc.anchor)
    return list(sections.values()), keys


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(json.dumps(a) if isinstance(a, str) else str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"section ({annotation.__name__})"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _value(value: Any) -> str:
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, enum.Enum):
        value = value.value
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return f"`{text}`" if len(text) <= 60 else f"`{text[:57]}...`"


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return _value(info.default_factory())
    return _value(info.default)


_MARKDOWN = re.compile(r"([\\*_\[\]|])")


def _cell(text: str) -> str:
    """Plain description text as one table cell: Markdown characters outside `code` spans escaped
    (`10**7`, `NAME[:CONFIG]`, `<pad>` and `a|b` mean what they say)."""
    parts = " ".join((text or "").split()).split("`")
    return "`".join(_MARKDOWN.sub(r"\\\1", part).replace("<", "&lt;") if i % 2 == 0 else part
                    for i, part in enumerate(parts))


def _anchor(path: str) -> str:
    return "cfg-" + path.replace(".", "-").replace("_", "-")


def _command_of(schema: type[BaseModel]) -> str:
    return next(name for name, cls in SCHEMAS.items() if cls is schema)


def _section_markdown(doc: SectionDoc, by_class: dict[type[BaseModel], SectionDoc]) -> list[str]:
    cls, main = doc.cls, doc.paths[0]
    title = f"`{main}`" if doc.anchor == _anchor(main) else f"`{main}` (`posttrain {doc.commands[0]}`)"
    lines = [f"## {title} {{#{doc.anchor}}}", "", _cell(cls.__doc__ or ""), ""]
    if len(doc.paths) > 1:
        lines += ["Also at " + ", ".join(f"`{p}`" for p in doc.paths[1:]) + ".", ""]
    for path, instance in doc.defaults.items():
        plain = cls().model_dump(mode="json")
        changed = {k: v for k, v in instance.model_dump(mode="json").items()
                   if not _models_in(cls.model_fields[k].annotation) and v != plain.get(k)}
        if changed:
            lines += [f"Defaults of `{path}` that differ from the table: "
                      + ", ".join(f"`{k}` = {_value(v)}" for k, v in changed.items()) + ".", ""]
    if not cls.model_fields:
        return lines + ["No fixed keys.", ""]
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    for name, info in cls.model_fields.items():
        nested = [m for m in _models_in(info.annotation) if not issubclass(m, MasterConfig)]
        if nested:
            link = f"[`{main}.{name}`](#{by_class[nested[0]].anchor})"
            description = _cell(info.description or nested[0].__doc__)
            if typing.get_origin(info.annotation) in (list, dict):
                lines.append(f"| `{name}` | list of sections | {_default(info)} | {description} Each item: {link}. |")
            else:
                optional = " or `null`" if type(None) in typing.get_args(info.annotation) else ""
                lines.append(f"| `{name}` | section{optional} | see {link} | {description} |")
            continue
        masters = [m for m in _models_in(info.annotation) if issubclass(m, MasterConfig)]
        if masters:
            kind = f"a whole `posttrain {_command_of(masters[0])}` config or `null`"
            lines.append(f"| `{name}` | {kind} | `null` | {_cell(info.description)} |")
            continue
        lines.append(f"| `{name}` | {_type_name(info.annotation)} | {_default(info)} | {_cell(info.description)} |")
    return lines + [""]


def config_reference_markdown() -> str:
    """The whole reference page: the sections of each command, then one table per section."""
    sections, _ = walk_schemas()
    by_class = {doc.cls: doc for doc in sections}
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by posttrain/config/reference.py from the schema (posttrain/config/schema/) "
        "when the docs are built; edit the descriptions there. -->",
        "",
        "Every key of every command, from the schema's own descriptions. Defaults are the schema's; the "
        "embedded default config of each command (`posttrain <command> --print-config` shows it resolved, with "
        "these descriptions as comments) sets some of them differently. How files, `defaults:` and "
        "`key=value` overrides combine: [Configuration](../configuration.md). The fields of each environment "
        "(`env.<name>.*`) belong to the environment: [Environments and data](../environments.md), "
        "[Multi-turn environments](../multi-turn.md).",
        "",
        "| command | sections |",
        "|---|---|",
    ]
    for command, schema in SCHEMAS.items():
        links = []
        for name, info in schema.model_fields.items():
            nested = [m for m in _models_in(info.annotation) if not issubclass(m, MasterConfig)]
            masters = [m for m in _models_in(info.annotation) if issubclass(m, MasterConfig)]
            if nested:
                links.append(f"[`{name}`](#{by_class[nested[0]].anchor})")
            elif masters:
                links.append(f"`{name}` (a `posttrain {_command_of(masters[0])}` config)")
            else:
                links.append(f"`{name}`")
        lines.append(f"| `posttrain {command}` | {', '.join(links)} |")
    lines.append("")
    for doc in sections:
        if doc.paths:  # the commands' own schemas have no path
            lines += _section_markdown(doc, by_class)
    return "\n".join(lines)
