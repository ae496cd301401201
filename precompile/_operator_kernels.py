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
else a profile hook). Kept: the files of the caller's code that started, of the modules
and functions its global names hold (a cached helper, a module's constant), and the
file the dispatcher names as where the operator was registered; code with no file
(``exec``, ``python -c``) is kept as code. Torch's, its requirements' and the standard
library's code is left out (the environment key holds their versions). What stays
unseen is listed in docs/limits.md.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import sys
import sysconfig
import threading
import types
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

import torch

from . import _torch_adapter as adapter

log = logging.getLogger("precompile.compile")

# torch's own operators: their code lies in torch's folder, and there are many of them
_TORCH_NAMESPACES = ("aten", "prims")
_TOOL_NAME = "precompile kernel sources"


def _referenced_files(code: types.CodeType, namespace: Mapping[str, Any]) -> set[str]:
    """The files of the modules and functions a running code's global names hold
    (``helpers.coeff()``, ``from helpers import coeff``): a call answered from a cache
    (``functools.lru_cache``) or by TorchScript starts no Python function there, and a
    constant read off a module starts none at all."""
    files = set()
    for name in code.co_names:
        value = namespace.get(name)
        if isinstance(value, types.ModuleType):
            path = getattr(value, "__file__", None)
        else:
            target = inspect.unwrap(value) if callable(value) else None
            path = getattr(getattr(target, "__code__", None), "co_filename", None)
        if isinstance(path, str):
            files.add(path)
    return files


def _is_users(code: types.CodeType, namespace: Mapping[str, Any]) -> bool:
    """Whether code is the caller's: from a file outside the skipped folders, or with no
    file and run in the namespace of such a module or of a fileless ``__main__`` (``exec``
    of a kernel's text, ``python -c``, a notebook cell); not code generated for torch's
    own classes (dataclasses' methods), which some runs start and others not."""
    if os.path.isfile(code.co_filename):
        return not os.path.abspath(code.co_filename).startswith(_skipped_dirs())
    module_file = namespace.get("__file__")
    if isinstance(module_file, str):
        return not os.path.abspath(module_file).startswith(_skipped_dirs())
    return namespace.get("__name__") == "__main__"


def _code_starts(run: Callable[[], None]) -> tuple[set[types.CodeType], set[str]]:
    """The code of every Python function this thread starts while ``run()`` runs, and
    the files its global names refer to (``_referenced_files``)."""
    codes: set[types.CodeType] = set()
    referenced: set[str] = set()
    thread = threading.get_ident()

    def seen(code: types.CodeType, namespace: Mapping[str, Any]) -> None:
        if code in codes or not _is_users(code, namespace):
            return  # torch's own (and its requirements'): which of it runs varies
        codes.add(code)
        referenced.update(_referenced_files(code, namespace))

    monitoring: Any = getattr(sys, "monitoring", None)
    if monitoring is not None:
        tool = next((i for i in range(6) if monitoring.get_tool(i) is None), None)
        if tool is not None:

            def started(code: Any, _offset: int) -> None:
                if threading.get_ident() == thread:
                    seen(code, sys._getframe(1).f_globals)  # the frame that starts

            monitoring.use_tool_id(tool, _TOOL_NAME)
            try:
                monitoring.register_callback(tool, monitoring.events.PY_START, started)
                monitoring.set_events(tool, monitoring.events.PY_START)
                run()
            finally:
                monitoring.set_events(tool, 0)
                monitoring.register_callback(tool, monitoring.events.PY_START, None)
                monitoring.free_tool_id(tool)
            return codes, referenced
    previous = sys.getprofile()

    def profile(frame: Any, event: Any, arg: Any) -> None:
        if event == "call":
            seen(frame.f_code, frame.f_globals)
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
    return codes, referenced


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


def operator_kernel_code(gm: torch.fx.GraphModule) -> tuple[set[str], set[types.CodeType]]:
    """What the graph's library operators run, beyond torch's, the standard library's and
    torch's requirements' code: the source files (absolute paths), and the code that has
    no file (defined by ``python -c``, a notebook cell, ``exec``)."""
    files: set[str] = set()
    fileless: set[types.CodeType] = set()
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
        codes, referenced = ran
        for code in codes:
            if not os.path.isfile(code.co_filename):
                fileless.add(code)
        for path in {c.co_filename for c in codes} | referenced:
            path = os.path.abspath(path)
            if os.path.isfile(path) and not path.startswith(_skipped_dirs()):
                files.add(path)
        # where its kernels were registered (which function, with which arguments)
        for site in adapter.operator_registration_sites(signature[0]):
            path = os.path.abspath(site)
            if os.path.isfile(path) and not path.startswith(_skipped_dirs()):
                files.add(path)
    return files, fileless
