"""Artifacts built from hand-written manifests and Python callables: dispatch logic
tested without compiling anything."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from precompile.runtime import CompiledArtifact, Manifest, Symbol, SymbolSource, Variant
from precompile.runtime.compiler_interface import MemoryPayloads, TensorInput, current_environment


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def make_artifact(
    points: Sequence[tuple[str, dict[str, int], tuple[str, ...]]],
    *,
    symbols: Sequence[str] = ("s0",),
    shape: tuple[int | str, ...] = ("s0", 4),
    memo_size: int = 4096,
    calls: list[int] | None = None,
    weight: tuple[int, ...] | None = None,
) -> CompiledArtifact:
    """One input tensor of ``shape`` (then a static one of shape ``weight``, if given);
    each variant returns its own index."""
    variants = []
    loaded: dict[str, Callable[..., Any]] = {}
    for index, (kind, point, guards) in enumerate(points):
        key = digest(f"variant-{index}")

        def run(*args: Any, _index: int = index) -> int:
            if calls is not None:
                calls.append(_index)
            return _index

        loaded[key] = run
        variants.append(Variant(index, kind, point, guards, key, key))  # type: ignore[arg-type]
    sources = {
        name: tuple(SymbolSource(0, d) for d, s in enumerate(shape) if s == name)
        for name in symbols
    }
    manifest = Manifest(
        environment=current_environment("cpu"),
        symbols=tuple(Symbol(name, sources[name]) for name in symbols),
        inputs=(
            TensorInput("float32", "cpu", shape),
            *(() if weight is None else (TensorInput("float32", "cpu", weight),)),
        ),
        variants=tuple(variants),
    )
    return CompiledArtifact(manifest, MemoryPayloads({}), loaded=loaded, memo_size=memo_size)
