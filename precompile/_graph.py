"""What the compile side knows about a caller's graph: its inputs, symbols and hints."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy
import torch

_ZERO = sympy.Integer(0)


@dataclass(frozen=True)
class GraphInput:
    """One flat input as the compile sees it: a tensor template, a SymInt or an int."""

    kind: str  # "tensor" | "int"
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    requires_grad: bool = False
    shape: tuple[sympy.Expr, ...] = ()
    stride: tuple[sympy.Expr, ...] = ()
    storage_offset: sympy.Expr = _ZERO
    value: sympy.Expr = _ZERO  # for "int"
    # A 0-d tensor Dynamo made of a Python float (``specialize_float=False``): the value
    # the variants are specialized to, and the caller's SymFloat for it (if any).
    scalar: float | None = None
    scalar_symbol: Any = None
    static_address: bool = False  # Dynamo marked it static (a module parameter or buffer)
    # It indexes a table of this many rows (an embedding): its values must lie in [0, rows)
    index_rows: int | None = None
    # Where the caller's value comes from (Dynamo's source, ``L['x']``, or the
    # placeholder's name): what errors and ``CompiledArtifact.inputs`` call it
    name: str | None = None


@dataclass(frozen=True)
class GraphDescription:
    """The caller's graph as seen by the compile: its flat inputs, its size symbols with
    their hints and ranges, the ShapeEnv they live in, and the structure of its output."""

    inputs: tuple[GraphInput, ...]
    symbols: tuple[sympy.Symbol, ...]
    hints: Mapping[sympy.Symbol, int]
    ranges: Mapping[sympy.Symbol, tuple[int, int | None]]
    caller_shape_env: Any | None
    # upstream's pytree spec (JSON) of an output that is not a flat tuple/list, else None
    output_spec: str | None = None
    # each flat output's symbolic shape (None where it is not a tensor or not known)
    output_shapes: tuple[tuple[sympy.Expr, ...] | None, ...] | None = None
    # what the caller's trace assumed of the sizes beyond their ranges (a branch on
    # ``s % 2 == 0``): the graph holds only where these do, so every variant keeps them
    caller_guards: tuple[sympy.Expr, ...] = ()


# In every cache key of a graph with a backward (``has_backward``): such graphs compiled
# before this policy serve their hint's size only.
BACKWARD_POLICY = "backward 1: 0/1 guards, not size-oblivious"


def has_backward(graph: GraphDescription) -> bool:
    """Whether compiling ``graph`` now gives it a backward graph: grad enabled and an
    input requiring grad. Such a graph is never traced size-obliviously: AOTAutograd,
    compiling the backward with the forward, restrides each saved activation to the
    forward's strides evaluated at the hint wherever it cannot prove them equal for every
    size, which a size-oblivious trace never can (a tiny Llama in train mode: the
    backward failed at every length but the hint's, ``expected size 17==17, stride
    17==16``)."""
    return torch.is_grad_enabled() and any(item.requires_grad for item in graph.inputs)
