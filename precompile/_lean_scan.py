"""Reading a generated wrapper module for the lean path: what in its source keeps it off
the lean path's stand-ins, the ``extern_kernels`` it calls, the Triton kernels it creates.
Pure Python (``ast``): nothing of torch runs here."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from precompile.runtime.compiler_interface import dotted_name

from . import _torch_adapter as adapter

# torch.ops namespaces of torch's own operators: a call into any other namespace is a
# user's custom op, which AOTAutograd checks for aliasing on a graph's first call. The
# collectives' namespaces are torch's own, and AOTAutograd's check leaves them out too
# (``_AnalyzeCustomOpInputOutputMode``, torch 2.10+): a graph running collectives is lean.
BUILTIN_OP_NAMESPACES = frozenset(
    {"aten", "prim", "prims", "inductor", "quantized", "_quantized", "mkldnn", "onednn",
     "_c10d_functional", "c10d"}
)  # fmt: skip

# What inductor's GPU wrapper modules import besides the CPU ones: the bandwidth
# profiler's markers (never called on the lean path: checked below) and Triton itself,
# named only inside kernel source strings, which the lean path never compiles.
_GPU_LEAN_IMPORTS = {
    "torch._inductor.runtime.triton_heuristics": frozenset({"start_graph", "end_graph"})
}
_GPU_LEAN_MODULES = frozenset({"triton", "triton.language"})
_UNCALLED_ON_GPU = frozenset({"start_graph", "end_graph", "triton", "tl"})


def _executed_nodes(tree: Any) -> Iterator[Any]:
    """Every AST node of a wrapper module that loading or calling it can run: all but
    inductor's benchmark helpers and the ``if __name__ == "__main__"`` block."""
    for statement in tree.body:
        if isinstance(statement, ast.FunctionDef) and statement.name in adapter.UNCALLED_HELPERS:
            continue
        if (
            isinstance(statement, ast.If)
            and isinstance(statement.test, ast.Compare)
            and dotted_name(statement.test.left) == "__name__"
        ):
            continue
        yield from ast.walk(statement)


@dataclass(frozen=True)
class SourceScan:
    """What a generated wrapper module needs of the lean path: why it cannot run there
    (empty if it can), the ``extern_kernels`` it uses, the Triton kernels it creates."""

    blockers: tuple[str, ...]
    externs: tuple[str, ...]
    triton_kernels: tuple[str, ...]


def scan_lean_source(source: str, *, gpu: bool = False) -> SourceScan:
    """Read a generated wrapper module for the lean path (``gpu``: a CUDA variant whose
    Triton kernels are launched from their binaries)."""
    blockers: list[str] = []
    externs: set[str] = set()
    kernels: list[str] = []
    tree = ast.parse(source)
    defined = set()
    allowed_imports = {**adapter.LEAN_IMPORTS, **(_GPU_LEAN_IMPORTS if gpu else {})}
    for node in _executed_nodes(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                blockers.append(f"a relative import of {module}")
            elif module.startswith(adapter.COMPILER_PACKAGES):
                allowed = allowed_imports.get(module, frozenset())
                names = {alias.name for alias in node.names}
                if not names <= allowed:
                    blockers.append(f"imports {sorted(names - allowed)} from {module}")
            elif module == "triton" or module.startswith("triton."):
                blockers.append(f"imports from {module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(adapter.COMPILER_PACKAGES) or (
                    alias.name.partition(".")[0] == "triton"
                    and not (gpu and alias.name in _GPU_LEAN_MODULES)
                ):
                    blockers.append(f"imports {alias.name}")
        elif (
            gpu
            and isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "async_compile"
            and node.func.attr == "triton"
        ):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                kernels.append(first.value)
            else:
                blockers.append("creates a Triton kernel with no literal name")
        elif (
            gpu
            and isinstance(node, ast.Name)
            and isinstance(node.ctx, ast.Load)
            and node.id in _UNCALLED_ON_GPU
        ):
            blockers.append(f"uses {node.id} outside its imports")
        elif isinstance(node, ast.Attribute):
            path = dotted_name(node) or ""
            if path.startswith(adapter.COMPILER_PACKAGES):
                blockers.append(f"uses {path}")
            elif path.startswith("torch.ops.") and path.count(".") >= 2:
                namespace = path.split(".")[2]
                if namespace not in BUILTIN_OP_NAMESPACES:
                    blockers.append(f"calls custom operators (torch.ops.{namespace})")
            elif isinstance(node.value, ast.Name) and node.value.id == "extern_kernels":
                externs.add(node.attr)
            elif (
                isinstance(node.value, ast.Name)
                and node.value.id == "async_compile"
                and node.attr not in ("cpp_pybinding", "wait", *(("triton",) if gpu else ()))
            ):
                blockers.append(f"compiles kernels with async_compile.{node.attr}")
        if isinstance(node, ast.Name) and node.id in ("extern_kernels", "async_compile"):
            defined.add(node.id)
    for statement in tree.body:
        if isinstance(statement, ast.Assign):
            for target in statement.targets:
                if isinstance(target, ast.Name):
                    defined.add(target.id)
    if "call" not in defined:
        blockers.append("defines no module-level call")
    if len(set(kernels)) != len(kernels):
        blockers.append("creates a Triton kernel name twice")
    return SourceScan(tuple(dict.fromkeys(blockers)), tuple(sorted(externs)), tuple(kernels))
