"""Inductor's vector-ISA probe, run ahead of the first C++ compile and in parallel.

Before it builds a C++ kernel, inductor asks which vector ISA this machine builds for by
compiling and loading a test program per candidate ISA (three on an AVX-512 x86 host),
one after another: 7.1 s of a 28 s CPU build of the tiny Llama in a process with an empty
inductor cache, 1.2 s with the programs cached (each still loaded in a subprocess). Every
candidate is probed in its own thread here (gcc and the loader are subprocesses), and a
CPU ``compile_model`` starts them before it traces, so they overlap the trace. The
answers are inductor's own, kept where it keeps them: its per-process cache and the
caller's inductor cache dir (joined before a build dir replaces it).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from . import _torch_adapter as adapter

log = logging.getLogger("precompile.compile")

_lock = threading.Lock()
_threads: list[threading.Thread] = []
_started = False


def _probe(isa: Any) -> None:
    try:
        bool(isa)  # compiles and loads its test program; inductor keeps the answer
    except Exception as exc:  # the sequential probe after the join asks again, and raises
        log.debug("probing vector ISA %s failed: %s: %s", isa, type(exc).__name__, exc)


def start() -> None:
    """Probe every candidate ISA in a thread of its own, once per process."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
        for isa in adapter.vec_isa_candidates():
            thread = threading.Thread(
                target=_probe, args=(isa,), name=f"precompile-vec-isa-{isa}", daemon=True
            )
            thread.start()
            _threads.append(thread)


def wait() -> None:
    """Until the probes started are done (before inductor's cache dir is pointed
    elsewhere: their programs belong in the caller's)."""
    with _lock:
        threads = list(_threads)
    for thread in threads:
        thread.join()


def vec_isa() -> tuple[str, str]:
    """The ISA inductor builds for here and its flags, probed in parallel if not yet."""
    start()
    wait()
    return adapter.vec_isa()
