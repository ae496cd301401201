"""What a trace read is what a compiled model checks (issue 30).

One small module is compiled once; other instances of its class, differing in one
attribute the forward reads, are then bound to it through every way a compiled model is
bound (a saved file, a cache key, ``compile_model`` with ``compile=False``): each is
refused, naming the attribute by its path and both values, where it used to be served
the first model's graph. The global state a trace runs under (autocast, grad mode,
default dtype, ...) is in every key and checked per call; changes to a bound model after
binding are refused at its next call.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import precompile
from precompile.runtime import compiler_interface
from precompile.runtime.compiler_interface import trace_state


class Configured(torch.nn.Module):
    """A forward that reads attributes of many types."""

    def __init__(
        self,
        act: Any = torch.relu,
        perm: tuple[int, ...] = (1, 0, 2),
        scales: list[float] | None = None,
        dtype: torch.dtype = torch.float32,
        eps: float = 1e-5,
        use_norm: bool = True,
    ) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8, eps=eps)
        self.act = act
        self.perm = perm
        self.scales = scales if scales is not None else [1.0, 2.0]
        self.dtype = dtype
        self.use_norm = use_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.proj(x)).to(self.dtype)
        if self.use_norm:
            y = self.norm(y)
        return y.permute(*self.perm) * self.scales[1]


OTHERS = [
    ({"act": torch.tanh}, r"model\.act is .*tanh, compiled with .*relu"),
    ({"perm": (2, 0, 1)}, r"model\.perm is \(2, 0, 1\), compiled with \(1, 0, 2\)"),
    ({"scales": [1.0, 3.0]}, r"model\.scales\[1\] is 3\.0, compiled with 2\.0"),
    ({"scales": [1.0, 2.0, 5.0]}, r"model\.scales is a builtins\.list of length 3"),
    ({"dtype": torch.float64}, r"model\.dtype is torch\.float64, compiled with torch\.float32"),
    ({"eps": 0.5}, r"model\.norm\.eps is \(0\.5,?\)|model\.norm\.eps is 0\.5"),
    ({"use_norm": False}, r"model\.use_norm is False, compiled with True"),
]


def _example() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, 5, 8)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    store = str(tmp_path_factory.mktemp("trace-read-cache"))
    model = Configured().eval()
    with torch.no_grad():
        result = precompile.compile_model(
            model, (_example(),), dynamic={0: [1]}, hints=[4], cache=store, warmup=False
        )
    path = str(tmp_path_factory.mktemp("trace-read") / "configured.pt2c")
    result.save(path)
    return {"model": model, "compiled": result, "cache": store, "path": path}


def test_the_compiled_model_serves_its_own_model(compiled: dict[str, Any]) -> None:
    model = Configured().eval()
    model.load_state_dict(compiled["model"].state_dict())
    loaded = precompile.load_model(model, path=compiled["path"], warmup=False)
    with torch.no_grad():
        for seq in (2, 3, 9):
            x = torch.randn(2, seq, 8)
            torch.testing.assert_close(loaded(x), model(x))


@pytest.mark.parametrize(("change", "said"), OTHERS, ids=[next(iter(c)) for c, _ in OTHERS])
def test_a_model_that_differs_in_what_the_trace_read_is_refused(
    compiled: dict[str, Any], change: dict[str, Any], said: str
) -> None:
    other = Configured(**change).eval()
    with pytest.raises(precompile.IncompatibleArtifactError, match=said):
        precompile.load_model(other, path=compiled["path"], warmup=False)
    with pytest.raises(precompile.IncompatibleArtifactError, match=said):
        precompile.load_model(
            other, key=compiled["compiled"].cache_key, cache=compiled["cache"], warmup=False
        )
    # compile=False finds no entry that fits (the same key, another model): refused,
    # never the first model's graph, and the refusal says why
    refusal = f"{said}|differs in: .*model_settings"  # the key's digest sees some of these
    with torch.no_grad(), pytest.raises(precompile.ArtifactNotFoundError, match=refusal):
        precompile.compile_model(
            other, (_example(),), dynamic={0: [1]}, hints=[4], cache=compiled["cache"],
            warmup=False, compile=False,
        )  # fmt: skip


def test_calls_under_other_global_state_are_refused(compiled: dict[str, Any]) -> None:
    """Compiled under no_grad, fp32: autocast, grad mode and the default dtype change
    what the trace computes; a call under another is refused, inference mode is not."""
    model, result = compiled["model"], compiled["compiled"]
    x = _example()
    with (
        torch.no_grad(),
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(precompile.InputMismatchError, match=r"autocast is .*bfloat16"),
    ):
        result(x)
    with pytest.raises(precompile.InputMismatchError, match="grad_mode is True"):
        result(x)
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad(), pytest.raises(precompile.InputMismatchError, match="default_dtype"):
            result(x)
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.inference_mode():
        torch.testing.assert_close(result(x), model(x))


def test_the_global_state_is_in_the_model_key(compiled: dict[str, Any]) -> None:
    """The same model and call under autocast is another key: offline it is a miss
    naming the factor, never the fp32 graph."""
    model = compiled["model"]
    with (
        torch.no_grad(),
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(precompile.ArtifactNotFoundError, match="global_state"),
    ):
        precompile.compile_model(
            model, (_example(),), dynamic={0: [1]}, hints=[4], cache=compiled["cache"],
            warmup=False, compile=False,
        )  # fmt: skip


def test_trace_state_names_what_changes_a_trace() -> None:
    base = trace_state()
    changes = {
        "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        "grad_mode": torch.no_grad,
    }
    for field, context in changes.items():
        with context():
            assert trace_state()[field] != base[field]
    for field, set_it, reset in (
        ("default_dtype", lambda: torch.set_default_dtype(torch.float64),
         lambda: torch.set_default_dtype(torch.float32)),
        ("deterministic_algorithms", lambda: torch.use_deterministic_algorithms(True),
         lambda: torch.use_deterministic_algorithms(False)),
        ("float32_matmul_precision", lambda: torch.set_float32_matmul_precision("high"),
         lambda: torch.set_float32_matmul_precision("highest")),
    ):  # fmt: skip
        set_it()
        try:
            assert trace_state()[field] != base[field]
        finally:
            reset()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the thread count changes no traced graph: not part of the state
        assert trace_state() == base
    finally:
        torch.set_num_threads(threads)


def test_changes_after_binding_are_refused_at_the_next_call(compiled: dict[str, Any]) -> None:
    model = Configured().eval()
    hooks: list[Any] = []
    model.load_state_dict(compiled["model"].state_dict())
    bound = precompile.load_model(model, path=compiled["path"], warmup=False)
    x = _example()
    with torch.no_grad():
        torch.testing.assert_close(bound(x), model(x))
        # a parameter re-assigned (same shape): served with the new values, as eager is
        model.proj.weight = torch.nn.Parameter(torch.randn(8, 8))
        torch.testing.assert_close(bound(x), model(x))
        # a submodule replaced by one of another class: refused
        model.norm = torch.nn.Identity()  # type: ignore[assignment]
        with pytest.raises(precompile.IncompatibleArtifactError, match=r"model\.norm is a"):
            bound(x)
        model.norm = torch.nn.LayerNorm(8, eps=1e-5)
        torch.testing.assert_close(bound(x), model(x))
        model.norm.train()  # LayerNorm reads no training flag: nothing to refuse
        torch.testing.assert_close(bound(x), model(x))
        # a plain attribute set in place: refused at the next call, as check_model does
        model.perm = (2, 1, 0)
        with pytest.raises(precompile.IncompatibleArtifactError, match=r"model\.perm is"):
            bound.check_model()
        changed = r"changed under .* after it was bound: .*"
        with pytest.raises(precompile.InputMismatchError, match=changed + r"model\.perm is"):
            bound(x)
        model.perm = (1, 0, 2)
        torch.testing.assert_close(bound(x), model(x))
        model.use_norm = bool(1)  # set again, to an equal value: still served
        torch.testing.assert_close(bound(x), model(x))
        for change, undo, said in [
            # an item of a list set in place, and the list grown
            (lambda: model.scales.__setitem__(1, 3.0), lambda: model.scales.__setitem__(1, 2.0),
             r"model\.scales\[1\] is 3\.0"),
            (lambda: model.scales.append(5.0), model.scales.pop, r"length 3"),
            # a forward set on a submodule's instance, a hook registered on a submodule
            (lambda: setattr(model.norm, "forward", lambda y: y),
             lambda: vars(model.norm).pop("forward"), r"model\.norm has 'forward'"),
            (lambda: hooks.append(model.proj.register_forward_hook(lambda m, a, o: o * 0)),
             lambda: hooks.pop().remove(), r"model\.proj\._forward_hooks is not empty"),
        ]:  # fmt: skip
            change()
            with pytest.raises(precompile.InputMismatchError, match=changed + said):
                bound(x)
            undo()
            torch.testing.assert_close(bound(x), model(x))


def test_skipping_the_per_call_reads_is_explicit_and_keeps_the_other_checks(
    compiled: dict[str, Any],
) -> None:
    """``skip_guard_eval_unsafe()`` (as torch.compile's stance of that name): a value the
    trace read, changed while skipped, is answered from the traced graph (what the
    opt-out risks), ``check_model()`` still refuses it, the mode and a hook registered on
    a submodule are still checked per call, and resuming refuses it at the next call."""
    model = Configured().eval()
    model.load_state_dict(compiled["model"].state_dict())
    bound = precompile.load_model(model, path=compiled["path"], warmup=False)
    x = _example()
    with torch.no_grad():
        traced = bound(x)
        assert bound.skip_guard_eval_unsafe() is bound
        model.scales[1] = 3.0  # the forward scales by it: eager answers otherwise
        assert not torch.allclose(model(x), traced)
        torch.testing.assert_close(bound(x), traced)  # skipped: the traced answer
        with pytest.raises(precompile.IncompatibleArtifactError, match=r"model\.scales\[1\]"):
            bound.check_model()
        model.scales[1] = 2.0
        model.train()
        try:
            with pytest.raises(precompile.InputMismatchError, match="train"):
                bound(x)
        finally:
            model.eval()
        hook = model.proj.register_forward_hook(lambda m, a, o: o * 0)  # still refused
        try:
            with pytest.raises(precompile.InputMismatchError, match=r"_forward_hooks"):
                bound(x)
        finally:
            hook.remove()
        torch.testing.assert_close(bound(x), model(x))
        model.scales[1] = 3.0
        bound.skip_guard_eval_unsafe(False)
        with pytest.raises(precompile.InputMismatchError, match=r"model\.scales\[1\] is 3"):
            bound(x)
        model.scales[1] = 2.0
        torch.testing.assert_close(bound(x), model(x))


def _closing_over(value: float) -> tuple[torch.nn.Module, Callable[[float, str], None], Any]:
    """A model whose forward reads a closure cell, a helper whose cell it reads through
    a call, and a setter of both cells (``nonlocal``)."""
    scale = value
    factor = value

    def helper(x: torch.Tensor) -> torch.Tensor:
        return x * factor

    class Closing(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * scale + helper(x)

    def set_cells(new: float, which: str) -> None:
        nonlocal scale, factor
        if which == "scale":
            scale = new
        else:
            factor = new

    return Closing(), set_cells, helper


def test_a_closure_cell_set_again_after_binding_is_refused() -> None:
    """A cell of the forward's closure, or of a function it calls, set again after
    binding (``nonlocal``): refused at the next call and by ``check_model()`` (the bind
    had kept a copy of the forward's cells, so both served the traced value), served
    again once set back."""
    model, set_cells, _ = _closing_over(2.0)
    x = torch.randn(4, 8)
    with torch.no_grad():
        bound = precompile.compile_model(model, (x,), dynamic={0: [0]}, cache=False)
        torch.testing.assert_close(bound(x), model(x))
        cells = [
            ("scale", r"closure scale> is 3\.0"),
            ("factor", r"helper>?\.__closure__\[0\]\.cell_contents is 3\.0"),
        ]
        for which, said in cells:
            set_cells(3.0, which)
            with pytest.raises(precompile.InputMismatchError, match=said):
                bound(x)
            with pytest.raises(precompile.IncompatibleArtifactError, match=said):
                bound.check_model()
            set_cells(2.0, which)
            torch.testing.assert_close(bound(x), model(x))


def test_a_submodule_deleted_or_set_in_its_registry_after_binding_is_refused_or_served() -> None:
    """No registration hook sees ``del m.act``, ``m._modules[k] = v`` (torch's own
    quantization ``convert`` sets its swapped modules so) or a registry replaced whole
    (``ModuleList.__delitem__`` makes a new one): the bound model had answered with the
    modules it bound (1.41 from eager's output with a Tanh set in a ReLU's place, 0.88
    with another Linear, 0.67 with a ModuleList's layers reordered). Now a submodule set
    there is served with its own weights where every guard the trace read still holds,
    refused naming it where one does not, and a deleted one is refused, said once."""

    class Small(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
            self.act = torch.nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return self.act(x)

    torch.manual_seed(0)
    model, x = Small().eval(), torch.randn(2, 4)
    with torch.no_grad():
        bound = precompile.compile_model(model, (x,), cache=False, warmup=False)
        torch.testing.assert_close(bound(x), model(x))
        model.layers._modules["0"] = torch.nn.Linear(4, 4)
        torch.testing.assert_close(bound(x), model(x))
        registry = model.layers._modules
        model.layers._modules = {"0": registry["1"], "1": registry["0"]}  # reordered
        torch.testing.assert_close(bound(x), model(x))
        bound.check_model()
        model.layers._modules = registry  # back as bound: watched as checked last
        torch.testing.assert_close(bound(x), model(x))
        model._modules["act"] = torch.nn.Tanh()
        with pytest.raises(precompile.InputMismatchError, match=r"model\.act is a torch\.nn.*Tanh"):
            bound(x)
        model._modules["act"] = torch.nn.ReLU()
        torch.testing.assert_close(bound(x), model(x))
        del model.act
        with pytest.raises(precompile.InputMismatchError, match=r"model\.act cannot be read") as e:
            bound(x)
        assert str(e.value).count("cannot be read") == 1


SAME_LINE = [lambda x: x * 2.0, lambda x: x * 3.0]  # one name, one line, other code


def test_a_function_swapped_for_one_of_the_same_name_and_line_is_refused() -> None:
    """A ``named`` guard compares a function by name and line, which two lambdas of one
    line share: the bound model had answered with the traced one's code (1.77 off
    eager). Set after binding, another code is refused at the next call and by
    ``check_model()``; the same function set back, or a function made again with the
    same code and closure, is served."""

    def make(k: float) -> Any:
        def scaled(x: torch.Tensor) -> torch.Tensor:
            return x * k

        return scaled

    class Holding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.fn, self.scale = SAME_LINE[0], make(2.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scale(self.fn(self.lin(x)))

    torch.manual_seed(0)
    model, x = Holding().eval(), torch.randn(2, 4)
    with torch.no_grad():
        bound = precompile.compile_model(model, (x,), cache=False, warmup=False)
        torch.testing.assert_close(bound(x), model(x))
        model.fn = SAME_LINE[1]
        said = r"replaced after binding by one of the same name and line with other code: 'fn'"
        with pytest.raises(precompile.InputMismatchError, match=said):
            bound(x)
        with pytest.raises(precompile.IncompatibleArtifactError, match=said):
            bound.check_model()
        model.fn = SAME_LINE[0]
        torch.testing.assert_close(bound(x), model(x))
        model.scale = make(2.0)  # made again: the same code, an equal closure
        torch.testing.assert_close(bound(x), model(x))


def _iterating_and_holding() -> tuple[torch.nn.Module, dict[str, float], torch.nn.Module]:
    """A forward that iterates a dict of its closure and one of its own, and calls a
    module its closure holds (outside the model), beside a buffer of its own."""
    weights = {"a": 2.0, "b": 3.0}
    block = torch.nn.Sequential(torch.nn.LeakyReLU(0.1))

    class Iterating(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.own = {"a": 2.0, "b": 3.0}
            self.register_buffer("shift", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = block(self.lin(x))
            for v in weights.values():
                y = y * v + 1.0
            for v in self.own.values():
                y = y * v + 1.0
            return y + self.shift

    return Iterating().eval(), weights, block


def test_what_a_second_trial_found_served_after_binding_is_refused() -> None:
    """A client trial of the per-call check found these answered from the traced graph
    (or a bare KeyError): a dict the forward iterated, reordered with the same keys and
    values (Dynamo guards its key order); a child replaced in a module the forward's
    closure holds (no registration hook watched it); a buffer deleted. Each is refused
    now, and served again once undone."""
    model, weights, block = _iterating_and_holding()
    x = torch.randn(3, 4)
    with torch.no_grad():
        bound = precompile.compile_model(model, (x,), dynamic={0: [0]}, cache=False)
        torch.testing.assert_close(bound(x), model(x))
        for dictionary in (weights, model.own):
            dictionary["a"] = dictionary.pop("a")  # keys now b, a: eager multiplies otherwise
            with pytest.raises(precompile.InputMismatchError, match=r"has keys \['b', 'a'\]"):
                bound(x)
            dictionary["b"] = dictionary.pop("b")
            torch.testing.assert_close(bound(x), model(x))
        leaky, block[0] = block[0], torch.nn.ReLU()
        with pytest.raises(precompile.IncompatibleArtifactError, match=r"block>\.0 is a .*ReLU"):
            bound(x)
        block[0] = leaky
        torch.testing.assert_close(bound(x), model(x))
        shift = model.shift
        del model.shift
        with pytest.raises(precompile.InputMismatchError, match="buffer shift was deleted"):
            bound(x)
        model.register_buffer("shift", shift)
        torch.testing.assert_close(bound(x), model(x))
        with pytest.raises(precompile.InvalidOptionError, match="True or False"):
            bound.skip_guard_eval_unsafe("False")  # type: ignore[arg-type]


SHIFT = 0.0  # a global the forward below reads


class Shifted(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + SHIFT


def test_a_global_the_forward_read_is_checked_per_call() -> None:
    """A module global set again after binding (a scalar Dynamo specialized the graph to)
    is refused at the next call, where it was served the traced value."""
    global SHIFT
    model, x = Shifted().eval(), _example()
    with torch.no_grad():
        bound = precompile.compile_model(model, (x,), cache=False, warmup=False)
        SHIFT = 1.0
        try:
            with pytest.raises(precompile.InputMismatchError, match=r"SHIFT is 1\.0, compiled"):
                bound(x)
        finally:
            SHIFT = 0.0
        torch.testing.assert_close(bound(x), model(x))


WEIGHTS = [1.0, 2.0]  # a global list the forward below indexes


def _scaled(x: torch.Tensor) -> torch.Tensor:  # a global function it calls
    return x * 2.0


class _Inner(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class ReadsAround(torch.nn.Module):
    """A forward reading a class attribute, a signed zero beside another attribute, a
    global list by index, a global function and a submodule's class forward."""

    K = 0.75

    def __init__(self) -> None:
        super().__init__()
        self.eps, self.z, self.inner = 1e-3, 0.0, _Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _scaled(self.inner(x)) * WEIGHTS[0] + self.eps
        return y * self.K * math.copysign(1.0, self.z) + (1.0 if hasattr(self, "extra") else 0.0)


class _Sub(ReadsAround):
    pass


def test_what_a_client_trial_found_served_after_binding_is_refused(tmp_path: Any) -> None:
    """A client trial of the per-call reads found these served the traced graph: a class
    attribute read as ``self.K`` (Dynamo reads it through ``dict(type(self).__dict__)``),
    0.0 set to -0.0 (equal, not the same), a global list rebound to a new list, a global
    function's code swapped, a submodule's forward replaced on its class. Each is now
    refused at the next call, and served again once set back."""
    global WEIGHTS
    model, x = _Sub().eval(), _example()
    code, inner_forward = _scaled.__code__, _Inner.forward
    weights = WEIGHTS

    def rebind(value: list[float]) -> None:
        global WEIGHTS
        WEIGHTS = value

    with torch.no_grad():
        bound = precompile.compile_model(model, (x,), cache=False, warmup=False)
        cases = [
            (lambda: setattr(ReadsAround, "K", 2.0), lambda: setattr(ReadsAround, "K", 0.75),
             r"\['K'\] is 2\.0, compiled with 0\.75"),
            (lambda: setattr(model, "z", -0.0), lambda: setattr(model, "z", 0.0),
             r"model\.z is -0\.0, compiled with 0\.0"),
            (lambda: rebind([4.0, 2.0]), lambda: rebind(weights), r"WEIGHTS\[0\] is 4\.0"),
            (lambda: setattr(_scaled, "__code__", (lambda x: x * 3.0).__code__),
             lambda: setattr(_scaled, "__code__", code), r"_scaled"),
            (lambda: setattr(_Inner, "forward", lambda self, x: x + 2),
             lambda: setattr(_Inner, "forward", inner_forward),
             r"type\(model\.inner\)\.forward is .*compiled with .*_Inner\.forward"),
            # a subclass's attribute set where the base class defines it
            (lambda: setattr(_Sub, "K", 2.0), lambda: delattr(_Sub, "K"), r"_Sub\.K \(set"),
            (lambda: setattr(model, "extra", 1), lambda: delattr(model, "extra"),
             r"has an attribute 'extra', compiled without one"),
        ]  # fmt: skip
        for change, undo, said in cases:
            change()
            try:
                with pytest.raises(precompile.InputMismatchError, match=said):
                    bound(x)
            finally:
                undo()
            torch.testing.assert_close(bound(x), model(x))
        # a class's forward replaced before a bind: the load refuses it (Dynamo inlined
        # the forward and guards none of it; the trace read records each class's)
        path = str(tmp_path / "reads.pt2c")
        bound.save(path)
        _Inner.forward = lambda self, x: x + 2  # type: ignore[method-assign,assignment,misc]
        try:
            with pytest.raises(precompile.IncompatibleArtifactError, match=r"_Inner.*forward"):
                precompile.load_model(model, path=path, warmup=False)
        finally:
            _Inner.forward = inner_forward  # type: ignore[method-assign]
        torch.testing.assert_close(
            precompile.load_model(model, path=path, warmup=False)(x), model(x)
        )


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.embed(ids)))


def test_untied_weights_and_a_submodule_in_train_mode_are_refused(tmp_path: Any) -> None:
    model = Tied().eval()
    ids = torch.randint(0, 16, (1, 6))
    with torch.no_grad():
        bound = precompile.compile_model(
            model, (ids,), dynamic={0: [1]}, hints=[4], cache=False, warmup=False
        )
        torch.testing.assert_close(bound(ids), model(ids))
        model.drop.train()  # dropout reads its training flag: the trace was eval
        with pytest.raises(precompile.InputMismatchError, match=r"model\.drop\.training"):
            bound(ids)
        model.drop.eval()
        torch.testing.assert_close(bound(ids), model(ids))
        model.head.weight = torch.nn.Parameter(model.embed.weight.detach().clone() + 1)
        with pytest.raises(precompile.IncompatibleArtifactError, match="same object"):
            bound(ids)


def test_the_backend_key_holds_autocast(tmp_path: Any) -> None:
    """Issue 30, case 2: under autocast then without, Dynamo traces twice; the second
    trace used to find the bf16 artifact and return bfloat16 where eager returns fp32."""
    os.environ.setdefault("PRECOMPILE_CACHE_DIR", str(tmp_path))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    backend = precompile.backend(hints=[8], cache=str(tmp_path / "backend-cache"))
    x = torch.randn(4, 8)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = torch.compile(model, backend=backend)(x)
            assert low.dtype == torch.bfloat16
        torch.compiler.reset()
        full = torch.compile(model, backend=backend)(x)
        assert full.dtype == torch.float32
        torch.testing.assert_close(full, model(x))


class CountsCalls(torch.nn.Module):
    """A forward that writes Python state: a counter its output reads, and a log."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.calls = 0
        self.log: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.log.append(x.shape[0])
        return self.proj(x) * self.calls


def test_a_forward_that_writes_python_state_is_refused_and_left_as_it_was() -> None:
    """A compiled model runs none of the forward's Python: the counter never moved, and
    outputs differed from eager's from the second call on (found by a client trial)."""
    model = CountsCalls().eval()
    said = r"writes its Python state \(model\.calls, model\.log\)"
    with torch.no_grad(), pytest.raises(precompile.UnsupportedGraphError, match=said):
        precompile.compile_model(model, (torch.randn(4, 8),), cache=False, warmup=False)
    assert model.calls == 0 and model.log == []


def test_hooks_on_the_model_itself_are_refused(compiled: dict[str, Any]) -> None:
    """A hook on the model runs outside its forward, which is what is traced: refused at
    compile time (was 'tracing the model gave 2 graphs') and at a call after binding
    (was a silent difference: the compiled model ran no hook)."""
    model = Configured().eval()
    handle = model.register_forward_hook(lambda module, args, out: out + 100)
    refused = pytest.raises(precompile.UnsupportedGraphError, match="a forward hook on the model")
    with torch.no_grad(), refused:
        precompile.compile_model(model, (_example(),), cache=False, warmup=False)
    handle.remove()
    bound, x = compiled["compiled"], _example()
    handle = compiled["model"].register_forward_pre_hook(lambda module, args: None)
    try:
        with torch.no_grad(), pytest.raises(precompile.InputMismatchError, match="pre hook"):
            bound(x)
    finally:
        handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(bound(x), compiled["model"](x))


class _AddsToProducts(TorchDispatchMode):
    """A dispatch mode that changes what a product returns: eager runs it, a compiled
    kernel would not."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return out + 100 if func is torch.ops.aten.mul.Tensor else out


def test_a_call_under_a_dispatch_mode_is_refused(compiled: dict[str, Any]) -> None:
    """A hostile probe's call under a TorchDispatchMode was served the compiled values,
    100 off eager's (the mode sees eager's aten ops, not a compiled kernel's)."""
    with (
        torch.no_grad(),
        _AddsToProducts(),
        pytest.raises(precompile.InputMismatchError, match="torch_dispatch_modes"),
    ):
        compiled["compiled"](_example())


class _SignOf(torch.nn.Module):
    def forward(self, x: torch.Tensor, k: float) -> torch.Tensor:
        return x * math.copysign(1.0, k)


def test_a_float_argument_is_checked_by_its_sign_too() -> None:
    """-0.0 equals 0.0, but a forward may read its sign: it was served the traced sign."""
    model = _SignOf()
    with torch.no_grad():
        compiled = precompile.compile_model(model, (torch.randn(3, 4), 0.0), cache=False,
                                            warmup=False)  # fmt: skip
        x = torch.randn(3, 4)
        assert torch.equal(compiled(x, 0.0), model(x, 0.0))
        with pytest.raises(precompile.InputMismatchError, match=r"is -0.0.*compiled for 0.0"):
            compiled(x, -0.0)


class _BranchesOnAnUnusedArgument(torch.nn.Module):
    """``b`` is read (its dtype, its length against ``a``'s) but no op uses its values:
    Dynamo leaves it out of the graph."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if b.dtype != torch.float32:
            return a * 3
        return a * 2 if a.shape[0] == b.shape[0] else a * 4


def test_a_tensor_argument_the_graph_does_not_take_is_checked_as_traced() -> None:
    """A hostile probe: another dtype of ``b`` was served the traced branch (2.2 off
    eager), and so was a length of ``b`` other than ``a``'s, which the example had equal
    (Dynamo gave the two one symbol). Both are refused now; equal lengths are served."""
    model = _BranchesOnAnUnusedArgument()
    with torch.no_grad():
        compiled = precompile.compile_model(
            model, (torch.randn(3, 4), torch.randn(3)), dynamic={0: [0], 1: [0]}, cache=False,
            warmup=False,
        )  # fmt: skip
        a, b = torch.randn(7, 4), torch.randn(7)
        assert torch.equal(compiled(a, b), model(a, b))
        with pytest.raises(precompile.InputMismatchError, match="size 5 in dim 0, traced with 7"):
            compiled(a, torch.randn(5))
        with pytest.raises(precompile.InputMismatchError, match="dtype float64"):
            compiled(a, b.double())
        with pytest.raises(precompile.InputMismatchError, match="not contiguous"):
            compiled(a, torch.randn(14)[::2])


class _ScalesByDefault(torch.nn.Module):
    def forward(self, x: torch.Tensor, k: float = 2.0, *, shift: float = 0.0) -> torch.Tensor:
        return x * k + shift


def test_a_default_the_call_left_is_checked_as_the_trace_read_it() -> None:
    """A hostile probe changed the forward's default after compiling (and in a fresh
    process): it was served the traced default, 5.5 off eager. The defaults a call leaves
    are now read off the model's forward by the trace's guards: a bind (a fresh process,
    ``load_model``), ``check_model`` and each call refuse a changed one."""
    model = _ScalesByDefault()
    with torch.no_grad():
        compiled = precompile.compile_model(model, (torch.randn(3, 4),), cache=False,
                                            warmup=False)  # fmt: skip
        compiled.check_model()
        saved = _ScalesByDefault.forward.__defaults__, _ScalesByDefault.forward.__kwdefaults__
        x = torch.randn(3, 4)
        try:
            _ScalesByDefault.forward.__defaults__ = (5.0,)
            with pytest.raises(precompile.IncompatibleArtifactError, match="__defaults__"):
                compiled.check_model()
            # and per call, in the same binding (it was served the traced default)
            with pytest.raises(precompile.InputMismatchError, match=r"default .* changed"):
                compiled(x)
            _ScalesByDefault.forward.__defaults__ = (2.0,)  # another tuple, the same value
            assert torch.equal(compiled(x), model(x))
            _ScalesByDefault.forward.__defaults__ = saved[0]
            _ScalesByDefault.forward.__kwdefaults__ = {"shift": 1.0}
            with pytest.raises(precompile.IncompatibleArtifactError, match="__kwdefaults__"):
                compiled.check_model()
            with pytest.raises(precompile.InputMismatchError, match="__kwdefaults__"):
                compiled(x)
        finally:
            _ScalesByDefault.forward.__defaults__, _ScalesByDefault.forward.__kwdefaults__ = saved
        compiled.check_model()
        assert torch.equal(compiled(x), model(x))


def test_a_value_of_another_type_is_named_with_both() -> None:
    from precompile.runtime.compiler_interface import Guard
    from precompile.runtime.compiler_interface import GuardRoots as Roots

    guard = Guard("equals", ["attr", ["M"], "extra"], ["none"])
    holder = torch.nn.Module()
    holder.extra = torch.ones(1)  # type: ignore[assignment]
    said = guard.failure(Roots(holder, {}, {}))
    assert said is not None and "model.extra is a torch.Tensor value, compiled with None" in said


def test_a_global_dynamo_installed_under_an_id_is_never_a_check() -> None:
    """Dynamo names the globals it installs for guards after an object's id in the tracing
    process (``_140029843829712_c0``). Where such a name resolved while tracing (it may:
    it depends on the process's history), a check of it would refuse every later process:
    it is listed as unchecked instead."""
    from precompile._torch_adapter import GuardEntry
    from precompile._trace_read import trace_read

    class Small(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    model = Small()
    name = f"_{id(model)}_c0"
    globals()[name] = torch  # resolvable here, as in the tracing process
    try:
        entry = GuardEntry("CLASS_MATCH", (), f"G['{name}'].Tensor", True, torch.Tensor)
        read = trace_read(model, (torch.ones(2),), {}, [entry], None)
    finally:
        del globals()[name]
    assert read.guards == ()
    assert len(read.unchecked) == 1 and "not portable" in read.unchecked[0]


def test_guards_of_dynamos_wrapper_frame_are_read_as_the_models() -> None:
    """torch.nn's own modules are traced from Dynamo's wrapper frame around them
    (``inner(*args, **kwargs)`` calling ``fn``, the module): its ``L['fn']`` is the model,
    its ``L['args']`` the call; a global of that frame is one of Dynamo's module, not of
    the forward's, so it is listed as unchecked, never checked against the wrong module.
    Another code than the wrapper's or the forward's is refused, as before."""
    from precompile import _torch_adapter as adapter
    from precompile._torch_adapter import GuardEntry
    from precompile._trace_read import trace_read

    model = torch.nn.LayerNorm(8, eps=1e-3)
    wrapper = adapter.top_frame_wrapper(torch.compile(model, backend="eager"))
    assert wrapper is not None and adapter.top_frame_wrapper(torch.compile(Configured())) is None
    function = "G['__import_torch_dot_nn_dot_functional'].layer_norm"
    entries = [
        GuardEntry("EQUALS_MATCH", (), "L['fn'].eps", True, 1e-3),
        GuardEntry("SEQUENCE_LENGTH", (), "L['args']", True, (1,)),
        GuardEntry("FUNCTION_MATCH", (), function, True, torch.nn.functional.layer_norm),
        GuardEntry("MODULE_MATCH", (), "G['functools']", True, __import__("functools")),
    ]
    read = trace_read(model, (torch.ones(2, 8),), {}, entries, wrapper.__code__, wrapper)
    said = {(g.kind, compiler_interface.readable_guard_expr(g.expr)) for g in read.guards}
    assert said == {("equals", "model.eps"), ("named", "torch.nn.functional.layer_norm")}
    assert len(read.unchecked) == 1 and "global functools of Dynamo's wrapper" in read.unchecked[0]
    with pytest.raises(precompile.UnsupportedGraphError, match="not the model's forward"):
        trace_read(model, (torch.ones(2, 8),), {}, entries, Configured.forward.__code__, wrapper)


class _ReadsTheEnvironment(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.environ.get("PRECOMPILE_TEST_FLAG") == "1":
            return self.lin(x) * 2
        return self.lin(x)


class _ReadsRequiresGrad(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad or self.lin.weight.requires_grad:
            return self.lin(x) * 2
        return self.lin(x)


def test_an_environment_variable_the_forward_read_is_checked_per_call(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo guards ``os.environ.get("FLAG")`` as a bytes value of ``environ._data``:
    it was recorded as unchecked, and a changed variable was served the traced branch
    (1.73 off eager) in the same binding and in a new ``compile=False`` bind."""
    torch.manual_seed(0)
    model, x = _ReadsTheEnvironment().eval(), torch.randn(4, 8)
    monkeypatch.setenv("PRECOMPILE_TEST_FLAG", "1")
    with torch.no_grad():
        compiled = precompile.compile_model(model, (x,), hints=[4], cache=str(tmp_path),
                                            warmup=False)  # fmt: skip
        assert not compiled.plan.trace_read.unchecked
        torch.testing.assert_close(compiled(x), model(x))
        monkeypatch.setenv("PRECOMPILE_TEST_FLAG", "0")
        with pytest.raises(precompile.InputMismatchError, match="PRECOMPILE_TEST_FLAG"):
            compiled(x)
        with pytest.raises(precompile.ArtifactNotFoundError, match="PRECOMPILE_TEST_FLAG"):
            precompile.compile_model(model, (x,), hints=[4], cache=str(tmp_path), compile=False)
        monkeypatch.setenv("PRECOMPILE_TEST_FLAG", "1")
        torch.testing.assert_close(compiled(x), model(x))


def test_requires_grad_the_forward_read_is_checked_under_no_grad(tmp_path: Any) -> None:
    """The input contract compared ``requires_grad`` with the grad mode only, so under
    ``no_grad`` a flag the forward branched on, changed, was served the traced branch
    (1.5-1.7 off eager): a compiled model's tensors must keep their traced flags."""
    torch.manual_seed(0)
    model, x = _ReadsRequiresGrad().eval(), torch.randn(4, 8)
    model.requires_grad_(False)
    with torch.no_grad():
        compiled = precompile.compile_model(model, (x,), hints=[4], cache=str(tmp_path),
                                            warmup=False)  # fmt: skip
        torch.testing.assert_close(compiled(x), model(x))
        compiled(x)  # the fast path's C++ guard is built from this call
        model.lin.weight.requires_grad_(True)
        with pytest.raises(precompile.InputMismatchError, match=r"parameter lin\.weight"):
            compiled(x)
        model.lin.weight.requires_grad_(False)
        torch.testing.assert_close(compiled(x), model(x))
        with pytest.raises(precompile.InputMismatchError, match="requires_grad=True"):
            compiled(x.clone().requires_grad_(True))


def test_a_compiled_model_says_what_it_is(compiled: dict[str, Any]) -> None:
    text = repr(compiled["compiled"])
    assert text.startswith("<precompile.CompiledModel of ") and "variants" in text, text
    assert "precompile.CompiledArtifact" in text


def test_an_offline_miss_names_the_state_that_differs(compiled: dict[str, Any]) -> None:
    """ "differs in: global_state" did not say that it was the grad mode."""
    model = compiled["model"]
    with pytest.raises(precompile.ArtifactNotFoundError) as caught:
        precompile.compile_model(
            model, (_example(),), dynamic={0: [1]}, hints=[4], cache=compiled["cache"],
            warmup=False, compile=False,
        )  # fmt: skip
    text = str(caught.value)
    # (a key with grad on also names the backward's tracing policy: "backward, global_state")
    differing = text.split("differs in:")[1]
    assert "global_state" in differing and "grad" in differing, text
    assert "true here, false there" in text, text


class _ReadsAnUnsetVariable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if "PRECOMPILE_TEST_PRESENT" in os.environ:
            y = y - 3
        scale = float(os.getenv("PRECOMPILE_TEST_SCALE", "1"))
        return y * 2 if os.environ.get("PRECOMPILE_TEST_FLAG") == "1" else y * scale + 1


def test_an_environment_variable_unset_when_traced_is_checked_too(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo leaves no guard a backend sees for a variable the trace found unset: set
    later, it was served the traced branch (2.73 off eager; a client trial), also in a
    fresh process. Every name the forward looks up (``get``, ``in``, ``getenv``) is now
    checked, found or not."""
    for name in ("PRECOMPILE_TEST_FLAG", "PRECOMPILE_TEST_SCALE", "PRECOMPILE_TEST_PRESENT"):
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(0)
    model, x = _ReadsAnUnsetVariable().eval(), torch.randn(4, 8)
    with torch.no_grad():
        compiled = precompile.compile_model(model, (x,), hints=[4], cache=str(tmp_path),
                                            warmup=False)  # fmt: skip
        torch.testing.assert_close(compiled(x), model(x))
        for name, value in (("PRECOMPILE_TEST_FLAG", "1"), ("PRECOMPILE_TEST_SCALE", "3"),
                            ("PRECOMPILE_TEST_PRESENT", "")):  # fmt: skip
            monkeypatch.setenv(name, value)
            with pytest.raises(precompile.InputMismatchError, match=name):
                compiled(x)
            with pytest.raises(precompile.ArtifactNotFoundError, match=name):
                precompile.compile_model(model, (x,), hints=[4], cache=str(tmp_path),
                                         compile=False)  # fmt: skip
            monkeypatch.delenv(name)
        torch.testing.assert_close(compiled(x), model(x))
