"""What a variant's compiled payload holds, read inside the compile that made it (where
its kernels are built and its autotuning results lie): how the graph uses its inputs,
the C++ kernels it built, its Triton kernels fixed to their tuned configs, and a digest
of its generated code."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
from dataclasses import dataclass

from precompile.cache import sha256_hex
from precompile.runtime import NativeKernel, UnsupportedGraphError
from precompile.runtime.compiler_interface import cpu_features_for_flags, find_cpp_kernels
from precompile.runtime.compiler_interface import native_kernel_key as kernel_key

from . import _torch_adapter as adapter

log = logging.getLogger("precompile.compile")


@dataclass(frozen=True)
class InputUse:
    """What the compiled graph does with one flat input (from AOTAutograd's analysis)."""

    mutation: str  # "none" | "data" | "metadata"
    aliased: bool  # some output is a view of it (or is it)


# Comments that differ between two compiles of one graph and nowhere else: inductor
# numbers the graphs a process compiles (``# AOT ID: ['3_inference']``), and on CUDA it
# names each Triton kernel's file in the compiling process's cache dir (``# kernel path:
# /tmp/precompile-build-502-kc495ach/wg/cwgv....py``), which a worker process has its own of.
_PROCESS_COMMENTS = re.compile(r"^# (AOT ID|kernel path): .*$", re.M)


def variant_code_digest(payload: bytes) -> str:
    """sha256 over the generated code (forward, and backward if any), less inductor's
    count of the graphs compiled before it: equal means same code."""
    digest = hashlib.sha256()
    for number, source in enumerate(adapter.wrapper_sources(payload)):
        source = _PROCESS_COMMENTS.sub("", source)
        digest.update((b"\0backward\0" if number else b"") + source.encode())
    return digest.hexdigest()


_TRITON_CALL = re.compile(r"^\w+ = async_compile\.triton\('(\w+)'", re.M)


def settle_triton_kernels(payload: bytes) -> bytes:
    """Fix each statically launchable Triton kernel of the payload to the config this
    compile's autotuning chose, so that a load neither benchmarks configs at the first
    call nor compiles smaller reduction blocks (Triton's driver, gcc and ptxas would run);
    warn about kernels that need Triton's own launcher (built with gcc at load).

    Runs inside the compile's inductor dir, where the autotuning results are."""
    if b"async_compile.triton(" not in payload:
        return payload
    entry, kernels, constant_args = adapter.unpickle_bundle(payload)
    for graph in adapter.compiled_graphs(entry):
        static = adapter.static_autotuners(graph)
        for autotuner in static:
            if adapter.config_count(autotuner) > 1:
                adapter.keep_tuned_config(autotuner)
            if adapter.config_count(autotuner) == 1:
                adapter.fix_reduction_block(autotuner)
            else:
                log.info(
                    "Triton kernel %s keeps %d configs: its first call in a process "
                    "benchmarks them",
                    adapter.autotuner_name(autotuner),
                    adapter.config_count(autotuner),
                )
        launched = set(_TRITON_CALL.findall(adapter.graph_source(graph)))
        unsettled = sorted(launched - {adapter.autotuner_name(a) for a in static})
        if unsettled:
            log.warning(
                "%d Triton kernel(s) cannot be launched without Triton's own launcher, which "
                "a load builds with gcc: %s",
                len(unsettled),
                ", ".join(unsettled)[:500],
            )
    return adapter.pickle_bundle(entry, kernels, constant_args)


def input_uses(payload: bytes, count: int) -> tuple[tuple[InputUse, ...], bool]:
    """Per flat input, whether the graph writes it and whether an output aliases it; and
    whether a backward graph was compiled."""
    entry, _, _ = adapter.unpickle_bundle(payload)
    writes = adapter.input_writes(entry)
    if len(writes) != count:
        raise UnsupportedGraphError(
            f"AOTAutograd describes {len(writes)} inputs of a graph with {count}; cannot tell "
            "which inputs it writes"
        )
    aliased = adapter.inputs_aliased_by_outputs(entry)
    uses = []
    for index, (metadata, data) in enumerate(writes):
        if metadata:
            mutation = "metadata"
        elif data:
            mutation = "data"
        else:
            mutation = "none"
        uses.append(InputUse(mutation, index in aliased))
    training = len(adapter.compiled_graphs(entry)) > 1
    return tuple(uses), training


def built_cpp_kernels(payload: bytes) -> tuple[tuple[NativeKernel, bytes], ...]:
    """Each C++ kernel the payload's wrappers build, with the ``.so`` this compile built.

    Runs inside the compile's inductor dir, where every kernel is already built, so
    asking inductor for it again returns the loaded module without compiling.
    """
    sources = adapter.wrapper_sources(payload)
    calls = [kernel for source in sources for kernel in find_cpp_kernels(source)]
    if not calls:
        return ()
    isa, flags = adapter.vec_isa()
    built = []
    for (argtypes, source), path in zip(calls, adapter.cpp_kernel_files(calls), strict=False):
        if not isinstance(path, str) or not os.path.isfile(path):
            raise UnsupportedGraphError(
                f"inductor built a C++ kernel this torch does not expose as a file ({path!r})"
            )
        with open(path, "rb") as handle:
            data = handle.read()
        kernel = NativeKernel(
            key=kernel_key(argtypes, source),
            binary=sha256_hex(data),
            isa=isa,
            cpu_features=cpu_features_for_flags(flags),
            machine=platform.machine(),
        )
        built.append((kernel, data))
    return tuple(built)
