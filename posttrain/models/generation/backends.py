"""Generation backends by name: `policy.generation.backend` picks one, like every other plug-in
point (`posttrain.utils.registry`). A built-in registers itself where it is defined:

    @register_generation_backend("native")
    class NativeGeneration(WorkerGroupGeneration):
        def __init__(self, cluster, spec: GenerationSpec, *, bundle_indices=None, name="generation"): ...

The built-ins are `native` (`native.NativeGeneration`) and `vllm` (`vllm_generation.VllmGeneration`),
imported on first lookup (they import torch and Ray; vLLM itself only in its workers). A user's
class needs no registration: it is named by import path, `policy.generation.backend:
my_module:MyGeneration` or `path/to/file.py:MyGeneration` (docs/extending.md, "A generation backend").
The config accepts the built-in names (`BUILTIN_GENERATION_BACKENDS` of the schema, which a test
keeps equal to this registry) and import paths.
"""

from __future__ import annotations

import importlib
from typing import Any

from posttrain.models.generation.interface import GenerationInterface
from posttrain.utils.registry import registrar, resolve

GENERATION_BACKENDS: dict[str, type] = {}

# Modules whose import registers the built-in backends, imported on first lookup (they import
# torch and Ray). Their names are `BUILTIN_GENERATION_BACKENDS` of the config schema.
_BUILTIN_BACKEND_MODULES = {
    "native": "posttrain.models.generation.native",
    "vllm": "posttrain.models.generation.vllm_generation",
}

register_generation_backend = registrar(GENERATION_BACKENDS, "generation backend")
"""Class decorator: `@register_generation_backend("name")` makes the class the backend `name`."""


def generation_backend_class(name: str) -> type:
    """The backend class `name` names: a registered name or an import path ('module:Class',
    'file.py:Class'). A KeyError lists the registered names; an import path that does not load
    raises `ImportPathError`; a class that is not a `GenerationInterface` raises TypeError."""
    if name in _BUILTIN_BACKEND_MODULES:
        importlib.import_module(_BUILTIN_BACKEND_MODULES[name])
    elif ":" not in name:  # a name of its own, or a mistake: the error lists every built-in too
        for module in _BUILTIN_BACKEND_MODULES.values():
            importlib.import_module(module)
    cls: Any = resolve(GENERATION_BACKENDS, name, "generation backend")
    if not (isinstance(cls, type) and issubclass(cls, GenerationInterface)):
        raise TypeError(f"{name!r} is not a GenerationInterface subclass "
                        "(posttrain.models.generation.interface)")
    return cls
