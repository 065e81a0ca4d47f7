"""No import cycle inside dplit/: every import, at module level or inside a function, points one way."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import REPOSITORY

PACKAGE = REPOSITORY / "dplit"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The dplit modules ``path`` imports anywhere in its code (``from x import y`` counts x, and x.y if a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found & modules


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: imported_modules(path, modules) - {name} for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first search meets (each reported once, from where the search entered it)."""
    state: dict[str, str] = {}
    path: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        state[node], _ = "open", path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        state[node], _ = "done", path.pop()

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_search_finds_a_cycle_when_there_is_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_dplit_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "dplit.cli.main" in graph and "dplit.cli.lightning_cli" in graph["dplit.cli.main"]  # the graph sees real imports
    assert cycles(graph) == [], " ; ".join(" -> ".join(cycle) for cycle in cycles(graph))
