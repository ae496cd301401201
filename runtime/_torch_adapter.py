"""Every private torch API the runtime touches, in one place, so a torch upgrade edits one file.

A variant's payload is upstream's bundled AOTAutograd entry (the ``aot=True`` format of
``torch._inductor.standalone_compile``): self-contained, with no FX-graph-cache key to
look up, so variants cannot collide with each other or with the user's inductor cache.

Loading writes the generated wrapper modules (and, on GPU, the bundled Triton binaries)
where inductor's ``cache_dir()`` points. Instead of swapping ``TORCHINDUCTOR_CACHE_DIR``
in ``os.environ`` as upstream does (process-wide, racy), ``cache_dir()`` is wrapped once
to consult a context variable: only the loading thread sees our private directory; every
other caller, and this thread outside a load, gets inductor's own answer unchanged.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import pickle
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ._build_dir import build_dir

log = logging.getLogger("precompile.runtime")

# Loads are serialized: upstream's deserialization mutates process-wide tables.
LOAD_LOCK = threading.RLock()
_redirect: ContextVar[str | None] = ContextVar("precompile_inductor_dir", default=None)


def _after_fork_in_child() -> None:
    """A lock held by another thread at fork would never be released in the child."""
    global LOAD_LOCK
    LOAD_LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# What loading a payload and importing its generated wrapper import. They are Python
# modules of torch's compiler stack (Dynamo comes with any of them: ~1.4 s on a 2-core
# CPU), paid once per process; importing them with the runtime puts that cost at import
# time, so that load() and the first call have the short, predictable latency a server
# needs for its first request.
_RUNTIME_MODULES = (
    "torch._dynamo.aot_compile_types",
    "torch._functorch._aot_autograd.aot_autograd_result",
    "torch._inductor.async_compile",
    "torch._inductor.codecache",
    "torch._inductor.codegen.memory_planning",
    "torch._inductor.hooks",
    "torch._inductor.output_code",
    "torch._inductor.select_algorithm",
    "torch._inductor.utils",
)


def import_runtime_modules() -> None:
    """Import the torch modules that loading and running a variant need."""
    for name in _RUNTIME_MODULES:
        importlib.import_module(name)


def _install_cache_dir_redirect() -> None:
    """Wrap inductor's ``cache_dir()`` (once) so that ``_redirect`` overrides it per thread."""
    from torch._inductor.runtime import cache_dir_utils

    original = cache_dir_utils.cache_dir
    if getattr(original, "__precompile_redirect__", False):
        return

    def cache_dir() -> str:
        directory = _redirect.get()
        return directory if directory is not None else original()

    cache_dir.__precompile_redirect__ = True  # type: ignore[attr-defined]
    cache_dir_utils.cache_dir = cache_dir
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.") and getattr(module, "cache_dir", None) is original:
            module.cache_dir = cache_dir  # type: ignore[attr-defined]


@contextmanager
def private_inductor_dir(directory: str) -> Iterator[None]:
    """Inductor's cache dir is ``directory`` in this thread (context) only, for the duration."""
    with LOAD_LOCK:
        _install_cache_dir_redirect()
    token = _redirect.set(directory)
    try:
        yield
    finally:
        _redirect.reset(token)


_loading: ContextVar[bool] = ContextVar("precompile_loading", default=False)
# What inductor's backend hash reads during our loads, where nothing uses it.
DEFERRED_BACKEND_HASH = "PRECOMPILE-LOAD-BACKEND-HASH-UNUSED"


def _remote_autotune_cache_on() -> bool:
    from torch._inductor import config as inductor_config

    return bool(
        inductor_config.autotune_remote_cache or inductor_config.bundled_autotune_remote_cache
    )


def _install_backend_hash_deferral() -> None:
    """Wrap torch's Triton backend hash (once) so that a load in this thread skips it.

    Every load of an inductor graph asks for the hash of Triton's backend (Triton's
    version, the GPU arch and ptxas's version), to key the remote autotune cache. Computing
    it starts Triton's CUDA driver, which builds its C helper with gcc and runs ldconfig,
    ``file`` and two ``ptxas --version``. A variant's kernels carry their own, so with no
    remote autotune cache configured nothing reads it during our loads; everywhere else
    the real hash is returned."""
    import torch.utils._triton as triton_utils

    original = triton_utils.triton_hash_with_backend
    if getattr(original, "__precompile_deferral__", False):
        return

    def triton_hash_with_backend() -> str:
        if _loading.get() and not _remote_autotune_cache_on():
            return DEFERRED_BACKEND_HASH
        return str(original())

    triton_hash_with_backend.__precompile_deferral__ = True  # type: ignore[attr-defined]
    triton_hash_with_backend.cache_clear = original.cache_clear  # type: ignore[attr-defined]
    triton_utils.triton_hash_with_backend = triton_hash_with_backend  # type: ignore[assignment]
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch."):  # getattr on another package's lazy module imports
            continue
        if getattr(module, "triton_hash_with_backend", None) is original:
            module.triton_hash_with_backend = triton_hash_with_backend  # type: ignore[attr-defined]


@contextmanager
def _loading_in_this_thread() -> Iterator[None]:
    with LOAD_LOCK:
        _install_backend_hash_deferral()
    token = _loading.set(True)
    try:
        yield
    finally:
        _loading.reset(token)


@contextmanager
def _no_compile_workers() -> Iterator[None]:
    """No compile-worker pool for a load: inductor starts one (a Python process and its
    forks) the first time a wrapper asks for a Triton kernel, although a kernel bundled as
    statically launchable needs no compile. A kernel that does need one compiles in this
    thread instead. (Inductor's config is process-wide: a compile running meanwhile in
    another thread uses no pool either.)"""
    from torch._inductor import config as inductor_config

    with inductor_config.patch(compile_threads=1):
        yield


def unpickle_bundle(payload: bytes) -> tuple[Any, Any, Any]:
    bundle = pickle.loads(payload)
    if not (isinstance(bundle, tuple) and len(bundle) == 3):
        raise ValueError("payload is not a bundled AOTAutograd entry")
    return bundle  # type: ignore[return-value]


def forward_graph(bundle_entry: Any) -> Any:
    """The inductor CompiledFxGraph of the forward inside a bundled entry."""
    return bundle_entry.compiled_fw.result


def compiled_graphs(bundle_entry: Any) -> list[Any]:
    """The forward graph and, when there is one, the backward graph of a bundled entry."""
    graphs = [forward_graph(bundle_entry)]
    backward = getattr(getattr(bundle_entry, "compiled_bw", None), "result", None)
    if backward is not None and hasattr(backward, "source_code"):
        graphs.append(backward)
    return graphs


def _rekey(graph: Any) -> None:
    # A new key gives a changed module its own file and module-cache slot.
    graph.cache_key = "p" + hashlib.sha256(graph.source_code.encode()).hexdigest()[:51]


def variant_source_code(payload: bytes) -> str:
    entry, _, _ = unpickle_bundle(payload)
    return str(forward_graph(entry).source_code)


def load_variant(
    payload: bytes,
    *,
    forward_source: str | None = None,
    rewrite: Callable[[str], str] | None = None,
) -> Callable[..., Any]:
    """Turn verified payload bytes into a callable taking the graph's flat inputs.

    ``forward_source`` replaces the forward wrapper (the unpacked format's edits);
    ``rewrite`` then maps each generated wrapper's source before it is imported. Both
    are applied in one unpickle/re-pickle of the bundle.
    """
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    if forward_source is not None or rewrite is not None:
        entry, kernels, constant_args = unpickle_bundle(payload)
        forward = forward_graph(entry)
        for graph in compiled_graphs(entry):
            original = graph.source_code
            source = forward_source if graph is forward and forward_source is not None else original
            source = rewrite(source) if rewrite is not None else source
            if source != original:
                graph.source_code = source
                _rekey(graph)
        payload = pickle.dumps((entry, kernels, constant_args))
    with (
        private_inductor_dir(build_dir()),
        LOAD_LOCK,
        _no_compile_workers(),
        _loading_in_this_thread(),
    ):
        loaded = BundledAOTAutogradSerializableCallable.deserialize_compile_artifacts(payload)
    compiled: Callable[..., Any] = loaded.compiled_fn
    return compiled


def import_cpp_kernel(path: str, key: str) -> Callable[..., Any]:
    """Import a built cpp_pybinding ``.so`` the way inductor does, and return its entry."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache as Bindings

    module = Bindings._load_library(path, key)
    function: Callable[..., Any] = getattr(module, Bindings.entry_function)
    return function


def tensor_guard(
    templates: Sequence[Any],
    static_sizes: Sequence[Sequence[int | None]],
    static_strides: Sequence[Sequence[int | None]],
) -> Callable[..., bool] | None:
    """Dynamo's C++ tensor check (type, dtype, device, dispatch keys (so neg/conj bits and
    layouts), requires_grad, rank, and the static sizes and strides given), or None where
    this torch lacks it or it rejects its own templates."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        guards = TensorGuards(
            *templates,
            dynamic_dims_sizes=[list(sizes) for sizes in static_sizes],
            dynamic_dims_strides=[list(strides) for strides in static_strides],
        )
        check: Callable[..., bool] = guards.check
        if not check(*templates):
            return None
    except (ImportError, TypeError, RuntimeError):
        return None
    return check


def data_ptrs_equal(tensors: list[Any], ptrs: list[int | None], indices: list[int]) -> bool:
    """Whether ``tensors[i].data_ptr() == ptrs[i]`` for every i in ``indices`` (in C++,
    as cudagraph trees check their static inputs)."""
    import torch

    check = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if check is not None:
        return bool(check(tensors, ptrs, indices))
    return all(tensors[i].data_ptr() == ptrs[i] for i in indices)


def tree_flatten(value: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], Any]:
    """torch's pytree flatten (what ModelOutput and friends register with); ``is_leaf``
    keeps nodes whole (KV cache objects, whatever pytree registrations exist)."""
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten(value, is_leaf=is_leaf)
    return leaves, spec


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_unflatten(leaves, spec)


def treespec_to_json(spec: Any) -> str:
    """A pytree spec as upstream's JSON; TypeError/NotImplementedError where a node type
    has no serialized name."""
    from torch.utils import _pytree as pytree

    return str(pytree.treespec_dumps(spec))


def treespec_from_json(text: str) -> Any:
    """Upstream's spec reader, which only builds node types registered under their
    serialized names (no arbitrary import); any failure is a CorruptArtifactError."""
    from torch.utils import _pytree as pytree

    from ._errors import CorruptArtifactError

    try:
        return pytree.treespec_loads(text)
    except Exception as exc:  # the reader raises assorted errors on bad input
        raise CorruptArtifactError(f"a pytree spec in the artifact does not load: {exc}") from None


def output_unflattener(spec_json: str) -> Callable[[Any], Any]:
    """A function rebuilding a graph's output structure from the flat list its compiled
    code returns (upstream's pytree spec, as ``treespec_dumps`` wrote it)."""
    from torch.utils import _pytree as pytree

    spec = pytree.treespec_loads(spec_json)
    if spec.is_leaf():
        return _first
    unflatten = pytree.tree_unflatten
    return lambda flat: unflatten(flat, spec)


def _first(flat: Any) -> Any:
    return flat[0]


def vec_isa() -> tuple[str, str]:
    """The vector ISA inductor builds C++ kernels for on this machine and its compiler
    flags (may run gcc once, to probe)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return str(isa), (isa.build_arch_flags() if isa else "")


def serialize_variant(compiled: Any) -> bytes:
    """The payload bytes of a compiled graph (upstream's bundled AOTAutograd entry): the
    other direction of ``load_variant``. TypeError/AttributeError/PicklingError where the
    graph cannot be serialized."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    payload: bytes = BundledAOTAutogradSerializableCallable.serialize_compile_artifacts(
        BundledAOTAutogradSerializableCallable(compiled)
    )
    return payload


def resolve_process_group(name: str) -> Any | None:
    """The process group registered under ``name`` in this process (what a graph's
    ``_c10d_functional`` op resolves its group-name argument to), or None: torch.distributed
    is unavailable or not initialized, or no group has that name."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(name)
    except (RuntimeError, ValueError, KeyError):
        return None
