"""Imports run one way: no part of posttrain imports a part that imports it back, no file
imports a file that imports it back, and no private name crosses files.

A part is a subpackage (`posttrain.models`) or a top-level module (`posttrain.rollouts`); a file
is one module (`posttrain.data.datasets`; a package's `__init__.py` is the package's module).
Every import counts, including the lazy ones inside functions: importing inside a function is how
posttrain keeps torch, transformers and Ray out of `posttrain --help` and config errors, and it
defers the cost of a dependency, but it is a dependency all the same (two files that reach into
each other, lazily or not, are one piece of code cut in two). A lazy import that only avoids a
heavy library never closes a circle, so the rule costs nothing there. Loading a module by name at
run time (`importlib.import_module` in the registries, which load the built-in plug-ins that
register themselves on first lookup) is not an import here: a registry does not depend on what
registers in it.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import posttrain

ROOT = Path(posttrain.__file__).parent

# The intended layering, lowest first: a part may import only parts listed before it.
LAYERS = [
    "version", "errors", "cpu_precision", "config", "utils", "distributed", "data", "environments", "models", "judges", "rollouts",
    "run_config", "job", "evals", "algorithms", "plan", "preflight", "doctor", "cli", "api", "__main__", "__init__",
]


def part_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else ""


def parts() -> set[str]:
    return {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}


def import_graph() -> dict[str, dict[str, list[str]]]:
    """part -> imported part -> the files (and lines) that import it."""
    known = parts()
    graph: dict[str, dict[str, list[str]]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts)
        source = part_of(module if path.name != "__init__.py" else module + ".x")
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "posttrain"]
            for name in names:
                if name.startswith("posttrain.") and part_of(name) in known and part_of(name) != source:
                    where = f"{path.relative_to(ROOT.parent)}:{node.lineno}"
                    graph.setdefault(source, {}).setdefault(part_of(name), []).append(where)
    return graph


def test_every_part_is_in_a_layer():
    assert parts() <= set(LAYERS), f"add {sorted(parts() - set(LAYERS))} to LAYERS"


def test_imports_point_down_the_layers():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = [
        f"{source} imports {target} ({', '.join(where)})"
        for source, targets in import_graph().items()
        for target, where in targets.items()
        if rank[target] > rank[source]
    ]
    assert not upward, "\n".join(upward)


def test_no_cycles_between_parts():
    graph = {s: set(t) for s, t in import_graph().items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return False

    cycles = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if reaches(b, a)})
    assert not cycles, f"parts importing each other: {cycles}"


# ------------------------------------------------------------------------------------- files
# Private names that still cross files, each with the change that removes it.
PRIVATE_IMPORTS_PENDING: set[tuple[str, str, str]] = set()


@cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every file of the package (`__init__.py` as the package)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        names = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if names[-1] == "__init__":
            names.pop()
        found[".".join(names)] = path
    return found


def imports_of(path: Path):
    """`(line, imported module, imported names)` of every absolute import of posttrain in a file,
    wherever it stands (module level, function, `if TYPE_CHECKING`)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("posttrain"):
                    yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("posttrain"):
            yield node.lineno, node.module, [alias.name for alias in node.names]


def module_graph() -> dict[str, dict[str, list[int]]]:
    """module -> module it imports -> the lines that import it. `from package import name` counts
    as importing the submodule `package.name` when there is one, else the package."""
    known = modules()
    graph: dict[str, dict[str, list[int]]] = {}
    for module, path in known.items():
        targets = graph.setdefault(module, {})
        for line, imported, names in imports_of(path):
            submodules = [f"{imported}.{name}" for name in names if f"{imported}.{name}" in known]
            for target in submodules or [imported]:
                while target not in known:  # `import posttrain.x.y` of a name inside a module
                    target = target.rpartition(".")[0]
                if target != module:
                    targets.setdefault(target, []).append(line)
    return graph


def cycles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycles_finds_a_circle_of_three_and_ignores_a_diamond():
    graph = {"a": {"b": [1]}, "b": {"c": [1]}, "c": {"a": [1]}, "d": {"e": [1], "f": [1]}, "e": {"g": [1]},
             "f": {"g": [1]}, "g": {}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_cycles_between_files():
    graph = module_graph()
    problems = []
    for component in cycles(graph):
        edges = [f"{a} imports {b} (line {', '.join(map(str, graph[a][b]))})"
                 for a in component for b in component if b in graph[a]]
        problems.append("; ".join(edges))
    assert not problems, "files importing each other (directly or through others):\n" + "\n".join(problems)


def test_no_private_name_crosses_files():
    """A name with a leading underscore is its file's own: a helper that another file needs is
    public, in the file both can import."""
    known = modules()
    crossing = set()
    for module, path in known.items():
        for line, imported, names in imports_of(path):
            for name in names:
                if name.startswith("_") and not name.startswith("__") and imported != module:
                    crossing.add((module, imported, name, line))
    unexpected = sorted(c for c in crossing if c[:3] not in PRIVATE_IMPORTS_PENDING)
    assert not unexpected, "\n".join(f"{m}:{line} imports {name} from {src}" for m, src, name, line in unexpected)
    stale = PRIVATE_IMPORTS_PENDING - {c[:3] for c in crossing}
    assert not stale, f"no longer imported: remove {sorted(stale)} from PRIVATE_IMPORTS_PENDING"
