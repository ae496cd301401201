"""Triton kernels of a lean GPU variant, launched from their shipped binaries.

Upstream loads a GPU variant's kernels through ``async_compile.triton``: inductor's
``CachingAutotuner`` (importing inductor, 4-5 s on a GPU host), which re-runs autotuning
in the serving process where a kernel has several configs, then launches each kernel
through torch's static CUDA launcher. The compile side records, per kernel, the launcher
inductor chose and ran (``TritonLaunch``); here each becomes a small function that
computes the grid from the same expressions and calls the same C++ launcher with the
same arguments, from the cubin the artifact ships. Grid expressions come from a file:
they are checked against the expression allowlist and regenerated from the checked tree
(``_expressions``), so nothing but arithmetic over the kernel's parameters runs.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import _torch_adapter as adapter
from ._errors import CorruptArtifactError
from ._expressions import NAMESPACE, SYMBOL_PREFIX, to_python
from ._manifest import TritonLaunch


class TritonKernel:
    """What a wrapper module calls: ``kernel.run(*parameters, stream=raw_stream)``."""

    __slots__ = ("name", "run")

    def __init__(self, name: str, run: Callable[..., None]) -> None:
        self.name = name
        self.run = run

    def __repr__(self) -> str:
        return f"TritonKernel({self.name})"


def launcher_source(launch: TritonLaunch) -> str:
    """The Python source of the launch function: grid from the checked expressions, then
    one call of the C++ launcher (names of the parameters renamed ``v_<name>``)."""
    rename = {
        name: SYMBOL_PREFIX + name
        for name in (*launch.parameters, *(n for n, _ in launch.grid_prefix))
    }
    known: list[str] = list(launch.parameters)
    lines = [f"def run({', '.join(rename[p] for p in launch.parameters)}, *, stream):"]
    for name, expression in launch.grid_prefix:
        lines.append(f"    {rename[name]} = {to_python(expression, known, rename)}")
        known.append(name)
    grid = ", ".join(to_python(expression, known, rename) for expression in launch.grid)
    passed = [rename[a] for a in launch.arguments] + ["None"] * launch.scratch
    packed = ", ".join(passed) + ("," if len(passed) == 1 else "")
    lines.append(
        f"    _launch(_function, {grid}, _num_warps, _shared, _arg_types, ({packed}), stream)"
    )
    return "\n".join(lines) + "\n"


def _launch_function(launch: TritonLaunch, handle: int) -> Callable[..., None]:
    namespace: dict[str, Any] = {
        **NAMESPACE,
        "_launch": adapter.cuda_kernel_launch(),
        "_function": handle,
        "_num_warps": launch.num_warps,
        "_shared": launch.shared,
        "_arg_types": launch.arg_types,
    }
    filename = f"<precompile triton launch {launch.name}>"
    exec(compile(launcher_source(launch), filename, "exec"), namespace)
    run: Callable[..., None] = namespace["run"]
    return run


def load_triton_kernels(
    launches: Sequence[TritonLaunch], read_binary: Callable[[str], bytes]
) -> Mapping[str, TritonKernel]:
    """Each kernel loaded onto its device from its binary (written to a private temporary
    file for the driver, removed once loaded), by the name the wrapper asks for."""
    kernels: dict[str, TritonKernel] = {}
    with tempfile.TemporaryDirectory(prefix="precompile-cubin-") as folder:
        written: dict[str, str] = {}
        for launch in launches:
            path = written.get(launch.binary)
            if path is None:
                path = os.path.join(folder, f"{launch.binary[:32]}.cubin")
                with open(path, "wb") as file:
                    file.write(read_binary(launch.binary))
                written[launch.binary] = path
            try:
                handle = adapter.load_cuda_kernel(
                    path, launch.function, launch.shared, launch.device
                )
            except RuntimeError as exc:
                raise CorruptArtifactError(
                    f"Triton kernel {launch.name} ({launch.function}) did not load on "
                    f"cuda:{launch.device}: {exc}"
                ) from None
            kernels[launch.name] = TritonKernel(launch.name, _launch_function(launch, handle))
    return kernels
