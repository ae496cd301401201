"""How compiled random ops draw: from the caller's generator, as eager draws them.

Inductor's own lowering of random ops (dropout in ``train()`` mode, ``torch.rand``) draws
from its own seeds: under the same ``torch.manual_seed`` the values differ from eager's,
and a random op whose result goes unused is dropped, so the draws after it differ too.
With inductor's ``fallback_random`` they are calls of aten's random ops in program order:
equal to eager bit for bit (measured on CPU: dropout, ``rand_like`` and ``randn`` in one
forward, compiled against eager under one seed), and the generator is left where eager
leaves it. Graphs without random ops compile to the same code either way. The cost, on a
graph that draws: 4-15% per call on a tiny Llama in ``train()`` mode with attention
dropout (CPU, 16 and 256 tokens, against inductor's own random numbers).

Options that set ``fallback_random`` (``options["config_patches"]``) are applied inside
the compile and so stay the caller's choice.

A graph that draws is marked in its manifest (``draws_random``): a serving process then
never runs it but for the caller, since any other run (a warm-up thread, a CUDA graph's
capture) would move the caller's generator.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from ._compiler_config import caller_switch

# What every variant's compile sets.
PATCHES: Mapping[str, Any] = {"fallback_random": True}
# In every cache key: a build under another policy compiled other code.
POLICY = (
    "random 1: random ops call aten's, in eager's order (fallback_random), unless the caller chose"
)


def inductors_random_numbers(options: Mapping[str, Any] | None) -> bool:
    """Whether the caller's compile options keep inductor's own random numbers (their
    ``config_patches`` set ``fallback_random`` to False): not eager's, by their choice.
    Any value but True or False there is refused, naming it."""
    return caller_switch(options, "fallback_random") is False


# Names of the torch functions and Tensor methods that draw (in-place forms end in "_").
_DRAWING = frozenset({
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
    "bernoulli", "multinomial", "normal", "poisson", "uniform", "exponential", "geometric",
    "cauchy", "log_normal", "rrelu", "random",
})  # fmt: skip
# Functions that draw only when their arguments say so; for each built-in (whose signature
# Python cannot read), where those arguments sit: name -> position.
_SOMETIMES = {
    "scaled_dot_product_attention": {"dropout_p": 4},
    "dropout": {"p": 1, "train": 2},  # torch.dropout (torch.nn.functional's is Python)
    "alpha_dropout": {"p": 1, "train": 2},
    "feature_dropout": {"p": 1, "train": 2},
    "feature_alpha_dropout": {"p": 1, "train": 2},
}


def _arguments(node: torch.fx.Node, name: str) -> dict[str, Any] | None:
    """A call's arguments by name (defaults filled in), or None where unreadable."""
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        positions = _SOMETIMES.get(name)
        if positions is None:
            return None
        found = dict(node.kwargs)
        for argument, position in positions.items():
            if len(node.args) > position:
                found[argument] = node.args[position]
        return found
    bound.apply_defaults()
    return dict(bound.arguments)


def draws_random(node: torch.fx.Node) -> bool:
    """Whether a traced node may draw from a random generator: ``torch.rand``, dropout
    in training, attention with dropout. A dropout whose ``training`` (or ``train``) is
    the constant False, or whose probability is 0, draws nothing, nor does attention
    whose ``dropout_p`` is 0; an argument that cannot be read counts as drawing."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = str(node.target if node.op == "call_method" else getattr(node.target, "__name__", ""))
    name = name.rstrip("_")
    if name in _DRAWING:
        return True
    if "dropout" not in name and name not in _SOMETIMES:
        return False
    arguments = _arguments(node, name) if node.op == "call_function" else None
    if arguments is None:
        return True
    if "dropout_p" in arguments or name == "scaled_dot_product_attention":
        return bool(arguments.get("dropout_p", 0.0) != 0)
    training = arguments.get("training", arguments.get("train", True))
    return not (training is False or arguments.get("p") == 0)


def graph_draws_random(gm: torch.fx.GraphModule) -> bool:
    """Whether any node of ``gm`` (or of a subgraph it calls) may draw."""
    graphs = [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    return any(draws_random(node) for graph in graphs for node in graph.graph.nodes)
