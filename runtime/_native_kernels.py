"""Built C++ kernels shipped inside an artifact, so that a CPU load starts no compiler.

Inductor's CPU wrapper module builds each kernel as it is imported, through
``async_compile.cpp_pybinding(argtypes, source)``: gcc runs unless a ``.so`` sits at a
path derived from the source *and* this machine's compiler command line (include paths
of this torch install among them), so a fresh machine always compiles. An artifact
carries each kernel's built ``.so`` instead; at load the wrapper's calls are redirected
to :func:`load_cpp_pybinding`, which imports the bundled binary when this CPU has the
instruction set it was built for, and otherwise builds from source with a warning.

The generated C++ is specific to the vector width it was generated for (loops step by
the ISA's lane count), so a rebuild is only correct where this machine's inductor picks
that same ISA; elsewhere loading refuses with :class:`IncompatibleArtifactError`.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import platform
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

from precompile.cache import atomic_file

from . import _torch_adapter as adapter
from ._build_dir import build_dir
from ._errors import IncompatibleArtifactError
from ._manifest import NativeKernel

log = logging.getLogger("precompile.runtime")

_CALL = re.compile(r"(?m)^([A-Za-z_]\w* = )async_compile\.cpp_pybinding\(")
_LOADER = "__precompile_cpp_pybinding__"
_IMPORT = f"from precompile.runtime._native_kernels import load_cpp_pybinding as {_LOADER}\n"
# gcc -m flags whose /proc/cpuinfo name is not the flag itself.
_FLAG_TO_CPUINFO = {
    "avx512bf16": "avx512_bf16",
    "avx512vnni": "avx512_vnni",
    "avx512vbmi2": "avx512_vbmi2",
    "avx512fp16": "avx512_fp16",
    "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq",
}


def kernel_key(argtypes: Iterable[str], source: str) -> str:
    """Identity of one kernel: what the wrapper passes to ``cpp_pybinding``."""
    return hashlib.sha256(json.dumps([list(argtypes), source]).encode()).hexdigest()


def find_cpp_kernels(wrapper_source: str) -> list[tuple[list[str], str]]:
    """The ``(argtypes, source)`` of every top-level ``cpp_pybinding`` call of a wrapper."""
    kernels = []
    for node in ast.parse(wrapper_source).body:
        call = node.value if isinstance(node, ast.Assign) else None
        if not (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "cpp_pybinding"
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "async_compile"
            and len(call.args) == 2
            and not call.keywords
        ):
            continue
        argtypes, source = ast.literal_eval(call.args[0]), ast.literal_eval(call.args[1])
        kernels.append(([str(a) for a in argtypes], str(source)))
    return kernels


def redirect_cpp_kernels(wrapper_source: str) -> str:
    """The wrapper with each ``cpp_pybinding`` call routed through our loader."""
    rewritten, count = _CALL.subn(rf"\1{_LOADER}(async_compile, ", wrapper_source)
    if not count:
        return wrapper_source
    lines = rewritten.splitlines(keepends=True)
    after = max(
        (n + 1 for n, line in enumerate(lines) if line.startswith("from __future__")), default=0
    )
    return "".join([*lines[:after], _IMPORT, *lines[after:]])


def cpu_features_for_flags(arch_flags: str) -> tuple[str, ...]:
    """The /proc/cpuinfo features that gcc ``-m`` flags (``-mavx512f -mfma``) require."""
    features = []
    for flag in arch_flags.split():
        if flag.startswith("-m") and not flag.startswith("-march") and "=" not in flag:
            name = flag[2:].replace("-", "_")
            features.append(_FLAG_TO_CPUINFO.get(name, name))
    return tuple(sorted(set(features)))


@cache
def cpu_features() -> frozenset[str] | None:
    """This CPU's feature flags, or None where the OS does not list them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return None


def why_unusable(kernel: NativeKernel) -> str | None:
    """Why this machine cannot run ``kernel``'s binary, or None if it can."""
    machine = platform.machine()
    if kernel.machine != machine:
        return f"it was built for {kernel.machine}, this machine is {machine}"
    features = cpu_features()
    if features is None:
        return "this OS does not list CPU features, so the binary's ISA cannot be checked"
    missing = sorted(set(kernel.cpu_features) - features)
    if missing:
        return f"this CPU lacks {', '.join(missing)} (the binary was built for {kernel.isa})"
    return None


@dataclass(frozen=True)
class _Entry:
    kernel: NativeKernel
    path: str | None  # the binary on disk, or None when this machine cannot run it
    reason: str | None
    read: Callable[[str], bytes]  # the artifact's verified bytes of a binary, by digest


_lock = threading.RLock()
_entries: dict[str, _Entry] = {}
_loaded: dict[str, Callable[..., Any]] = {}


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _file_digest(path: str) -> str | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    except FileNotFoundError:
        return None
    return digest.hexdigest()


def _place(entry: _Entry) -> str:
    """The kernel's binary in the build dir, holding exactly the artifact's bytes: a file
    already there (a shared PRECOMPILE_BUILD_DIR, an earlier load) is imported only if
    its sha256 is the kernel's; otherwise it is replaced."""
    assert entry.path is not None
    found = _file_digest(entry.path)
    if found != entry.kernel.binary:
        if found is not None:
            log.warning(
                "kernel binary %s does not match its sha256 (%s...); replacing it with the "
                "artifact's copy",
                entry.path,
                found[:12],
            )
        with atomic_file(entry.path, 0o700) as handle:
            handle.write(entry.read(entry.kernel.binary))
    return entry.path


def register(kernels: Iterable[NativeKernel], read: Callable[[str], bytes]) -> None:
    """Make ``kernels`` loadable by key (binaries are placed when imported)."""
    directory = os.path.join(build_dir(), "kernels")
    for kernel in kernels:
        with _lock:
            if kernel.key in _entries:
                continue
            reason = why_unusable(kernel)
            path = None if reason is not None else os.path.join(directory, f"{kernel.binary}.so")
            _entries[kernel.key] = _Entry(kernel, path, reason, read)


def load_cpp_pybinding(async_compile: Any, argtypes: list[str], source: str) -> Any:
    """What ``async_compile.cpp_pybinding`` returns, from the bundled binary where possible."""
    key = kernel_key(argtypes, source)
    with _lock:
        entry = _entries.get(key)
        function = _loaded.get(key)
        if function is not None:
            return function
        if entry is not None and entry.path is not None:
            try:
                function = adapter.import_cpp_kernel(_place(entry), f"precompile_{key[:40]}")
            except (ImportError, OSError) as exc:
                reason = f"its bundled binary does not load here ({exc})"
            else:
                _loaded[key] = function
                return function
        elif entry is not None:
            reason = entry.reason or "unknown"
        else:
            reason = "the artifact carries no binary for this source (edited or not bundled)"
    if entry is not None:
        here = adapter.vec_isa()[0]
        if here != entry.kernel.isa:
            raise IncompatibleArtifactError(
                f"C++ kernel {key[:12]} cannot run here: {reason}; and it cannot be rebuilt "
                f"from source either, because its code was generated for {entry.kernel.isa} "
                f"vectors and this machine builds for {here}: recompile the graph here"
            )
    log.warning("building C++ kernel %s from source (gcc runs): %s", key[:12], reason)
    return async_compile.cpp_pybinding(argtypes, source)
