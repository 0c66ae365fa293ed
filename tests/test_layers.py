"""Imports point one way: cli -> commands -> runtime, engines -> ops, io -> archs -> the base modules. No package
imports one at its own level or above (so there are no cycles), function-level imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "attnkit"
#: attnkit's packages and top-level modules by layer; an import must point to a lower layer.
LAYERS = {
    "errors": 0,
    "units": 1,
    "interrupts": 1,
    "progress": 1,
    "archs": 2,
    "presets": 2,
    "io": 3,
    "ops": 3,
    "kvcache": 3,
    "param_count": 3,
    "runtime": 4,
    "engines": 4,
    "commands": 5,
    "cli": 6,
    "api": 6,
    "__init__": 7,
    "__main__": 7,
}


def _package(module: str) -> str:
    """attnkit.io.writer -> io; attnkit -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("attnkit"):
            if node.module == "attnkit":  # from attnkit import interrupts; __version__ is a base fact, like errors
                found |= {
                    "attnkit.errors" if alias.name == "__version__" else f"attnkit.{alias.name}" for alias in node.names
                }
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("attnkit.")}
    return found


def test_every_package_is_in_a_layer():
    packages = {
        p.stem if p.is_file() else p.name
        for p in ROOT.iterdir()
        if (p.suffix == ".py" or (p / "__init__.py").is_file())
    }
    assert packages == set(LAYERS)


def test_imports_point_down():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        source = _package(".".join(rel.parts))
        for module in _imports(path):
            target = _package(module)
            if target != source and LAYERS[target] >= LAYERS[source]:
                upward.append(f"{rel}: {module}")
    assert upward == []
