"""Every private torch API the runtime touches, in one place, so a torch upgrade edits one file.

A variant's payload is upstream's bundled AOTAutograd entry (the ``aot=True`` format of
``torch._inductor.standalone_compile``): self-contained, with no FX-graph-cache key to
look up, so variants cannot collide with each other or with the user's inductor cache.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("precompile.runtime")

# Inductor reads its cache location from os.environ each time; every swap of it, ours and
# any of our loads, happens under this lock so that our threads never see another's dir.
INDUCTOR_LOCK = threading.RLock()
_build_dir: str | None = None


def build_dir() -> str:
    """A directory private to this process for generated modules and built kernels."""
    global _build_dir
    with INDUCTOR_LOCK:
        if _build_dir is None:
            configured = os.environ.get("PRECOMPILE_BUILD_DIR")
            if configured:
                os.makedirs(configured, mode=0o700, exist_ok=True)
                _build_dir = configured
            else:
                _build_dir = tempfile.mkdtemp(prefix="precompile-build-")
                atexit.register(shutil.rmtree, _build_dir, ignore_errors=True)
        return _build_dir


@contextmanager
def inductor_cache_dir(directory: str) -> Iterator[None]:
    """Point inductor's cache at ``directory`` for the duration (under INDUCTOR_LOCK)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with INDUCTOR_LOCK, temporary_cache_dir(directory):
        yield


def _unpickle_bundle(payload: bytes) -> tuple[Any, Any, Any]:
    bundle = pickle.loads(payload)
    if not (isinstance(bundle, tuple) and len(bundle) == 3):
        raise ValueError("payload is not a bundled AOTAutograd entry")
    return bundle  # type: ignore[return-value]


def forward_graph(bundle_entry: Any) -> Any:
    """The inductor CompiledFxGraph of the forward inside a bundled entry."""
    return bundle_entry.compiled_fw.result


def variant_source_code(payload: bytes) -> str:
    entry, _, _ = _unpickle_bundle(payload)
    return str(forward_graph(entry).source_code)


def with_source_code(payload: bytes, source_code: str) -> bytes:
    """The payload with its forward wrapper module replaced (the unpacked format's edits)."""
    entry, kernels, constant_args = _unpickle_bundle(payload)
    graph = forward_graph(entry)
    graph.source_code = source_code
    # A new key gives the edited module its own file and module-cache slot.
    graph.cache_key = "p" + hashlib.sha256(source_code.encode()).hexdigest()[:51]
    return pickle.dumps((entry, kernels, constant_args))


def load_variant(payload: bytes) -> Callable[..., Any]:
    """Turn verified payload bytes into a callable taking the graph's flat inputs."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    with inductor_cache_dir(build_dir()):
        loaded = BundledAOTAutogradSerializableCallable.deserialize_compile_artifacts(payload)
    compiled: Callable[..., Any] = loaded.compiled_fn
    return compiled


def variant_code_digest(payload: bytes) -> str:
    """sha256 over the generated code (forward, and backward if any): equal means same code."""
    entry, _, _ = _unpickle_bundle(payload)
    digest = hashlib.sha256(forward_graph(entry).source_code.encode())
    backward = getattr(entry, "compiled_bw", None)
    result = getattr(backward, "result", None)
    if result is not None and hasattr(result, "source_code"):
        digest.update(b"\0backward\0" + result.source_code.encode())
    return digest.hexdigest()
