"""Imports point one way: cli -> commands -> scoring -> runtime, engines -> ops, io, modeling -> archs -> the base
modules. No
package imports one at its own level or above (so there are no cycles), function-level imports included. Inside
commands/, no command imports another command's modules: what two commands share lives in a lower layer (scoring)
or in the write path's own modules (commands/rewrite.py, report_head.py, write.py)."""

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
    "option_fields": 2,
    "archs": 2,
    "presets": 2,
    "data": 2,
    "io": 3,
    "ops": 3,
    "modeling": 3,
    "kvcache": 3,
    "param_count": 3,
    "runtime": 4,
    "engines": 4,
    "realmodels": 4,
    "scoring": 5,
    "commands": 6,
    "cli": 7,
    "api": 7,
    "__init__": 8,
    "__main__": 8,
}
#: The modules of commands/ that every writing command shares (requests and their checks, the report head, the
#: write path); every other name under commands/ is a command (a package such as analyse, or a module: export).
WRITE_PATH = {"rewrite", "report_head", "write"}


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
            else:  # the module, and each name as a submodule (from attnkit.commands import heal)
                found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
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


def _command(module: str) -> str | None:
    """attnkit.commands.heal.loop -> heal; attnkit.commands.export -> export; None outside commands/."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["attnkit", "commands"] else None


def test_no_command_imports_another_commands_modules():
    """A module of one command (e.g. commands/heal/heal.py) imports its own command's modules, the write path's
    (WRITE_PATH) and lower layers; never another command's (e.g. attnkit.commands.analyse.*, which the writers
    imported to score a rewrite). The write path's modules import no command at all."""
    crossing = []
    for path in sorted((ROOT / "commands").rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        own = _command(".".join(rel.parts))
        if own is None:  # commands/__init__.py
            continue
        for module in _imports(path):
            target = _command(module)
            if target is None or target in WRITE_PATH or target == own:
                continue
            crossing.append(f"{rel}: {module}")
    assert crossing == []


def _imported(path: Path) -> set[str]:
    """The top-level packages a Python file imports (absolute imports)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_benchmarks_and_tests_do_not_import_each_other():
    """The benchmark scripts share benchmarks/benchlib.py and attnkit (attnkit.realmodels for the real models);
    nothing under benchmarks/ imports tests/, and no test imports a benchmark."""
    root = Path(__file__).resolve().parent.parent
    scripts = sorted((root / "benchmarks").rglob("*.py"))
    benchmark_modules = {path.stem for path in scripts} | {"benchmarks"}
    assert scripts and not [str(p) for p in scripts if "tests" in _imported(p)]
    tests = sorted((root / "tests").rglob("*.py"))
    assert not [str(p) for p in tests if _imported(p) & benchmark_modules]
