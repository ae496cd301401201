"""The three packages import in one direction: precompile -> runtime -> cache.

Checked twice: by importing every module of a package in a fresh interpreter (what is in
``sys.modules`` afterwards is what it really pulled in), and by reading every import
statement of every module, those inside functions included, so a lazy import that
points up, or one that dodges a cycle inside a package, fails too. Nothing compiles.
"""

from __future__ import annotations

import ast
import json
import os

from conftest import ROOT, run_python

# Each package, and the packages it may import (every arrow points down).
LAYERS = {
    "cache": (),
    "runtime": ("cache",),
    "precompile": ("runtime", "cache"),
}

IMPORT_ALL = """
import importlib, json, pkgutil, sys
package = importlib.import_module({package!r})
for info in pkgutil.iter_modules(package.__path__):
    if info.name != "__main__":
        importlib.import_module(f"{package}.{{info.name}}")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {above!r})))
"""


def _modules(package: str) -> dict[str, str]:
    """Every module of ``package`` (dotted name -> file)."""
    directory = os.path.join(ROOT, package)
    found = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".py"):
            stem = name[:-3]
            found[package if stem == "__init__" else f"{package}.{stem}"] = os.path.join(
                directory, name
            )
    return found


def _imports(module: str, path: str, known: set[str]) -> list[tuple[str, int]]:
    """Every module of ours that ``module`` imports (anywhere in its file), with the line.
    ``from . import x`` names the module ``x`` where there is one, else the package."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                for alias in node.names
            ]
        else:
            continue
        found += [(target, node.lineno) for target in targets if target.split(".")[0] in LAYERS]
    return found


def _all_imports() -> dict[str, list[tuple[str, int]]]:
    modules = {m: p for package in LAYERS for m, p in _modules(package).items()}
    return {m: _imports(m, p, set(modules)) for m, p in modules.items()}


def _fresh_import(package: str) -> list[str]:
    above = [p for p in LAYERS if p != package and p not in LAYERS[package]]
    out = run_python(IMPORT_ALL.format(package=package, above=above))
    loaded: list[str] = json.loads(out.strip().splitlines()[-1])
    return loaded


def test_cache_imports_neither_runtime_nor_precompile() -> None:
    assert _fresh_import("cache") == []


def test_runtime_does_not_import_precompile() -> None:
    assert _fresh_import("runtime") == []


def test_no_import_statement_points_up() -> None:
    upward = [
        f"{module}:{line} imports {target}"
        for module, targets in _all_imports().items()
        for target, line in targets
        if (home := module.split(".")[0]) != (there := target.split(".")[0])
        and there not in LAYERS[home]
    ]
    assert upward == []


def test_no_import_cycle_inside_a_package() -> None:
    """Imports inside functions count: one that exists to dodge a cycle is a cycle."""
    imports = _all_imports()
    graph = {m: {t for t, _ in found if t in imports and t != m} for m, found in imports.items()}
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen and nxt.split(".")[0] == start.split(".")[0]:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert cycles == []
