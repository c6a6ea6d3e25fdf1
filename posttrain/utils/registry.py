"""Name -> implementation registries (losses, advantage estimators, environments, LR decays,
packers, data processors): a new variant is one decorated function or class, and a config key
that picks one also takes an import path (`"pkg.module:attr"`, `"file.py:attr"`)."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def registrar(registry: dict[str, T], kind: str) -> Callable[[str], Callable[[T], T]]:
    """`register(name)` decorator factory for `registry`; a name registered twice is an error.

    `kind` names the entries in that error (e.g. "loss").
    """

    def register(name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in registry and registry[name] is not obj:  # registering the same object again is harmless
                raise ValueError(f"{kind} {name!r} is already registered "
                                 f"(by {getattr(registry[name], '__qualname__', registry[name])!s})")
            registry[name] = obj
            return obj

        return decorator

    return register


def resolve(registry: dict[str, T], name: str, kind: str) -> T:
    """The entry `name` of `registry`, or, for a name with a colon, the object at that import
    path (`"pkg.module:attr"` or `"file.py:attr"`, see `import_object`): config keys that pick
    an implementation take either. An unknown name raises KeyError listing the registered ones."""
    if ":" in name:
        return import_object(name)  # type: ignore[return-value]
    if name not in registry:
        import difflib

        close = difflib.get_close_matches(name, list(registry), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown {kind} {name!r} (registered: {sorted(registry)}; or give 'module:attr'){hint}")
    return registry[name]


class ImportPathError(ValueError):
    """An `import_path` ("pkg.module:attr" or "path/to/file.py:attr") that cannot be loaded."""


def import_object(path: str) -> object:
    """Load the object named by `path`: `"package.module:attr"` or `"dir/file.py:attr"`.

    The module form imports like `import package.module` (the current directory is searched
    first, so a user's own module next to their config works); the file form loads the file
    under a module name derived from its resolved path, and adds its directory to `sys.path`
    so the file's own sibling imports work (and Ray workers, which receive the driver's
    `sys.path`, can unpickle classes from it). `attr` may be dotted (`"mod:Outer.Inner"`).
    Raises ImportPathError with one line naming the path and what failed.
    """
    import importlib
    import importlib.util
    import os
    import sys

    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ImportPathError(f"{path!r} is not of the form 'package.module:attr' or 'file.py:attr'")
    module_part, attr_part = path.split(":")
    if module_part.endswith(".py") or os.sep in module_part:
        file = os.path.abspath(module_part)
        if not os.path.isfile(file):
            raise ImportPathError(f"{path!r}: file {file} does not exist")
        directory = os.path.dirname(file)
        if directory not in sys.path:
            sys.path.insert(0, directory)
        name = os.path.splitext(os.path.basename(file))[0]
        existing = sys.modules.get(name)
        if existing is not None and os.path.abspath(getattr(existing, "__file__", "") or "") == file:
            module = existing
        else:
            spec = importlib.util.spec_from_file_location(name, file)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                del sys.modules[name]
                raise ImportPathError(f"{path!r}: importing {file} failed: {type(exc).__name__}: {exc}") from exc
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            hint = (f"; for a file of your own, give its path: 'path/to/{module_part}.py:{attr_part}' (in a config "
                    f"file, a module beside the file is found from any directory)") if exc.name == module_part else ""
            raise ImportPathError(f"{path!r}: no module named {exc.name!r} (searched the current directory and "
                                  f"sys.path){hint}") from exc
        except Exception as exc:
            raise ImportPathError(f"{path!r}: importing {module_part} failed: {type(exc).__name__}: {exc}") from exc
    obj: object = module
    for part in attr_part.split("."):
        if not hasattr(obj, part):
            raise ImportPathError(f"{path!r}: {module_part} has no attribute {attr_part!r}")
        obj = getattr(obj, part)
    return obj
