"""How a loaded variant runs for one size tuple: the seam execution strategies plug into.

Dispatch picks a variant for a size tuple once and memoizes what to call. What it
memoizes comes from the artifact's executor: the variant's callable itself (direct
execution), or something that wraps it for that size, such as a captured CUDA graph
that replays it. Dispatch, formats and the input contract do not change with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Executor(Protocol):
    def runner(
        self, sizes: tuple[int, ...], variant: int, function: Callable[..., Any]
    ) -> Callable[..., Any]:
        """What a call with ``sizes``, dispatched to ``variant``, runs."""


class DirectExecutor:
    """Calls the variant's compiled code as it is."""

    def runner(
        self, sizes: tuple[int, ...], variant: int, function: Callable[..., Any]
    ) -> Callable[..., Any]:
        return function
