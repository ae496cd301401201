"""Artifacts and cache calls that need no compile, shared by the cache's tests, their
subprocess scripts and the tests that read a cache through its CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import precompile
from precompile.cache import sha256_hex
from precompile.runtime import Manifest, Symbol, SymbolSource, Variant
from precompile.runtime.compiler_interface import (
    MemoryPayloads,
    TensorInput,
    current_environment,
    store_artifact,
)
from precompile.runtime.compiler_interface import load_cached_artifact as load_cached

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

put = store_artifact
get = load_cached


def _artifact_of(payload: bytes) -> precompile.CompiledArtifact:
    """An artifact of one hint variant whose payload is ``payload`` (never run)."""
    digest = sha256_hex(payload)
    manifest = Manifest(
        environment=current_environment("cpu"),
        symbols=(Symbol("s0", (SymbolSource(0, 0),)),),
        inputs=(TensorInput("float32", "cpu", ("s0", 4)),),
        variants=(Variant(0, "hint", {"s0": 8}, (), digest, digest),),
    )
    return precompile.CompiledArtifact(manifest, MemoryPayloads({digest: payload}))


def fake_artifact(seed: int, size: int = 2000) -> precompile.CompiledArtifact:
    return _artifact_of(bytes((seed * 7 + i) % 251 for i in range(size)))


def random_artifact(size: int) -> precompile.CompiledArtifact:
    """An artifact whose one payload is ``size`` random (incompressible) bytes."""
    return _artifact_of(os.urandom(size))


def key_of(n: int) -> str:
    return sha256_hex(f"key-{n}".encode())


def cache_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m precompile cache ARGS`` from the repository's root."""
    return subprocess.run(
        [sys.executable, "-m", "precompile", "cache", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "1000"},  # no cell cut to the terminal's width
    )
