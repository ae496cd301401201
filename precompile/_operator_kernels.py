"""The source files of the Python kernels a graph's library operators run when traced.

A custom operator whose kernel is Python (``Library.impl(..., "CompositeImplicitAutograd")``,
a decomposition) is traced through: its code becomes part of the compiled graph, yet the
graph names only the operator. Neither torch's cache keys nor the graph's text see an
edit to that kernel, so a cache entry compiled before the edit would serve the old
kernel (measured: 3.0 where eager gave 4.0). The files of the code such an operator
runs are therefore part of what a graph was compiled from: ``standalone_compile`` keys
on their contents, ``compile_model`` checks them at load with the files Dynamo traced.

How they are found: each call of an operator outside torch's own namespaces is run
again alone, on clones of the fake values it was traced with, while this thread's
Python function starts are recorded (``sys.monitoring`` where the interpreter has it,
else a profile hook). Files of torch and of the standard library are left out.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import sysconfig
import threading
from collections.abc import Callable
from importlib import metadata
from typing import Any

import torch

from . import _torch_adapter as adapter

log = logging.getLogger("precompile.compile")

# torch's own operators: their code lies in torch's folder, and there are many of them
_TORCH_NAMESPACES = ("aten", "prims")
_TOOL_NAME = "precompile kernel sources"


def _code_starts(run: Callable[[], None]) -> set[str]:
    """The files of every Python function this thread starts while ``run()`` runs."""
    files: set[str] = set()
    thread = threading.get_ident()
    monitoring: Any = getattr(sys, "monitoring", None)
    if monitoring is not None:
        tool = next((i for i in range(6) if monitoring.get_tool(i) is None), None)
        if tool is not None:

            def started(code: Any, _offset: int) -> None:
                if threading.get_ident() == thread:
                    files.add(code.co_filename)

            monitoring.use_tool_id(tool, _TOOL_NAME)
            try:
                monitoring.register_callback(tool, monitoring.events.PY_START, started)
                monitoring.set_events(tool, monitoring.events.PY_START)
                run()
            finally:
                monitoring.set_events(tool, 0)
                monitoring.register_callback(tool, monitoring.events.PY_START, None)
                monitoring.free_tool_id(tool)
            return files
    previous = sys.getprofile()

    def profile(frame: Any, event: Any, arg: Any) -> None:
        if event == "call":
            files.add(frame.f_code.co_filename)
        if callable(previous):
            previous(frame, event, arg)

    sys.setprofile(profile)
    try:
        run()
    finally:
        if previous is None or callable(previous):
            sys.setprofile(previous)
        else:  # a C profiler (cProfile's) takes its hook back itself
            sys.setprofile(None)
            getattr(previous, "enable", lambda: None)()
    return files


@functools.cache
def _skipped_dirs() -> tuple[str, ...]:
    """torch's folder, the standard library's, this package's, and those of the packages
    torch requires (sympy runs in a traced call with symbolic sizes): the environment
    key holds their versions. Some milliseconds, once a process."""
    torch_dir, _ = adapter.torch_code_dirs()
    paths = {torch_dir, sysconfig.get_paths()["stdlib"], os.path.dirname(__file__)}
    try:
        requirements = metadata.requires("torch") or []
    except metadata.PackageNotFoundError:  # torch from a source tree
        requirements = []
    for requirement in requirements:
        name = re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0]
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # an optional one, not installed
            continue
        record = distribution.read_text("RECORD") or ""  # its files (parsed: 20x slower)
        for top in {line.split(",", 1)[0].split("/", 1)[0] for line in record.splitlines()}:
            if top not in ("..", "__pycache__") and not top.endswith((".dist-info", ".egg-info")):
                paths.add(str(distribution.locate_file(top)))
    absolute = (os.path.abspath(p) for p in paths)
    return tuple(os.path.join(p, "") if os.path.isdir(p) else p for p in absolute)


def operator_kernel_files(gm: torch.fx.GraphModule) -> set[str]:
    """The source files (absolute paths) of the Python code the graph's library
    operators run, beyond torch's and the standard library's."""
    files: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        signature = adapter.op_signature(node.target)
        if signature is None or signature[0].split("::", 1)[0] in _TORCH_NAMESPACES:
            continue
        try:
            ran = _code_starts(functools.partial(adapter.run_on_example_values, node))
        except Exception as exc:  # traced once already; a failure here is logged, not fatal
            log.warning(
                "could not run %s again to find the files of its Python kernel (%s: %s); "
                "an edit to that kernel's source will not make its cache entries miss",
                signature[0], type(exc).__name__, exc,
            )  # fmt: skip
            continue
        for path in ran:
            path = os.path.abspath(path)
            if not path.startswith(_skipped_dirs()) and os.path.isfile(path):
                files.add(path)
    return files
