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
