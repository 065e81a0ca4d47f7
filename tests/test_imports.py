"""No import cycle inside dplit/: every import, at module level or inside a function, points one way."""

from __future__ import annotations

import ast
import re
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
    assert (
        "dplit.cli.main" in graph and "dplit.cli.lightning_cli" in graph["dplit.cli.main"]
    )  # the graph sees real imports
    assert cycles(graph) == [], " ; ".join(" -> ".join(cycle) for cycle in cycles(graph))


def _code_strings(path: Path) -> list[str]:
    """The string constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    strings = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return [node.value for node in strings if id(node) not in docstrings]


def test_privacy_imports_no_lightning_and_names_no_strategy() -> None:
    """``dplit/privacy/`` is plain PyTorch: no Lightning import, and no strategy's name but the refusals' default one."""
    for path in (PACKAGE / "privacy").rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not any(name.split(".")[0] in ("lightning", "pytorch_lightning") for name in imported), path
        lines = [line for line in path.read_text().splitlines() if line != 'DEFAULT_OWNER = "DPStrategy"']
        named = [line.strip() for line in lines if re.search(r"\bDPStrategy\b|ShardedDPStrategy", line)]
        assert not named, f"{path.relative_to(PACKAGE)} names a strategy in {named[0]!r}: write refusal.OWNER"


def test_the_strategy_name_check_sees_a_name() -> None:
    assert re.search(r"\bDPStrategy\b|ShardedDPStrategy", "set DPStrategy.noise_multiplier")
    assert not re.search(r"\bDPStrategy\b|ShardedDPStrategy", "DPSGD's settings")


def package_graph() -> dict[str, set[str]]:
    """The import graph between dplit's top-level parts (``dplit.cli``, ``dplit.privacy``, ``dplit.strategy``, ...)."""

    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(part(module), set()).update(part(target) for target in targets if part(target) != part(module))
    return graph


def test_dplit_has_no_import_cycle_between_packages() -> None:
    """No package imports one that imports it back (through any module): each part is a layer."""
    graph = package_graph()
    assert {"dplit.cli", "dplit.audit", "dplit.privacy"} <= set(graph) and "dplit.privacy" in graph["dplit.cli"]
    assert cycles(graph) == [], " ; ".join(" -> ".join(cycle) for cycle in cycles(graph))


LAYERS = (
    ("dplit", "dplit.numbers"),
    ("dplit.flag_types",),
    ("dplit.privacy", "dplit.backbone"),
    ("dplit.strategy", "dplit.tasks", "dplit.callbacks"),
    ("dplit.data",),
    ("dplit.release", "dplit.audit"),
    ("dplit.cli",),
    ("dplit.__main__", "dplit.lm", "dplit.model", "dplit.embeddings"),
)
"""dplit's parts, bottom layer first: a part imports only parts of the layers below its own."""


def arrows_up(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Every import that points to the part's own layer or above (``a -> b``)."""
    layer = {part: index for index, parts in enumerate(layers) for part in parts}
    return [f"{a} -> {b}" for a, targets in sorted(graph.items()) for b in sorted(targets) if layer[b] >= layer[a]]


def test_the_layer_check_sees_an_arrow_up() -> None:
    layers = (("low",), ("high", "peer"))
    assert arrows_up({"low": {"high"}, "high": {"low"}, "peer": set()}, layers) == ["low -> high"]
    assert arrows_up({"low": set(), "high": {"peer"}, "peer": set()}, layers) == ["high -> peer"]


def test_every_import_between_parts_points_down_a_layer() -> None:
    """0 arrows up: each part of dplit has its layer, and imports only from the layers below it."""
    graph = package_graph()
    placed = {part for parts in LAYERS for part in parts}
    assert set(graph) <= placed, f"place {sorted(set(graph) - placed)} in a layer of LAYERS"
    assert arrows_up(graph, LAYERS) == []
