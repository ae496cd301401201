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

import functools
import hashlib
import importlib
import logging
import os
import pickle
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any

from ._build_dir import build_dir
from ._errors import CorruptArtifactError

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


@functools.cache
def import_runtime_modules() -> None:
    """Import the torch modules that loading and running a variant need (once: every
    artifact with a variant off the lean path asks)."""
    for name in _RUNTIME_MODULES:
        importlib.import_module(name)
    _prefetch_torch_source_hash()


def gpu_build() -> bool:
    """Whether this torch is built for GPUs (CUDA or ROCm), whose variants never take the
    lean path."""
    import torch

    return torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


def _prefetch_torch_source_hash() -> None:
    """Start computing inductor's ``torch_key()`` in the background (GPU builds of torch).

    Loading a Triton kernel keys inductor's in-process kernel table with a hash of every
    torch source file, computed once per process: 0.18 s of a first request on an H100
    host. Started at import, it is done while the server builds its model."""
    if not gpu_build():
        return  # CPU kernels are not keyed with it
    torch_key = getattr(importlib.import_module("torch._inductor.codecache"), "torch_key", None)
    if torch_key is None:
        return
    prefetch = getattr(torch_key, "prefetch", None)
    if callable(prefetch):  # torch's own background computation (newer torch)
        prefetch()
    else:  # a cached function: the first caller computes, later ones read it
        threading.Thread(target=torch_key, name="precompile-torch-key", daemon=True).start()


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
    ``rewrite`` then maps each generated wrapper's source before it is imported.
    """
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    entry, kernels, constant_args = unpickle_bundle(payload)
    if forward_source is not None or rewrite is not None:
        forward = forward_graph(entry)
        for graph in compiled_graphs(entry):
            original = graph.source_code
            source = forward_source if graph is forward and forward_source is not None else original
            source = rewrite(source) if rewrite is not None else source
            if source != original:
                graph.source_code = source
                _rekey(graph)
    with (
        private_inductor_dir(build_dir()),
        LOAD_LOCK,
        _no_compile_workers(),
        _loading_in_this_thread(),
    ):
        if not kernels and hasattr(entry, "wrap_post_compile"):
            return _wrap_bundled_entry(entry)
        payload = pickle.dumps((entry, kernels, constant_args))
        loaded = BundledAOTAutogradSerializableCallable.deserialize_compile_artifacts(payload)
    compiled: Callable[..., Any] = loaded.compiled_fn
    return compiled


def _wrap_bundled_entry(entry: Any) -> Callable[..., Any]:
    """Upstream's ``deserialize_bundled_cache_entry`` (torch 2.10-2.13) without its deep
    copy of the entry, which it keeps only to serialize the loaded function again (ours
    keeps the payload bytes instead): 0.05-0.1 s per GPU variant. Entries that bundle
    user-written Triton kernels take upstream's path, which registers them first."""
    import torch
    from torch._inductor.cudagraph_utils import BoxedDeviceIndex
    from torch._inductor.utils import BoxedBool
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    entry.guards_expr = None  # no guards to install: we dispatch on sizes ourselves
    cudagraphs = BoxedBool(torch._inductor.config.triton.cudagraphs)
    context = torch._guards.TracingContext.try_get()
    if context is None:
        context = torch._guards.TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
    with torch._guards.tracing(context):
        compiled_fn = entry.wrap_post_compile(
            [],
            entry.sanitized_aot_config,
            {"cudagraphs": cudagraphs, "boxed_forward_device_index": BoxedDeviceIndex(None)},
        )

    def forward(*args: Any) -> Any:
        return compiled_fn(list(args))

    return forward


# What inductor's cpp_pybinding modules read at import (the C function that gives a
# tensor's data pointer, defined in torch's guards code) and their entry function's name:
# CppPythonBindingsCodeCache's ``_load_library_inner`` and ``entry_function``, repeated
# here so that loading a bundled kernel does not import inductor's codecache (and Dynamo).
_DATA_PTR_VARIABLE = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"
_CPP_ENTRY = "kernel"


def import_cpp_kernel(path: str, key: str) -> Callable[..., Any]:
    """Import a built cpp_pybinding ``.so`` the way inductor does, and return its entry."""
    import importlib.util

    import torch

    os.environ[_DATA_PTR_VARIABLE] = str(
        torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr  # type: ignore[attr-defined]
    )
    name = f"{key}.{_CPP_ENTRY}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import a kernel from {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    function: Callable[..., Any] = getattr(module, _CPP_ENTRY)
    return function


def cpp_loader_matches_inductor() -> bool:
    """Whether inductor's cpp_pybinding loader is still what ``import_cpp_kernel``
    repeats (its entry function's name and the variable its modules read)."""
    import inspect

    from torch._inductor.codecache import CppPythonBindingsCodeCache as Bindings

    try:
        text = inspect.getsource(Bindings._load_library_inner)
    except (OSError, TypeError):
        return False
    return Bindings.entry_function == _CPP_ENTRY and _DATA_PTR_VARIABLE in text


# -- the lean path: a variant's generated module run with no torch compiler import ------
# What inductor's CPU wrapper modules import from torch's compiler packages, all that a
# lean variant's source may import from them (the compile side checks, see
# ``lean_blockers``); at load each is served by a stand-in below instead, so that
# executing the module imports neither inductor nor Dynamo.
LEAN_IMPORTS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "torch._inductor.hooks": frozenset({"run_intermediate_hooks"}),
        "torch._inductor.utils": frozenset({"maybe_profile"}),
        "torch._inductor.codegen.memory_planning": frozenset({"_align"}),
        "torch._inductor.async_compile": frozenset({"AsyncCompile"}),
        "torch._inductor.select_algorithm": frozenset({"extern_kernels"}),
    }
)
_COMPILER_PACKAGES = ("torch._inductor", "torch._dynamo", "torch._functorch")
# Functions the wrapper defines but never runs when loaded: inductor's benchmark helpers.
_UNCALLED = frozenset({"get_args", "benchmark_compiled_module"})
LEAN_ALIGN_BYTES = 64


def _lean_align(nbytes: int) -> int:
    """inductor's ``_align``: round up to a multiple of its ALIGN_BYTES (64)."""
    return (nbytes + LEAN_ALIGN_BYTES - 1) & -LEAN_ALIGN_BYTES


def _lean_run_intermediate_hooks(name: str, value: Any) -> None:
    """inductor's debug hooks run only where a caller registered some, which takes
    importing ``torch._inductor.hooks``: delegate there if it is imported."""
    hooks = sys.modules.get("torch._inductor.hooks")
    if hooks is not None:
        hooks.run_intermediate_hooks(name, value)


@contextmanager
def _lean_maybe_profile(should_profile: bool, *args: Any, **kwargs: Any) -> Iterator[Any]:
    """inductor's ``maybe_profile``."""
    if should_profile:
        import torch.profiler

        with torch.profiler.profile(*args, **kwargs) as profile:
            yield profile
    else:
        yield


class _InductorAsyncCompile:
    """inductor's own AsyncCompile, imported only if a kernel must be built here after all
    (its bundled binary does not run on this CPU)."""

    def cpp_pybinding(self, argtypes: list[str], source: str) -> Any:
        from torch._inductor.async_compile import AsyncCompile

        function = AsyncCompile().cpp_pybinding(argtypes, source)
        return function.result() if hasattr(function, "result") else function


class _LeanNamespace:
    """The attributes a generated module imports from one compiler module."""

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)


def _lean_async_compile(
    load_cpp: Callable[[Any, list[str], str], Any],
    triton_kernels: Mapping[str, Any],
) -> type:
    inductor = _InductorAsyncCompile()

    class AsyncCompile:
        """What a wrapper module uses of inductor's AsyncCompile: ``cpp_pybinding``
        returning the kernel itself, ``triton`` the kernel loaded from its binary (so
        ``wait`` has no futures to resolve)."""

        def cpp_pybinding(self, argtypes: list[str], source: str) -> Any:
            return load_cpp(inductor, argtypes, source)

        def triton(self, kernel_name: str, source: str, *args: Any, **kwargs: Any) -> Any:
            kernel = triton_kernels.get(kernel_name)
            if kernel is None:
                raise LeanImportRefused(f"no binary of Triton kernel {kernel_name} was shipped")
            return kernel

        def wait(self, scope: dict[str, Any]) -> None:
            pass

    return AsyncCompile


def resolve_torch_path(path: str) -> Any:
    """The torch operator at a dotted path under ``torch`` (``torch.addmm``,
    ``torch.ops.aten.mm.out``): every step a torch module, ``torch.ops`` or one of its
    namespaces or packets, the end an operator (an ``OpOverload`` or packet, or a
    builtin of torch's C++ bindings). Anything else (``torch.os.system``, a Python
    function, a dict) raises ValueError: an artifact names kernels, nothing more."""
    import types

    import torch

    parts = path.split(".")
    if parts[0] != "torch" or any(part in ("_inductor", "_dynamo") for part in parts):
        raise ValueError(f"{path!r} is not a path under torch outside its compiler")
    value: Any = torch
    for part in parts[1:]:
        if not _torch_container(value):
            raise ValueError(f"{path!r} passes through {type(value).__name__}, not a torch module")
        value = getattr(value, part)
    operator = isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or (
        isinstance(value, types.BuiltinFunctionType)
        and (getattr(value, "__module__", None) or "").split(".")[0] == "torch"
    )
    if not operator:
        raise ValueError(f"{path!r} is a {type(value).__name__}, not a torch operator")
    return value


def _torch_container(value: Any) -> bool:
    """A module of torch's, ``torch.ops``, one of its namespaces, or an operator packet."""
    import types

    import torch

    if isinstance(value, types.ModuleType):
        name = value.__name__
        return name == "torch" or name.startswith("torch.")
    return isinstance(
        value, (torch._ops._Ops, torch._ops._OpNamespace, torch._ops.OpOverloadPacket)
    )


def extern_path_names(name: str, path: str) -> bool:
    """Whether ``path`` names the operator ``extern_kernels.<name>`` is: its last part
    (``torch.addmm``), or the operator's part of an ops path (``torch.ops.aten.mm.out``)."""
    parts = path.split(".")
    if len(parts) >= 4 and parts[1] == "ops":
        return parts[3] == name
    return parts[-1] == name


class LeanImportRefused(ImportError):
    """A lean variant's module imported a torch compiler module after all."""


def _lean_triton_heuristics() -> _LeanNamespace:
    """What GPU wrapper modules import from inductor's ``triton_heuristics`` (the
    bandwidth profiler's markers; the compile side proves a lean module never calls them)."""

    def refused(*args: Any, **kwargs: Any) -> None:
        raise LeanImportRefused("a lean module ran inductor's bandwidth profiling")

    return _LeanNamespace(start_graph=refused, end_graph=refused)


class _Unused:
    """What a lean GPU module's ``import triton`` binds: its generated code only names
    Triton inside kernel source strings, which the lean path never compiles."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Unused(f"{self._name}.{attribute}")  # ``import triton.language as tl``

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise LeanImportRefused(f"a lean module called {self._name}")


def exec_lean_module(
    source: str,
    name: str,
    externs: Mapping[str, Any],
    load_cpp: Callable[[Any, list[str], str], Any],
    triton_kernels: Mapping[str, Any] | None = None,
) -> Any:
    """Execute a generated wrapper module with its compiler imports served by stand-ins
    (``extern_kernels`` holding exactly ``externs``; C++ kernels through ``load_cpp``;
    ``async_compile.triton(name, ...)`` answered from ``triton_kernels``) and return the
    module. Any other import from torch's compiler packages raises ``LeanImportRefused``:
    nothing of inductor, Dynamo or Triton's compiler is imported."""
    import builtins
    import linecache
    import types

    served: dict[str, Any] = {
        "torch._inductor.hooks": _LeanNamespace(
            run_intermediate_hooks=_lean_run_intermediate_hooks
        ),
        "torch._inductor.utils": _LeanNamespace(maybe_profile=_lean_maybe_profile),
        "torch._inductor.codegen.memory_planning": _LeanNamespace(_align=_lean_align),
        "torch._inductor.async_compile": _LeanNamespace(
            AsyncCompile=_lean_async_compile(load_cpp, triton_kernels or {})
        ),
        "torch._inductor.select_algorithm": _LeanNamespace(
            extern_kernels=_LeanNamespace(**externs)
        ),
    }
    if triton_kernels:
        served["torch._inductor.runtime.triton_heuristics"] = _lean_triton_heuristics()
    real_import = builtins.__import__
    triton_stand_in = _Unused("triton")

    def lean_import(
        module: str,
        globals: Any = None,
        locals: Any = None,
        fromlist: Sequence[str] = (),
        level: int = 0,
    ) -> Any:
        if level == 0 and module in served:
            stand_in = served[module]
            missing = [n for n in fromlist or () if not hasattr(stand_in, n)]
            if not fromlist or missing:
                raise LeanImportRefused(f"{name} imports {missing or module} from {module}")
            return stand_in
        if level == 0 and module.startswith(_COMPILER_PACKAGES):
            raise LeanImportRefused(f"{name} imports {module}")
        if level == 0 and (module == "triton" or module.startswith("triton.")):
            if not triton_kernels or fromlist:
                raise LeanImportRefused(f"{name} imports {module}")
            return triton_stand_in  # ``import triton`` / ``import triton.language as tl``
        return real_import(module, globals, locals, fromlist, level)

    filename = f"<precompile lean {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module_type = types.ModuleType(name)
    module_type.__dict__["__builtins__"] = {**builtins.__dict__, "__import__": lean_import}
    exec(compile(source, filename, "exec"), module_type.__dict__)
    return module_type


# -- Triton kernels launched from their binaries (torch's static CUDA launcher) ---------
def static_launcher() -> Any:
    """torch's C++ launcher of Triton-compiled CUDA kernels (``torch._C._StaticCudaLauncher``,
    what inductor's static launcher calls), or None where this torch has none."""
    import torch

    return getattr(torch._C, "_StaticCudaLauncher", None)


def load_cuda_kernel(binary_path: str, function: str, shared: int, device: int) -> int:
    """Load a kernel from a cubin file onto ``device``: its CUfunction handle. (torch
    2.10-2.12 return (function, registers, spills); 2.13 puts the module first.)"""
    import torch

    launcher = static_launcher()
    if launcher is None:
        raise RuntimeError("this torch has no static CUDA launcher")
    # The module is loaded into the current device's context whatever ``device`` says (a
    # kernel of cuda:1 loaded while cuda:0 was current failed at its launch: "invalid
    # resource handle"); inductor loads it under its device guard too.
    with torch.cuda.device(device):
        loaded = launcher._load_kernel(binary_path, function, shared, device)
    handle: int = loaded[1] if len(loaded) == 4 else loaded[0]
    return handle


def cuda_kernel_launch() -> Callable[..., None]:
    """``launch(function, grid_x, grid_y, grid_z, num_warps, shared, arg_types, args,
    stream)``: one launch of a loaded kernel on a raw CUDA stream."""
    launch: Callable[..., None] = static_launcher()._launch_kernel
    return launch


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


def register_graph_generator(graph: Any, generator: Any) -> bool:
    """Register ``generator`` with a CUDA graph about to be captured, so its replays draw
    from it as eager calls would (the default generator registers itself); False where
    this torch cannot."""
    register = getattr(graph, "register_generator_state", None)
    if register is None:
        return False
    register(generator)
    return True


def tree_flatten(value: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], Any]:
    """torch's pytree flatten (what ModelOutput and friends register with); ``is_leaf``
    keeps nodes whole (KV cache objects, whatever pytree registrations exist)."""
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten(value, is_leaf=is_leaf)
    return leaves, spec


def call_structure(spec: Any) -> str:
    """A call's ``(args, kwargs)`` structure said as a person would: how many positional
    arguments and which keywords; the tree itself where it is not that shape."""
    try:
        children = spec.children() if callable(getattr(spec, "children", None)) else None
        args, kwargs = children if children is not None else spec.children_specs
        keywords = ", ".join(str(k) for k in kwargs.context) or "none"
        return f"{args.num_children} positional argument(s) and keywords: {keywords}"
    except (AttributeError, TypeError, ValueError):
        return str(spec)


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


@functools.cache
def _distributed() -> Any | None:
    """torch.distributed where this torch has it (imported once: asked per call)."""
    import torch.distributed as dist

    return dist if dist.is_available() else None


def default_process_group() -> Any | None:
    """This process's default group object (None outside torch.distributed): another
    object after ``destroy_process_group()`` and a new ``init_process_group()``."""
    dist = _distributed()
    return None if dist is None else dist.group.WORLD


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


def process_group_names() -> list[str]:
    """The names of every process group registered in this process (the default group
    and each ``new_group`` this rank is a member of); empty outside torch.distributed."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return []
    from torch.distributed.distributed_c10d import _world

    return sorted(str(name) for name in _world.pg_names.values())


# -- hook registrations ------------------------------------------------------------------
@functools.cache
def _removable_handle() -> Any:
    from torch.utils.hooks import RemovableHandle

    return RemovableHandle


def hook_handles_made() -> int:
    """How many hook handles torch has made in this process: every ``register_*_hook``
    (a module's, a tensor's, a global one) makes one, so a hook registered anywhere since
    a reading changes it (``RemovableHandle.next_id``)."""
    return int(_removable_handle().next_id)
