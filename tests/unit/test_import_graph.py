"""Imports run one way: no part of posttrain imports a part that imports it back.

A part is a subpackage (`posttrain.models`) or a top-level module (`posttrain.rollouts`); every
import counts, including the lazy ones inside functions (they are dependencies all the same).
"""

from __future__ import annotations

import ast
from pathlib import Path

import posttrain

ROOT = Path(posttrain.__file__).parent

# The intended layering, lowest first: a part may import only parts listed before it.
LAYERS = [
    "errors", "config", "utils", "distributed", "data", "environments", "models", "judges", "rollouts", "job",
    "evals", "algorithms", "plan", "preflight", "cli", "api", "__main__", "__init__",
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
