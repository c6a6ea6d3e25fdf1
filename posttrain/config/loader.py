"""Load a typed config from YAML files and `dotted.key=value` overrides.

    cfg = load_config("grpo", "examples/configs/grpo_dapo_tiny.yaml", ["policy.optimizer.lr=3e-4"])

Resolution order (later wins): the schema's defaults, the YAML file (after its own `defaults:`
files, merged underneath it), then the command-line overrides. Dicts merge key by key; every
other value (lists included) replaces what was there. Two YAML tags change that for one key (in a
file or an override's value): `!replace` (a mapping replaces the inherited one whole instead of
merging into it) and `!delete` (the inherited key is dropped, so the schema's default applies);
`~dotted.key` on the command line deletes as `!delete` does (Hydra's syntax). docs/configuration.md,
"Replacing or dropping an inherited key".

Every value remembers where it came from (file and line, or "command line"), so an error names the
full dotted key, its source and, for an unknown key, the closest valid one. All problems are
reported at once. Only PyYAML and pydantic are imported here: config errors must answer fast.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Sequence, Union

import yaml
from pydantic import BaseModel, ValidationError

from posttrain.config.schema import SCHEMAS, MasterConfig
from posttrain.errors import UserError

COMMAND_LINE = "command line"

# The embedded default config of each algorithm: package data in posttrain/configs, which in the
# repository is a link to examples/configs (one copy), and in a wheel the files themselves.
EXAMPLE_CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIGS: dict[str, str] = {
    "grpo": "grpo_math_tiny.yaml",
    "ppo": "ppo_tiny.yaml",
    "sft": "sft_tiny.yaml",
    "dpo": "dpo_tiny.yaml",
    "rm": "rm_tiny.yaml",
    "eval": "eval_tiny.yaml",
    "distill": "distill_tiny.yaml",
}

KeyPath = tuple[Union[str, int], ...]  # a key path inside the nested config dict


class ConfigError(UserError):
    """A config problem the user must fix. `problems` lists each one; str() shows them all."""

    def __init__(self, problems: str | Sequence[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} config problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


# ------------------------------------------------------------------------------------ YAML parsing
class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-4` as a float (YAML 1.2); PyYAML's 1.1 resolver needs a dot."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


REPLACE_TAG, DELETE_TAG = "!replace", "!delete"


class _Replace:
    """A value tagged `!replace`: it replaces the inherited value whole (a mapping is not merged)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class _Delete:
    """A key tagged `!delete` (or `~key` on the command line): the inherited key is dropped."""

    def __repr__(self) -> str:
        return DELETE_TAG


DELETE = _Delete()


def _parse_yaml(text: str, source: str) -> tuple[Any, dict[KeyPath, str]]:
    """Parse one YAML document; returns (data, {key path: "source, line N"}) for every mapping key.

    Duplicate keys are an error (PyYAML would silently keep the last one).
    """
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        lines: dict[KeyPath, str] = {}
        data = _construct(loader, node, (), lines, source) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark else source
        raise ConfigError(f"YAML syntax error in {where}: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"YAML syntax error in {source}: {e}") from None
    finally:
        loader.dispose()
    return data, lines


def _construct(loader: _Loader, node: yaml.Node, path: KeyPath, lines: dict[KeyPath, str], source: str) -> Any:
    """Build Python data from a node tree, recording the line of each mapping key on the way;
    a node tagged `!replace` or `!delete` becomes `_Replace(value)` or `DELETE`."""
    if node.tag == DELETE_TAG:
        if not isinstance(node, yaml.ScalarNode) or node.value != "":
            where = f"{source}, line {node.start_mark.line + 1}"
            raise ConfigError(f"'{_dotted(path) or 'the document'}: {DELETE_TAG}' takes no value, in {where} "
                              f"(write `{path[-1] if path else 'key'}: {DELETE_TAG}`)")
        return DELETE
    if node.tag == REPLACE_TAG:
        node.tag = _untagged(loader, node)
        return _Replace(_construct(loader, node, path, lines, source))
    if not isinstance(node, yaml.MappingNode):
        return loader.construct_object(node, deep=True)
    loader.flatten_mapping(node)  # resolves `<<: *anchor` merge keys
    result: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, str):
            raise ConfigError(f"Config keys must be strings, got {key!r} in {source}, line {line}")
        if key in result:
            raise ConfigError(f"Duplicate key '{_dotted(path + (key,))}' in {source}, line {line}")
        lines[path + (key,)] = f"{source}, line {line}"
        result[key] = _construct(loader, value_node, path + (key,), lines, source)
    return result


def _untagged(loader: _Loader, node: yaml.Node) -> str:
    """The tag `node` would have without an explicit one (`!replace` marks a value, not its type)."""
    if isinstance(node, yaml.MappingNode):
        return yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG
    if isinstance(node, yaml.SequenceNode):
        return yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG
    return loader.resolve(yaml.ScalarNode, node.value, (True, False))


def _plain(value: Any) -> Any:
    """`value` with its `!replace` / `!delete` marks applied to nothing inherited: a replacing value
    is just its value, a deleted key is left out."""
    if isinstance(value, _Replace):
        return _plain(value.value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items() if item is not DELETE}
    return value


# ---------------------------------------------------------------------------- files and defaults
def _display(path: Path) -> str:
    """A path as the user would type it: relative to the working directory when inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:  # outside the working directory
        return str(path)


def _load_file(path: Path, stack: tuple[Path, ...] = ()) -> tuple[dict, dict[KeyPath, str]]:
    """Read a YAML config and everything its `defaults:` pulls in (merged underneath it)."""
    path = path.resolve()
    if path in stack:
        chain = " -> ".join(_display(p) for p in stack + (path,))
        raise ConfigError(f"Config defaults form a cycle: {chain}")
    try:
        text = path.read_text()
    except FileNotFoundError:
        where = f" (in the defaults of {_display(stack[-1])})" if stack else ""
        raise ConfigError(f"Config file '{_display(path)}' not found{where}") from None
    except OSError as e:
        raise ConfigError(f"Cannot read config file '{_display(path)}': {e.strerror}") from None

    source = _display(path)
    data, sources = _parse_yaml(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {source} must hold a mapping of keys, got {type(data).__name__}")

    data = _beside_the_file(data, path.parent)
    includes = data.pop("defaults", None)
    sources.pop(("defaults",), None)
    if includes is None:
        includes = []
    elif isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(p, str) for p in includes):
        raise ConfigError(f"'defaults' in {source} must be a file path or a list of file paths, got {includes!r}")

    merged: dict = {}
    merged_sources: dict[KeyPath, str] = {}
    for include in includes:
        sub, sub_sources = _load_file(path.parent / include, stack + (path,))
        _merge(merged, merged_sources, sub, sub_sources)
    _merge(merged, merged_sources, data, sources)
    return merged, merged_sources


# An import path (`class_path`, `loss_fn.name`, `adv_estimator.name`, ...): `module:attr` with a
# plain module name, or `file.py:attr`.
_IMPORT_PATH = re.compile(r"^(?P<module>[A-Za-z_]\w*|[^:\s]+\.py):(?P<attr>[A-Za-z_][\w.]*)$")


def _beside_the_file(value: Any, directory: Path) -> Any:
    """`value` with every import path that names a Python file in `directory` (the config file's
    folder: `my_task:ParityEnv` for `my_task.py`, or `my_task.py:ParityEnv`) made absolute, so a
    config finds the user's module beside it from any working directory. Other values, and
    import paths of modules that are not there (installed packages), are left as they are."""
    if isinstance(value, _Replace):
        return _Replace(_beside_the_file(value.value, directory))
    if isinstance(value, dict):
        return {key: _beside_the_file(item, directory) for key, item in value.items()}
    if isinstance(value, list):
        return [_beside_the_file(item, directory) for item in value]
    match = _IMPORT_PATH.match(value) if isinstance(value, str) else None
    if match is None or Path(match["module"]).is_absolute():
        return value
    module = match["module"]
    file = directory / (module if module.endswith(".py") else module + ".py")
    return f"{file}:{match['attr']}" if file.is_file() else value


def _merge(base: dict, base_sources: dict[KeyPath, str], upper: dict, upper_sources: dict[KeyPath, str], path: KeyPath = ()):
    """Deep-merge `upper` into `base` in place: dicts merge, anything else replaces; a `!replace`
    value replaces even a dict, a `!delete` key is dropped from `base` (with its sources)."""
    for key, value in upper.items():
        here = path + (key,)
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], base_sources, value, upper_sources, here)
            continue
        for stale in [p for p in base_sources if p[: len(here)] == here]:
            del base_sources[stale]
        if value is DELETE:
            base.pop(key, None)
            continue
        base[key] = _plain(value)
        base_sources.update({p: s for p, s in upper_sources.items() if p[: len(here)] == here})


# --------------------------------------------------------------------------------------- overrides
_OVERRIDE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def parse_override(text: str) -> tuple[str, Any]:
    """`"a.b=1e-4"` -> `("a.b", 1e-4)`. Values are YAML (`true`, `null`, `[1, 2]`, `{a: 1}`, and
    `!replace {a: 1}`); an empty value is the empty string. A leading `+` on the key is accepted and
    ignored. `"~a.b"` -> `("a.b", DELETE)`: the key is dropped (Hydra's deletion syntax)."""
    if text.startswith("~"):
        key = text[1:].strip()
        if "=" in key or not _OVERRIDE_KEY.match(key):
            raise ConfigError(f"Malformed override '{text}' (from {COMMAND_LINE}): expected ~dotted.key (no value), "
                              "e.g. ~data.generator_options")
        return key, DELETE
    key, sep, raw = text.partition("=")
    key = key.strip().removeprefix("+")
    if not sep or not _OVERRIDE_KEY.match(key):
        raise ConfigError(
            f"Malformed override '{text}' (from {COMMAND_LINE}): expected dotted.key=value, e.g. grpo.max_num_steps=10"
        )
    if raw.strip() == "":
        return key, ""
    try:
        value, _ = _parse_yaml(raw, f"the value of override '{text}'")
    except ConfigError as e:
        raise ConfigError(f"Malformed override '{text}' (from {COMMAND_LINE}): {e}") from None
    return key, value


def _field_wants_str(schema_cls: type[BaseModel], path: Sequence[str]) -> bool:
    """True if the schema field at `path` is a plain (optional) string."""
    annotation: Any = schema_cls
    for key in path:
        model = _model_in(annotation)
        if model is None or key not in model.model_fields:
            return False
        annotation = model.model_fields[key].annotation
    options = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    return str in options and all(o in (str, type(None)) for o in options)


def _apply_overrides(schema_cls: type[BaseModel], data: dict, sources: dict[KeyPath, str], overrides: Sequence[str]):
    problems = []
    for text in overrides:
        try:
            key, value = parse_override(text)
        except ConfigError as e:
            problems.append(str(e))
            continue
        path = tuple(key.split("."))
        if value is DELETE:
            problem = _delete(schema_cls, data, sources, path)
            if problem:
                problems.append(problem)
            continue
        if (not isinstance(value, (str, dict, list, _Replace)) and value is not None
                and _field_wants_str(schema_cls, path)):
            value = text.partition("=")[2].strip()  # `policy.model_name=1234` is a name, not a number
        node = data
        for i, part in enumerate(path[:-1]):
            if node.get(part) is None:
                node[part] = {}
                sources[path[: i + 1]] = COMMAND_LINE  # a section the override creates is the override's
            if not isinstance(node[part], dict):
                problems.append(
                    f"Cannot set '{key}' (from {COMMAND_LINE}): '{_dotted(path[: i + 1])}' is "
                    f"{node[part]!r}, not a section"
                )
                break
            node = node[part]
        else:
            inner = value.value if isinstance(value, _Replace) else value
            value_sources = {path + p: COMMAND_LINE for p in _key_paths(inner)} if isinstance(inner, dict) else {}
            _merge(node, sources, {path[-1]: value}, {path: COMMAND_LINE, **value_sources}, path[:-1])
    if problems:
        raise ConfigError(problems)


def _delete(schema_cls: type[BaseModel], data: dict, sources: dict[KeyPath, str], path: KeyPath) -> str | None:
    """`~key`: drop `path` from the merged files' `data` (its schema default then applies); a
    problem for a key that no file sets and the schema does not know (a typo), else None."""
    node = data
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict) and path[-1] in node:
        _merge(node, sources, {path[-1]: DELETE}, {}, path[:-1])
        return None
    key = _dotted(path)
    valid = all_keys(schema_cls)
    if key in valid:
        return None  # no file sets it: its schema default applies already
    hint = suggest_key(key, valid)
    return (f"Cannot delete '~{key}' (from {COMMAND_LINE}): no config file sets it and it is not a config key."
            + (f" Did you mean '~{hint}'?" if hint else ""))


def _key_paths(d: dict, path: KeyPath = ()) -> list[KeyPath]:
    """The path of every key in a nested dict, sections included."""
    out = []
    for k, v in d.items():
        out.append(path + (k,))
        if isinstance(v, dict):
            out.extend(_key_paths(v, path + (k,)))
    return out


# ---------------------------------------------------------------------------------- schema walking
def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (Union, types.UnionType)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside `Model` or `Optional[Model]`, else None."""
    candidates = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
    return None


def all_keys(schema_cls: type[BaseModel], prefix: str = "") -> list[str]:
    """Every valid dotted key of a schema, sections included, in declaration order.

    Examples:
        >>> all_keys(SFTMasterConfig)[:3]
        ['policy', 'policy.model_name', 'policy.tokenizer_name']
    """
    keys = []
    for name, field in schema_cls.model_fields.items():
        key = f"{prefix}{name}"
        keys.append(key)
        sub = _model_in(field.annotation)
        if sub is not None:
            keys.extend(all_keys(sub, key + "."))
    return keys


def suggest_key(key: str, valid_keys: Sequence[str]) -> str | None:
    """The valid key the user most likely meant, or None.

    Tries, in order: a close spelling among the siblings (`grpo.num_prompt_per_step` ->
    `grpo.num_prompts_per_step`), the same leaf name in another section (`policy.lr` ->
    `policy.optimizer.lr`), then a close spelling of the whole dotted key.
    """
    parent, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in valid_keys if k.rpartition(".")[0] == parent}
    match = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.75)
    if match:
        return siblings[match[0]]
    same_leaf = [k for k in valid_keys if k.rpartition(".")[2] == leaf]
    if same_leaf:
        return (difflib.get_close_matches(key, same_leaf, n=1, cutoff=0.0) or same_leaf)[0]
    # Not the key's own enclosing section: `grpo.foo` -> "did you mean 'grpo'?" helps nobody.
    candidates = [k for k in valid_keys if not key.startswith(k + ".")]
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


# ------------------------------------------------------------------------------ validation errors
_EXPECTS = {
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "bool_type": "true or false", "bool_parsing": "true or false",
    "string_type": "a string", "list_type": "a list", "tuple_type": "a list", "dict_type": "a mapping",
    "model_type": "a section (mapping of keys)", "model_attributes_type": "a section (mapping of keys)",
}  # fmt: skip
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _dotted(path: KeyPath) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _source_of(path: KeyPath, sources: dict[KeyPath, str], whole_section: bool = False) -> str:
    """Where the value at `path` (or the closest enclosing key) was set.

    With `whole_section` (a check across several keys of a section failed), the files that set
    any key inside it, e.g. "grpo_math_tiny.yaml and command line".
    """
    if whole_section:
        inside = {s.partition(", line ")[0]: None for p, s in sources.items() if p[: len(path)] == path and p != path}
        if inside:
            return " and ".join(inside)
    for n in range(len(path), 0, -1):
        if path[:n] in sources:
            return sources[path[:n]]
    return "schema defaults"


def _describe(error: dict, schema_cls: type[BaseModel], sources: dict[KeyPath, str]) -> str:
    """One pydantic error -> one sentence naming the dotted key and where its value came from."""
    path = tuple(error["loc"])
    key, kind, ctx, value = _dotted(path), error["type"], error.get("ctx") or {}, error.get("input")
    source = _source_of(path, sources)
    if kind == "extra_forbidden":
        hint = suggest_key(key, all_keys(schema_cls))
        return f"Unknown config key '{key}' (from {source})." + (f" Did you mean '{hint}'?" if hint else "")
    got = f"got {value!r} ({type(value).__name__})"
    if kind in _BOUNDS:
        bound = next(v for k, v in ctx.items() if k in ("ge", "gt", "le", "lt"))
        bound = f"{bound:g}" if isinstance(bound, float) else bound  # 1.0 -> 1, 0.0003 -> 0.0003
        return f"Config key '{key}' must be {_BOUNDS[kind]} {bound}, got {value!r} (from {source})"
    if kind == "literal_error":
        return f"Config key '{key}' expects one of {ctx.get('expected')}, {got} (from {source})"
    if kind in ("too_short", "too_long"):
        return f"Config key '{key}' expects {ctx.get('expected')} items, got {ctx.get('actual_length')} (from {source})"
    if kind in _EXPECTS:
        return f"Config key '{key}' expects {_EXPECTS[kind]}, {got} (from {source})"
    if kind == "missing" and path and isinstance(path[-1], int):  # a tuple with too few items
        return f"Config key '{_dotted(path[:-1])}' has too few items: item {path[-1]} is missing (from {source})"
    if kind == "missing":
        return f"Config key '{key}' is required (from {source})"
    message = error["msg"].removeprefix("Value error, ")
    source = _source_of(path, sources, whole_section=True)
    if not key:  # a check across sections: its message names the keys
        return f"Config: {message} (from {source})"
    return f"Config key '{key}': {message} (from {source})"


def _validate(schema_cls: type[MasterConfig], data: dict, sources: dict[KeyPath, str]) -> MasterConfig:
    try:
        return schema_cls.model_validate(data)
    except ValidationError as e:
        problems = []
        for error in e.errors():
            problem = _describe(error, schema_cls, sources)
            if problem not in problems:
                problems.append(problem)
        raise ConfigError(problems) from None


# ------------------------------------------------------------------------------------- public API
def default_config_path(algo: str) -> Path:
    """The embedded default YAML of an algorithm (e.g. `grpo` -> examples/configs/grpo_math_tiny.yaml)."""
    path = EXAMPLE_CONFIG_DIR / DEFAULT_CONFIGS[_check_algo(algo)]
    if not path.is_file():
        raise ConfigError(f"Embedded default config {path} is missing (a broken installation?); give --config FILE")
    return path


def _check_algo(algo: str) -> str:
    if algo not in SCHEMAS:
        raise ConfigError(f"Unknown algorithm '{algo}'; expected one of {', '.join(SCHEMAS)}")
    return algo


def load_config(algo: str, config_path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> MasterConfig:
    """Load, merge and validate the config of `algo` (a key of `SCHEMAS`: grpo, sft, dpo, rm, eval).

    Args:
        algo: which schema to validate against.
        config_path: YAML file; default None uses the algorithm's embedded default
            (`DEFAULT_CONFIGS`). Its `defaults:` (a path or list of paths, relative to the file)
            are merged underneath it.
        overrides: `dotted.key=value` strings applied last (values parsed as YAML).

    Raises:
        ConfigError: listing every problem, each naming its dotted key and source.
    """
    schema_cls = SCHEMAS[_check_algo(algo)]
    path = Path(config_path) if config_path is not None else default_config_path(algo)
    data, sources = _load_file(path)
    _apply_overrides(schema_cls, data, sources, overrides)
    return _validate(schema_cls, data, sources)


class _Dumper(yaml.SafeDumper):
    """Block style for sections, flow style for lists of scalars (`betas: [0.9, 0.999]`)."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(item, (dict, list)) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def config_to_yaml(cfg: BaseModel, comments: bool = False) -> str:
    """The fully resolved config as YAML; `load_config` reads it back to an equal config. With
    `comments` (`--print-config`), each key and section is preceded by its description."""
    algo = next((name for name, cls in SCHEMAS.items() if type(cfg) is cls), None)
    header = f"# Resolved posttrain {algo} config.\n" if algo else ""
    if comments:
        return header + "\n".join(_commented_yaml(cfg, indent=0)) + "\n"
    return header + yaml.dump(cfg.model_dump(mode="json"), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def _commented_yaml(model: BaseModel, indent: int) -> list[str]:
    """YAML lines of `model`: every field under a `#` comment with its description (a section's
    own docstring for a nested section), values as `config_to_yaml` writes them."""
    import textwrap

    pad, lines = " " * indent, []
    dumped = model.model_dump(mode="json")
    fields = dict(type(model).model_fields)
    for name in [*fields, *(model.model_extra or {})]:
        value = getattr(model, name)
        field = fields.get(name)
        doc = field.description if field is not None else None
        if isinstance(value, BaseModel):
            doc = doc or type(value).__doc__
        if doc:
            lines += [f"{pad}# {line}" for line in textwrap.wrap(" ".join(doc.split()), max(40, 100 - indent))]
        if isinstance(value, BaseModel):
            lines.append(f"{pad}{name}:")
            lines += _commented_yaml(value, indent + 2)
        else:
            text = yaml.dump({name: dumped[name]}, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
            lines += [pad + line for line in text.rstrip("\n").split("\n")]
    return lines


def save_config(cfg: BaseModel, path: str | os.PathLike) -> Path:
    """Write `config_to_yaml(cfg)` to `path` (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_to_yaml(cfg))
    return path
