"""Drop-in details beyond upstream's own test cases (tests/compile/test_upstream_standalone.py):
arguments a torch version lacks, ``fake_mode``'s checks, the grad rule's evidence kept
across save and load, and the output structure option."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import precompile
from precompile import _torch_adapter as compile_adapter
from precompile import _variant_compile


def _capture(fn: Any, *args: Any) -> tuple[torch.fx.GraphModule, list[Any]]:
    seen: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **_: Any) -> Any:
        seen["gm"], seen["inputs"] = gm, example_inputs
        return gm

    torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return seen["gm"], seen["inputs"]


@pytest.fixture(scope="module")
def linear_under_no_grad() -> tuple[torch.nn.Linear, Any, torch.fx.GraphModule, list[Any]]:
    """A graph that runs a module under ``torch.no_grad()``: its parameters are lifted as
    inputs that require grad, and no output depends on them through autograd."""
    torch.manual_seed(0)
    mod = torch.nn.Linear(3, 5)

    def f(x: torch.Tensor) -> Any:
        with torch.no_grad():
            return mod(x), x.cos()

    gm, inputs = _capture(f, torch.randn(4, 3))
    return mod, f, gm, inputs


def test_arguments_the_installed_torch_lacks_are_a_type_error(
    monkeypatch: pytest.MonkeyPatch, linear_under_no_grad: Any
) -> None:
    _, _, gm, inputs = linear_under_no_grad
    torch_2_11 = frozenset({"gm", "example_inputs", "dynamic_shapes", "options", "aot"})
    monkeypatch.setattr(compile_adapter, "upstream_standalone_parameters", lambda: torch_2_11)
    for name, value in (("donate_graph_module", True), ("donate_graph_module", False)):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            precompile.standalone_compile(gm, inputs, **{name: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'fake_mode'"):
        precompile.standalone_compile(gm, inputs, fake_mode=None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        precompile.standalone_compile(gm, inputs, no_such_option=1)  # type: ignore[call-arg]


def test_fake_mode_is_checked_as_upstream_checks_it(linear_under_no_grad: Any) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    if "fake_mode" not in compile_adapter.upstream_standalone_parameters():
        pytest.skip("this torch's standalone_compile takes no fake_mode")
    _, _, gm, inputs = linear_under_no_grad
    with pytest.raises(precompile.InvalidOptionError, match="from_example_inputs"):
        precompile.standalone_compile(gm, inputs, fake_mode=FakeTensorMode())
    with pytest.raises(precompile.InvalidOptionError, match="ShapeEnv"):
        precompile.standalone_compile(
            gm, inputs, dynamic_shapes="from_example_inputs", fake_mode=FakeTensorMode()
        )
    with pytest.raises(ValueError, match="aot must be True or False"):
        precompile.standalone_compile(gm, inputs, aot="yes")  # type: ignore[arg-type]


def test_no_grad_inside_the_graph_is_served_with_grad_enabled_and_after_a_load(
    tmp_path: Any, linear_under_no_grad: Any
) -> None:
    mod, f, gm, inputs = linear_under_no_grad
    art = precompile.standalone_compile(gm, inputs, cache=False)
    assert [spec.grad_unused for spec in art.manifest.inputs] == [True, True, False]
    x = torch.randn(4, 3)
    args = [mod.weight, mod.bias, x]
    assert torch.is_grad_enabled() and mod.weight.requires_grad
    expected = f(x)
    for _ in range(2):  # the Python check, then the C++ guard built from the first call
        out = art(*args)
        torch.testing.assert_close(out[0], expected[0])
        assert not out[0].requires_grad
    path = os.path.join(str(tmp_path), "a.pt2c")
    art.save(path=path)
    loaded = precompile.CompiledArtifact.load(path=path)
    assert [spec.grad_unused for spec in loaded.manifest.inputs] == [True, True, False]
    torch.testing.assert_close(loaded(*args)[0], expected[0])
    # The evidence covers the inputs that required grad at compile time, no others: x
    # requiring grad would connect x.cos() to autograd in eager.
    with pytest.raises(precompile.InputMismatchError, match=r"input 2 (\([^)]*\) )?requires grad"):
        art(mod.weight, mod.bias, x.clone().requires_grad_())


def test_a_graph_compiled_under_no_grad_still_refuses_inputs_requiring_grad() -> None:
    """Compiled under ``torch.no_grad()``, nothing proves the parameters reach no output
    (they do: eager's result would need grad), so grad-mode calls are refused."""
    torch.manual_seed(0)
    mod = torch.nn.Linear(3, 5)
    gm, inputs = _capture(lambda x: mod(x).relu(), torch.randn(4, 3))
    with torch.no_grad():
        art = precompile.standalone_compile(gm, inputs, cache=False)
    assert not any(getattr(spec, "grad_unused", False) for spec in art.manifest.inputs)
    args = [mod.weight, mod.bias, torch.randn(4, 3)]
    with pytest.raises(precompile.InputMismatchError, match="requires grad"):
        art(*args)
    with torch.no_grad():
        torch.testing.assert_close(art(*args)[0], mod(args[2]).relu())


def test_output_structure_is_checked(tmp_path: Any, linear_under_no_grad: Any) -> None:
    _, _, gm, inputs = linear_under_no_grad
    path = os.path.join(str(tmp_path), "a.pt2c")
    precompile.standalone_compile(gm, inputs, cache=False).save(path=path)
    with pytest.raises(precompile.InvalidOptionError, match="output_structure"):
        precompile.CompiledArtifact.load(path=path, output_structure="tuple")  # type: ignore[arg-type]


def test_a_failing_size_oblivious_compile_falls_back_to_guarded_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Size-oblivious tracing is experimental in torch (torch 2.11 failed to lower a
    KV-cache graph with it): a variant whose size-oblivious compile fails is compiled
    again with 0/1 guards, which refuse the sizes it was not traced for: 1 then gets a
    variant of its own (the range holds it)."""
    compile_once = _variant_compile._compile_once
    attempts: list[bool] = []

    def failing_when_oblivious(*args: Any) -> Any:
        oblivious = args[5]  # (gm, graph, point, dynamic, options, size_oblivious, attention)
        attempts.append(oblivious)
        if oblivious:
            from torch._inductor.exc import InductorError

            raise InductorError(KeyError("unbacked_bindings"), None)
        return compile_once(*args)

    monkeypatch.setattr(_variant_compile, "_compile_once", failing_when_oblivious)
    x = torch.randn(8, 4)
    torch._dynamo.mark_dynamic(x, 0)
    gm, inputs = _capture(lambda t: t * t.shape[0] + (t.sum(-1, keepdim=True) == 1), x)
    art = precompile.standalone_compile(gm, inputs, hints=[8], cache=False)
    assert attempts == [True, False, False]  # hint 8, again guarded, then 1
    assert [list(v.point.values()) for v in art.manifest.variants] == [[8], [1]]
    for size in (5, 1):
        y = torch.randn(size, 4)
        expected = y * size + (y.sum(-1, keepdim=True) == 1)
        torch.testing.assert_close(art(size, y)[0], expected)
