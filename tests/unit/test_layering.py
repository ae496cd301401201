"""One import name, three layers importing in one direction: precompile ->
precompile.runtime -> precompile.cache.

Checked twice: by importing every module of a package in a fresh interpreter (what is in
``sys.modules`` afterwards is what it really pulled in), and by reading every import
statement of every module, those inside functions included, so a lazy import that
points up, or one that dodges a cycle inside a package, fails too. Nothing compiles.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, run_python

# Each layer, and the layers it may import (every arrow points down).
LAYERS = {
    "precompile.cache": (),
    "precompile.runtime": ("precompile.cache",),
    "precompile": ("precompile.runtime", "precompile.cache"),
}
# Each layer's folder in the repository (installed as the package on the left).
FOLDERS = {"precompile.cache": "cache", "precompile.runtime": "runtime", "precompile": "precompile"}


def layer(module: str) -> str | None:
    """The layer a dotted module name belongs to (None: not ours)."""
    for name in ("precompile.cache", "precompile.runtime"):
        if module == name or module.startswith(name + "."):
            return name
    return "precompile" if module.split(".")[0] == "precompile" else None


IMPORT_ALL = """
import importlib, json, pkgutil, sys
package = importlib.import_module({package!r})
for info in pkgutil.iter_modules(package.__path__):
    if info.name != "__main__":
        importlib.import_module(f"{package}.{{info.name}}")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "precompile")))
"""


def _modules(package: str) -> dict[str, str]:
    """Every module of ``package`` (dotted name -> file)."""
    directory = os.path.join(ROOT, FOLDERS[package])
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
        found += [(target, node.lineno) for target in targets if layer(target)]
    return found


def _all_imports() -> dict[str, list[tuple[str, int]]]:
    modules = {m: p for package in LAYERS for m, p in _modules(package).items()}
    return {m: _imports(m, p, set(modules)) for m, p in modules.items()}


def _fresh_import(package: str) -> list[str]:
    """Modules of the layers above ``package`` that importing all of it loads (the
    ``precompile`` package object itself, whose ``__init__`` imports nothing, excepted)."""
    above = [p for p in LAYERS if p != package and p not in LAYERS[package]]
    out = run_python(IMPORT_ALL.format(package=package))
    loaded: list[str] = json.loads(out.strip().splitlines()[-1])
    return [m for m in loaded if m != "precompile" and layer(m) in above]


def test_cache_imports_neither_runtime_nor_precompile() -> None:
    assert _fresh_import("precompile.cache") == []


def test_runtime_does_not_import_precompile() -> None:
    assert _fresh_import("precompile.runtime") == []


def test_no_import_statement_points_up() -> None:
    upward = [
        f"{module}:{line} imports {target}"
        for module, targets in _all_imports().items()
        for target, line in targets
        if (home := layer(module)) != (there := layer(target)) and there not in LAYERS[home or ""]
    ]
    assert upward == []


# The one door left in a wall: the compile side's torch adapter shares the runtime's
# torch plumbing (inductor's loaders, the compiler-module list of the lean path). Both
# are adapters: what they share is private torch API, not policy.
DOORS = {("precompile._torch_adapter", "precompile.runtime._torch_adapter")}


# A layer's faces: its package, and the runtime's seam for the compile side (the names
# precompile builds against, kept out of the runtime's user-facing ``__all__``).
SEAM = "precompile.runtime.compiler_interface"
FACES = {*LAYERS, SEAM}


def test_layers_meet_only_at_their_public_faces() -> None:
    """An import from another layer names one of that layer's faces (its package, or the
    runtime's seam for the compile side), never one of its private modules: a rename
    inside the runtime breaks nothing above it. Every import statement counts, those
    inside functions too; only the compile side uses the seam."""
    imports = _all_imports()
    through_walls = {
        (module, target)
        for module, targets in imports.items()
        for target, _ in targets
        if layer(module) != layer(target) and target not in FACES
    }
    assert through_walls == DOORS
    seam_users = {m for m, targets in imports.items() for t, _ in targets if t == SEAM}
    assert {layer(m) for m in seam_users} == {"precompile"}, seam_users


def _face_tables(path: Path) -> tuple[set[str], set[str], set[str]]:
    """A face module's names three ways: imported under ``TYPE_CHECKING`` (what type
    checkers see), keys of its ``_LAZY`` table (what runs), and its ``__all__``."""
    tree = ast.parse(path.read_text())
    typed: set[str] = set()
    lazy: set[str] = set()
    listed: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in ast.walk(node):
                if isinstance(stmt, ast.ImportFrom):
                    typed |= {a.asname or a.name for a in stmt.names}
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name == "_LAZY" and isinstance(node.value, ast.Dict):
                lazy = {ast.literal_eval(k) for k in node.value.keys if k is not None}
            elif name == "__all__":
                listed = set(ast.literal_eval(node.value))
    return typed, lazy, listed


@pytest.mark.parametrize("face", ["runtime/__init__.py", "runtime/compiler_interface.py"])
def test_each_lazy_face_writes_its_names_alike(face: str) -> None:
    """Each name of a lazy face is written three times (for type checkers, for the
    import, in ``__all__``): the three must agree, or a name is typed but missing at run
    time, or importable but unlisted."""
    typed, lazy, listed = _face_tables(Path(ROOT) / face)
    assert typed == lazy, typed ^ lazy
    assert lazy <= listed, lazy - listed
    if face.endswith("compiler_interface.py"):
        assert listed == lazy, listed ^ lazy


def test_each_face_lists_what_it_serves() -> None:
    """Every name of a layer's ``__all__`` resolves (lazily imported ones included)."""
    code = """
import importlib
for name in ("precompile.cache", "precompile.runtime", "precompile",
             "precompile.runtime.compiler_interface"):
    package = importlib.import_module(name)
    missing = [n for n in package.__all__ if not hasattr(package, n)]
    assert not missing, (name, missing)
print("ok")
"""
    assert run_python(code).strip().endswith("ok")


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
                elif nxt not in seen and layer(nxt) == layer(start):
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert cycles == []


# an import at a line's start, or in code held by a string (after a quote or a "\n")
OLD_NAMES = re.compile(r"""(?:^|["';]|\\n)\s*(?:from|import)\s+(?:cache|runtime)\b""", re.M)


def test_no_file_imports_the_old_top_level_names() -> None:
    """``cache`` and ``runtime`` are folders, never import names: every file of the
    repository (code in strings run by subprocesses included) imports
    ``precompile.cache`` / ``precompile.runtime``."""
    listed = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(listed) > 50, listed
    old = [
        f"{name}:{text.count(chr(10), 0, match.start()) + 1}"
        for name in listed
        for text in [Path(ROOT, name).read_text(encoding="utf-8")]
        for match in OLD_NAMES.finditer(text)
    ]
    assert old == []


@pytest.mark.subprocess
def test_the_wheel_installs_one_top_level_name(tmp_path: Path) -> None:
    """A wheel built from the repository holds ``precompile`` (with ``precompile.cache``
    and ``precompile.runtime``) and its metadata, nothing else at the top level."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), ROOT],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("precompile-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"precompile"}, top
    for package in ("precompile", "precompile/cache", "precompile/runtime"):
        assert f"{package}/__init__.py" in names and f"{package}/py.typed" in names, package
    assert "precompile/runtime/_artifact.py" in names and "precompile/cache/_store.py" in names


# Tests and benchmarks use the public API, except where their subject is an internal
# module (named here), or where they instrument the compile side (count compiles by
# wrapping its compile_variant). A new private import anywhere else fails this test.
INTERNAL_SUBJECTS = {
    # build diagnostics: phases timed, the template-precompile patch left out for "torch default"
    "benchmarks/_autotune_diag.py": {
        "precompile._standalone", "precompile._torch_adapter", "precompile._variant_compile"
    },
    "benchmarks/_gpu_load_diag.py": {"precompile.runtime._torch_adapter"},  # load diagnostics
    "benchmarks/dispatch.py": {  # times the per-call checks one by one
        "precompile._compiled_payload", "precompile._graph_description",
        "precompile._standalone", "precompile._torch_adapter", "precompile._trace_read",
        "precompile.runtime._global_state", "precompile.runtime._model_guards",
    },
    # times each remote lease wait
    "tests/tensor_parallel_helpers.py": {"precompile.cache._tier"},
    "tests/compile/test_backend.py": {  # the backend's graph reading and variant planning
        "precompile._backend", "precompile._graph", "precompile._standalone",
        "precompile._variant_plan",
    },
    "tests/fleet/test_cache.py": {  # the key's factors; counts compiles
        "precompile._attention_policy", "precompile._cache_key",
        "precompile._graph_description", "precompile._graph_name", "precompile._standalone",
        "precompile._variant_compile", "precompile._variant_plan", "precompile.cache._store",
    },
    "tests/compile/test_compile.py": {"precompile._variant_compile"},  # counts compiles
    # the worker count's variable; a worker killed while it compiles
    "tests/compile/test_variant_workers.py": {  # and the code digest workers are held to
        "precompile._variant_workers", "precompile._compiled_payload", "precompile._torch_adapter"
    },
    "tests/compile/test_cudagraphs.py": {"precompile.runtime._cudagraphs"},
    # the decode loop driven by a plain callable: a refusal checked without a compile;
    # serve_generate's routing keys compared with its per-step signatures; step-graph keys
    # made from Sampling values; a prepared server's requests counted by compile_variant
    "tests/models/test_decode.py": {
        "precompile._generate",
        "precompile._variant_compile",
        "precompile.runtime._cudagraphs",
        "precompile.runtime._decode_loop",
        "precompile.runtime._sampling",
    },
    # a prepared server's requests on the compiled loop counted by compile_variant
    "tests/models/test_generate_loop.py": {"precompile._variant_compile"},
    # the installed torch's standalone_compile parameters; a failing compile
    "tests/compile/test_dropin.py": {"precompile._torch_adapter", "precompile._variant_compile"},
    "tests/unit/test_expressions.py": {"precompile.runtime._expressions"},
    "tests/unit/test_code_digest.py": {"precompile.runtime._model_identity"},  # its subject
    "tests/compile/test_formats.py": {"precompile.runtime._binary_format"},
    "tests/unit/test_gemm_policy.py": {
        "precompile._cache_key", "precompile._compiler_config", "precompile._gemm_policy",
        "precompile._standalone", "precompile._variant_plan",
    },
    "tests/gpu/test_gpu.py": {"precompile.runtime._torch_adapter"},
    # the build's configs
    "tests/gpu/test_gpu_lean.py": {"precompile._compiler_config", "precompile._torch_adapter"},
    "tests/compile/test_hostile_files.py": {"precompile.runtime._binary_format"},  # crafts files
    "tests/models/test_model.py": {"precompile._model", "precompile.runtime._binary_format"},
    "tests/fleet/test_remote.py": {"precompile.cache._deadline", "precompile.cache._signing"},
    # the outlining pass and the graph digest it must change
    "tests/compile/test_random_ops.py": {"precompile._random_policy"},  # which nodes draw
    "tests/compile/test_repeated_blocks.py": {
        "precompile._cache_key", "precompile._random_policy", "precompile._repeated_blocks",
    },
    "tests/unit/test_settings.py": {"precompile._offline", "precompile.runtime._lean"},
    "tests/unit/test_loop_request.py": {"precompile._generate_loop"},  # which calls it takes
    "tests/unit/test_relocate.py": {"precompile.runtime._relocate"},  # a wrapper's device moved
    "tests/unit/test_device_index_key.py": {"precompile._cache_key", "precompile._graph"},
    "tests/unit/test_graph_release.py": {"precompile.runtime._decode_graphs"},  # stand-ins
    "tests/compile/test_signing.py": {
        "precompile.runtime._binary_format", "precompile.runtime._manifest",
    },
    # what a variant compile scope changes in torch, and that it is put back
    "tests/unit/test_compile_scope.py": {
        "precompile._torch_adapter", "precompile._variant_compile", "precompile._vec_isa_probe",
    },
    "tests/compile/test_trace_read.py": {"precompile._torch_adapter", "precompile._trace_read"},
    "tests/unit/test_triton_launch.py": {
        "precompile._lean_scan", "precompile.runtime._lean", "precompile.runtime._triton_launch",
    },
    "tests/unit/test_variant_plan.py": {"precompile._standalone", "precompile._variant_plan"},
    "tests/fleet/test_warm_start.py": {
        "precompile._torch_adapter", "precompile.runtime._native_kernels",
    },
    "tests/unit/test_warmup_schedule.py": {"precompile.runtime._warmup"},  # when a warm-up runs
}  # fmt: skip


def _private_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "precompile":
                continue
            if any(part.startswith("_") for part in node.module.split(".")[1:]):
                found.add(node.module)
            else:
                found |= {f"{node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")}  # fmt: skip
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "precompile"
                      and any(p.startswith("_") for p in a.name.split(".")[1:])}  # fmt: skip
    return found


def test_tests_and_benchmarks_use_the_public_api() -> None:
    files = [*Path(ROOT, "tests").rglob("*.py"), *Path(ROOT, "benchmarks").glob("*.py"),
             *Path(ROOT, "examples").glob("*.py")]  # fmt: skip
    found = {
        str(path.relative_to(ROOT)): imports
        for path in sorted(files)
        if (imports := _private_imports(path))
    }
    assert found == INTERNAL_SUBJECTS


def test_the_folders_refuse_their_old_names() -> None:
    """From a checkout's root (on ``sys.path``), ``import runtime`` would load a second copy
    of every module, which the real ``precompile.runtime`` never sees (a patch of it does
    nothing): refused, naming the right import."""
    out = run_python(
        """
for name in ("cache", "runtime"):
    try:
        __import__(name)
    except ImportError as exc:
        print(name, "refused:", exc)
"""
    )
    assert "cache refused: import precompile.cache, not cache" in out, out
    assert "runtime refused: import precompile.runtime, not runtime" in out, out


# Exceptions of ours that never reach a caller: each is raised and caught inside the
# library, as a signal between two of its modules.
INTERNAL_SIGNALS = {
    "precompile.cache._deadline.RemoteTimeout",  # a remote call's deadline: logged, local copy
    "precompile.runtime._cudagraphs.CaptureFailed",  # a failed capture: the call's outputs kept
    "precompile.runtime._torch_adapter.LeanImportRefused",  # a lean load: upstream's path runs
    "precompile.runtime._model_guards.Unencodable",  # a value a model guard cannot record
    "precompile.runtime._relocate.RelocationRefused",  # why to() refuses: said in its error
    "precompile._kernel_checks._Unparsed",  # kernel source the index checks cannot read
    "precompile._torch_adapter._TunedConfigNotBuilt",  # an autotuned config not in the kernel
    "precompile._trace_read._Untranslatable",  # a guard the trace reader cannot translate
}

ERROR_CLASSES = """
import importlib, inspect, json, pkgutil
found = {}
for package in ("precompile.cache", "precompile.runtime", "precompile"):
    module = importlib.import_module(package)
    names = [package] + [f"{package}.{i.name}" for i in pkgutil.iter_modules(module.__path__)
                         if i.name != "__main__"]
    for name in names:
        for value in vars(importlib.import_module(name)).values():
            if (inspect.isclass(value) and issubclass(value, BaseException)
                    and value.__module__.split(".")[0] == "precompile"):
                found[f"{value.__module__}.{value.__qualname__}"] = value
errors = importlib.import_module("precompile.errors")
listed = {f"{getattr(errors, n).__module__}.{n}" for n in errors.__all__}
faces = {
    package: sorted(n for n in importlib.import_module(package).__all__
                    if inspect.isclass(getattr(importlib.import_module(package), n))
                    and issubclass(getattr(importlib.import_module(package), n), BaseException))
    for package in ("precompile.cache", "precompile.runtime", "precompile")
}
print(json.dumps({"defined": sorted(found), "listed": sorted(listed), "faces": faces,
                  "private_alls": {m: sorted(importlib.import_module(m).__all__)
                                   for m in ("precompile.cache._errors",
                                             "precompile.runtime._errors")},
                  "defined_in": {m: sorted(n for n, v in vars(importlib.import_module(m)).items()
                                           if inspect.isclass(v) and v.__module__ == m)
                                 for m in ("precompile.cache._errors",
                                           "precompile.runtime._errors")}}))
"""


def test_precompile_errors_lists_every_error_class() -> None:
    """``precompile.errors`` lists every exception class defined anywhere in the three
    packages (but the internal signals above), each where it is defined; each private
    errors module's ``__all__`` lists all its classes (the runtime's the cache's too,
    which it re-exports); and each face keeps serving the errors it served (``precompile``
    and the runtime all of them, the cache its own)."""
    found = json.loads(run_python(ERROR_CLASSES).strip().splitlines()[-1])
    defined = set(found["defined"])
    assert defined - INTERNAL_SIGNALS == set(found["listed"])
    assert defined >= INTERNAL_SIGNALS, INTERNAL_SIGNALS - defined
    in_cache = found["defined_in"]["precompile.cache._errors"]
    in_runtime = found["defined_in"]["precompile.runtime._errors"]
    assert found["private_alls"]["precompile.cache._errors"] == in_cache
    assert found["private_alls"]["precompile.runtime._errors"] == sorted(in_cache + in_runtime)
    listed = {name.rsplit(".", 1)[1] for name in found["listed"]}
    assert set(found["faces"]["precompile"]) == listed
    assert set(found["faces"]["precompile.runtime"]) == listed
    assert set(found["faces"]["precompile.cache"]) == set(in_cache)
