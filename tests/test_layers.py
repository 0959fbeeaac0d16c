"""Imports flow one way (docs/design.md): a module never imports a layer above its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# layer -> the layers of ours it may import (itself always allowed)
ALLOWED = {
    "schemas": set(),
    "transforms": {"schemas"},
    "models": set(),
    "scorers": {"models", "transforms", "schemas"},
    "trainers": {"models", "schemas"},
    "pipelines": {"transforms", "scorers", "schemas"},
    "workflows": {"pipelines", "trainers", "scorers", "models", "transforms", "schemas"},
}
LAYERS = set(ALLOWED) | {"benchmarks", "data"}


def imported_layers(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    layers = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "entroweight" and len(parts) > 1 and parts[1] in LAYERS:
                layers.add(parts[1])
    return layers


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_flow_one_way(layer):
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for other in imported_layers(path) - ALLOWED[layer] - {layer}:
            bad.append(f"{path.relative_to(ROOT)} imports entroweight.{other}")
    assert not bad, "imports reaching up the layers:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", ["storage.py", "options.py", "allocator.py", "output.py"])
def test_the_package_roots_shared_modules_are_below_every_layer(module):
    """entroweight/storage.py (the storage layer) and entroweight/options.py (how a refusal of options
    is worded) serve every layer, schemas included, so they import none of them."""
    assert imported_layers(ROOT / "entroweight" / module) == set()


# workflows/' concerns, top to bottom: each imports only those below it (docs/design.md)
WORKFLOWS = ("cli", "engine", "report")


def _workflows_module(path: Path) -> str:
    rel = path.relative_to(ROOT / "workflows").with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__")


def _workflows_imports(path: Path) -> set[str]:
    """The modules of workflows/ that `path` imports (absolute or relative, at any depth of the file)."""
    package = _workflows_module(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
                found |= {f"{name}.{a.name}".strip(".") for a in node.names} if not node.module else {name}
            elif node.module and node.module.startswith("entroweight.workflows."):
                found.add(node.module.removeprefix("entroweight.workflows."))
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix("entroweight.workflows.")
                for a in node.names
                if a.name.startswith("entroweight.workflows.")
            }
    return found


def _concern(module: str) -> int:
    """A module's place in the order: 0 for cli, 1 engine, 2 report, 3 the modules they share."""
    top = module.split(".")[0]
    return WORKFLOWS.index(top) if top in WORKFLOWS else len(WORKFLOWS)


def test_workflows_concerns_flow_one_way():
    bad = []
    for path in sorted((ROOT / "workflows").rglob("*.py")):
        mine = _workflows_module(path)
        for other in _workflows_imports(path):
            if _concern(other) < _concern(mine):
                bad.append(f"workflows/{path.relative_to(ROOT / 'workflows')} imports {other}")
    assert not bad, "imports reaching up workflows/' concerns:\n" + "\n".join(bad)


def test_workflows_modules_import_no_circle():
    """No two modules of workflows/ import each other, through any chain (function-level imports too)."""
    graph = {}
    for path in sorted((ROOT / "workflows").rglob("*.py")):
        graph[_workflows_module(path)] = _workflows_imports(path)
    modules = set(graph)
    graph = {m: {o for o in deps if o in modules and o != m} for m, deps in graph.items()}

    def reach(start):
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        return seen

    circles = sorted(m for m in graph if m in reach(m) and m != "")
    assert not circles, f"modules of workflows/ in an import circle: {circles}"
