"""Hostile inputs for the input contract, shared by the in-process tests and the
fresh-process ones (a subprocess imports this module and runs the same checks on a
loaded artifact).

Every case either computes what eager computes or raises InputMismatchError naming the
input: never a wrong number, never a crash.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import precompile

Flat = Callable[..., list[Any]]


class Projection(torch.nn.Module):
    """Per row: sum of relu(x @ W.T + b), plus x read directly by a generated kernel
    (aten matmul accepts any strides; a generated kernel reads the compiled ones).
    x is (rows, 8), rows dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x)).sum(1) + (x * x + x).sum(1)


class Accumulate(torch.nn.Module):
    """Writes its ``total`` input in place (a KV-cache-like buffer), returns x * 2."""

    def forward(self, total: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        total.add_(x.sum(0))
        return x * 2


class Rows(torch.nn.Module):
    """Returns a view of its input (an output aliasing an input) and its sum."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[1:], x.sum()


def _close(actual: Any, expected: torch.Tensor) -> None:
    value = actual[0] if isinstance(actual, (list, tuple)) else actual
    torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-4)


def _refused(call: Callable[[], Any], *fragments: str) -> str:
    try:
        call()
    except precompile.InputMismatchError as exc:
        message = str(exc)
        for fragment in fragments:
            assert fragment in message, (fragment, message)
        return message
    raise AssertionError("the call was not refused")


def check_projection(
    art: Any, model: Projection, flat: Flat, *, huge: bool = True, device: str = "cpu"
) -> list[str]:
    """Views of x and of the weight either compute the eager result or are refused."""
    seen = []
    torch.manual_seed(3)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device)

    base = randn(9, 16)
    cases = {
        "transposed": randn(8, 9).t(),
        "column slice": base[:, 8:],
        "row step": randn(18, 8)[::2],
        "expanded": randn(1, 8).expand(9, 8),
        "neg view": torch._neg_view(randn(9, 8)),
        "one row with odd strides": randn(3, 8)[1:2],
        "storage offset": randn(100)[4:76].view(9, 8),
    }
    if huge:
        # 2**26 rows all reading one row: compiled code for contiguous rows would read
        # 2 GiB past the end of a 32-byte buffer (a SIGSEGV with size_asserts=False).
        cases["expand 2**26 rows"] = randn(1, 8).expand(2**26, 8)
    cases["contiguous"] = base[:, :8].contiguous()  # last: earlier ones meet a fresh artifact
    with torch.no_grad():
        for name, x in cases.items():
            expected = model(x)
            _close(art(*flat(x)), expected)
            seen.append(name)
        # a transposed copy of the weight (a static input) is fitted too
        x = randn(5, 8)
        args = flat(x)
        index = next(i for i, a in enumerate(args) if a is model.proj.weight)
        args[index] = model.proj.weight.detach().t().contiguous().t()
        assert args[index].stride() == (1, 4)
        _close(art(*args), model(x))
        seen.append("transposed weight")
    x = randn(4, 8)
    _refused(lambda: art(*flat(x.to_sparse())), "input", "layout torch.sparse_coo")
    seen.append("sparse")

    class Tagged(torch.Tensor):
        pass

    _refused(lambda: art(*flat(x.as_subclass(Tagged))), "Tagged", "subclass")
    seen.append("subclass")
    needs_grad = randn(4, 8).requires_grad_()
    _refused(lambda: art(*flat(needs_grad)), "requires grad", "inference")
    with torch.no_grad():
        _close(art(*flat(needs_grad)), model(needs_grad))
    seen.append("requires_grad")
    _refused(lambda: art(*flat(x.double())), "dtype float32, got float64")
    seen.append("dtype")
    return seen


def check_accumulate(art: Any, flat: Flat) -> list[str]:
    """The graph writes ``total``: a total of another layout is copied in and the write is
    copied back; an overlapping or aliasing total is refused."""
    seen = []
    with torch.no_grad():
        x = torch.randn(5, 8)
        total = torch.zeros(8, 3).t()[0]  # a strided view (stride 3) of a bigger buffer
        expected_total = total + x.sum(0)
        _close(art(*flat(total, x)), x * 2)
        torch.testing.assert_close(total, expected_total)
        seen.append("strided total written back")
        contiguous = torch.zeros(8)
        art(*flat(contiguous, x))
        torch.testing.assert_close(contiguous, x.sum(0))
        seen.append("contiguous total")
        _refused(lambda: art(*flat(torch.zeros(1).expand(8), x)), "overlap")
        seen.append("expanded total")
        shared = torch.zeros(6, 8)
        said = _refused(lambda: art(*flat(shared[0], shared[1:])), "shares memory with")
        # it names both inputs (a client trial: it listed the written ones by index only)
        written, _, other = said.partition(" is written by the graph and shares memory with ")
        assert written and other.split(";")[0] and written != other.split(";")[0], said
        seen.append("total aliasing x")
    return seen


def check_rows(art: Any, flat: Flat) -> list[str]:
    """An output is a view of x: x of another layout cannot be copied, so it is refused;
    the view still aliases the caller's tensor where the layout matches."""
    seen = []
    with torch.no_grad():
        x = torch.randn(5, 8)
        view, total = art(*flat(x))
        torch.testing.assert_close(view, x[1:])
        assert view.data_ptr() == x[1:].data_ptr()
        torch.testing.assert_close(total, x.sum())
        seen.append("view of the caller's tensor")
        _refused(lambda: art(*flat(torch.randn(8, 5).t())), "view of it")
        seen.append("transposed refused")
    return seen
