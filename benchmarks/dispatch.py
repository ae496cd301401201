"""Host time the runtime adds per call on the memoized path (CPU, one process).

    python benchmarks/dispatch.py
    python benchmarks/dispatch.py --served cuda [--out dispatch-served-h200.json]

Each graph is what Dynamo hands a backend. Its artifact runs over no-op variants, so
what is timed is the runtime alone (read the sizes, check the inputs, look the variant
up in the memo), without a kernel's run time to drown it. Per graph, side by side in
interleaved rounds (medians):

- ``art(*args)``: a direct call, every input checked (after the first call, Dynamo's C++
  tensor check does the per-tensor work);
- ``trusting_caller()``: what ``precompile.backend`` hands Dynamo, which has checked
  the inputs with its own guards already: only the sizes are read.

Graphs: ``x + 1`` (2 flat inputs), the demo MLP (8), and tiny Llamas of 2, 12 and 32
layers (24, 114 and 294 flat inputs, mostly parameters; a 7B Llama lifts about 291).

The model level (``compile_model``/``load_model``) adds what it checks of what the trace
read (``model_checks``): the guards it recorded from Dynamo's, checked once at bind,
and per call the global state, the training flags, every value the guards read and a
counter that torch's registration hooks move. Beside it, in the same interleaved
rounds, what ``torch.compile`` checks per call of the same model: Dynamo's guard tree
of the frame it compiled, evaluated on that frame's locals.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import torch  # noqa: E402

import precompile  # noqa: E402
from precompile._compiled_payload import InputUse  # noqa: E402
from precompile._graph_description import describe_graph  # noqa: E402
from precompile._standalone import _input_specs, _symbols  # noqa: E402
from precompile.runtime import Manifest, Variant  # noqa: E402
from precompile.runtime.compiler_interface import MemoryPayloads, current_environment  # noqa: E402

ROUND_S = 0.05  # each timed round runs about this long
ROUNDS = 15
NOOP_DIGEST = "0" * 64


class Tiny(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def capture(model: torch.nn.Module, x: torch.Tensor, dim: int) -> tuple[Any, list[Any]]:
    """The graph and example inputs Dynamo hands a backend, ``x``'s ``dim`` dynamic."""
    return precompile.capture_graph(model, x, dynamic={0: [dim]})


def _noop(*args: Any) -> None:
    return None


def hollow_artifact(gm: torch.fx.GraphModule, inputs: list[Any]) -> precompile.CompiledArtifact:
    """The artifact ``standalone_compile`` would describe for this graph, over one no-op
    variant: its input contract and dispatch are real, its compiled code does nothing."""
    graph = describe_graph(gm, inputs, "from_graph")
    symbols = _symbols(graph)
    uses = [InputUse("none", False)] * len(graph.inputs)
    manifest = Manifest(
        environment=current_environment("cpu"),
        symbols=symbols,
        inputs=_input_specs(graph, uses, False),
        variants=(Variant(0, "hint", {s.name: 16 for s in symbols}, (), NOOP_DIGEST, NOOP_DIGEST),),
    )
    return precompile.CompiledArtifact(manifest, MemoryPayloads({}), loaded={NOOP_DIGEST: _noop})


def per_call_ns(fn: Callable[..., Any], args: list[Any], calls: int) -> float:
    began = time.perf_counter_ns()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter_ns() - began) / calls


def calls_per_round(fn: Callable[..., Any], args: list[Any]) -> int:
    return max(100, int(ROUND_S * 1e9 / per_call_ns(fn, args, 100)))


def measure(name: str, model: torch.nn.Module, x: torch.Tensor, dim: int, n: int) -> list[Any]:
    gm, example_inputs = capture(model, x, dim)
    art = hollow_artifact(gm, example_inputs)
    shape = list(x.shape)
    shape[dim] = n
    xn = torch.randint(0, 100, shape) if not x.is_floating_point() else torch.randn(shape)
    args = [xn if t is x else (n if isinstance(t, torch.SymInt) else t) for t in example_inputs]
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]  # served weights
    trusting = art.trusting_caller()
    with torch.no_grad():
        art(*args)  # memoize the choice; install the C++ tensor check
        trusting(*args)
        checked, trusted = [], []
        calls = calls_per_round(art, args)
        for _ in range(ROUNDS):  # interleaved rounds: drift hits both sides alike
            base = per_call_ns(_noop, args, calls)
            checked.append(per_call_ns(art, args, calls) - base)
            trusted.append(per_call_ns(trusting, args, calls) - base)
    tensors = sum(isinstance(a, torch.Tensor) for a in args)
    return [
        name,
        len(args),
        tensors,
        statistics.median(checked) / 1e3,
        statistics.median(trusted) / 1e3,
    ]


def model_checks(model: torch.nn.Module, x: torch.Tensor, dim: int) -> list[Any]:
    """What a compiled model (``compile_model``/``load_model``) checks of what its trace
    read, beyond the artifact's input checks: the guards recorded from Dynamo's (count),
    their check at bind (ms), and per call the global state, the training flags the
    trace read and the registration counter (us, median of rounds)."""
    from precompile._torch_adapter import guard_entry
    from precompile._trace_read import trace_read
    from precompile.runtime._global_state import StateCheck
    from precompile.runtime._model_guards import BoundGuards

    entries: list[Any] = []
    codes: list[Any] = []

    def keep(found: Any) -> list[bool]:
        entries.extend(guard_entry(e) for e in found)
        return [True] * len(found)

    def backend(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        from torch._guards import TracingContext

        codes.append(TracingContext.try_get().traced_code[0])
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, dim)
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True,
                      options={"guard_filter_fn": keep})(x)  # fmt: skip
        read = trace_read(model, (x,), {}, entries, codes[0])
        began = time.perf_counter()
        guards = BoundGuards(read, model, "the model")
        bind_ms = (time.perf_counter() - began) * 1e3
        state = StateCheck(read.state, "the model")

        def check() -> None:
            state.check()
            guards.check()

        def skipping() -> None:  # CompiledModel.skip_guard_eval_unsafe()
            guards.reads_per_call = False
            try:
                check()
            finally:
                guards.reads_per_call = True

        dynamo = dynamo_guards(model, x)  # torch.compile's own check of the same model
        calls = calls_per_round(check, [])
        ours, skipped, theirs = [], [], []
        for _ in range(ROUNDS):  # interleaved rounds: drift hits both sides alike
            base = per_call_ns(_noop, [], calls)
            ours.append(per_call_ns(check, [], calls) - base)
            skipped.append(per_call_ns(skipping, [], calls) - base)
            if dynamo is not None:
                theirs.append(per_call_ns(dynamo, [], calls) - base)
    dynamo_us = statistics.median(theirs) / 1e3 if theirs else None
    return [len(read.guards), bind_ms, statistics.median(ours) / 1e3,
            statistics.median(skipped) / 1e3, dynamo_us]  # fmt: skip


def dynamo_guards(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], Any] | None:
    """What ``torch.compile`` checks per call of the same model: its guard tree, as Dynamo
    evaluates it before each call of the frame it compiled (left in place by
    ``model_checks``), on that frame's own locals, caught from an eager call (None where
    the tree does not pass on them)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    compiled: dict[Any, Any] = {}
    caught: dict[str, Any] = {}
    managers: list[Any] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and not caught and frame.f_code in compiled:
            caught.update(frame.f_locals)
            managers.append(compiled[frame.f_code])

    for module in (model, *model.modules()):
        for function in (type(module).forward, type(module).__call__):
            while function is not None:  # the frame may be a decorator's wrapper
                code = getattr(function, "__code__", None)
                entries = _debug_get_cache_entry_list(code) if code is not None else []
                if entries:
                    compiled[code] = entries[0].guard_manager
                function = getattr(function, "__wrapped__", None)
    sys.setprofile(profile)
    try:
        model(x)  # the module itself, not torch.compile's wrapper: eager
    finally:
        sys.setprofile(None)
    if not managers:
        return None
    manager = managers[0]
    if not manager.check(caught):
        return None
    return partial(manager.check, caught)


def tiny_llama(layers: int) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
        max_position_embeddings=512,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _ms_per_call(compiled: Any, ids: torch.Tensor, calls: int = 200) -> float:
    compiled(ids)
    if ids.is_cuda:
        torch.cuda.synchronize()
    began = time.perf_counter_ns()
    for _ in range(calls):
        compiled(ids)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter_ns() - began) / calls / 1e6


def served_calls(device: str, out: str) -> None:
    """What the per-call check costs a served call: the docs' Llama shape at 4 layers
    (hidden 2048, bf16) compiled with CUDA graphs, ms per call (back to back, one
    synchronize per round; interleaved rounds, medians) at 1 and 8 tokens, checked as by
    default and with ``skip_guard_eval_unsafe()``."""
    import transformers

    from _common import environment, table, write_json

    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device, torch.bfloat16).eval()
    rows = []
    with torch.no_grad():
        began = time.perf_counter()
        compiled = precompile.compile_model(
            model, (torch.randint(0, 32000, (1, 16), device=device),),
            dynamic={0: [1]}, hints=[16], cudagraphs=device == "cuda",
        )  # fmt: skip
        print(f"built in {time.perf_counter() - began:.1f} s")
        for tokens in (1, 8):
            ids = torch.randint(0, 32000, (1, tokens), device=device)
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits,
                                       rtol=0.05, atol=0.05)  # fmt: skip
            checked, skipped = [], []
            for _ in range(ROUNDS):
                checked.append(_ms_per_call(compiled.skip_guard_eval_unsafe(False), ids))
                skipped.append(_ms_per_call(compiled.skip_guard_eval_unsafe(True), ids))
            compiled.skip_guard_eval_unsafe(False)
            on, off = statistics.median(checked), statistics.median(skipped)
            rows.append([tokens, on, off, (on - off) * 1e3, on / off])
    headers = ["tokens", "checked ms", "skip_guard_eval_unsafe() ms", "difference us", "ratio"]
    print(table(headers, rows))
    document = {
        **environment(device),
        "what": "ms per served call of the docs' Llama (4 layers, bf16, CUDA graphs), "
        "medians of interleaved rounds of 200",
        "rows": [dict(zip(headers, row, strict=True)) for row in rows],
    }
    print(f"wrote {write_json(out, document)}")


def main() -> None:
    if "--served" in sys.argv:  # [--out NAME.json], under benchmarks/results
        device = sys.argv[sys.argv.index("--served") + 1]
        out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
        served_calls(device, out or f"dispatch-served-{device}.json")
        return
    from demo import MLP

    from _common import environment, table, write_json

    torch.manual_seed(0)
    rows = [
        measure("x + 1", Tiny(), torch.randn(4, 8), 0, 64)
        + model_checks(Tiny(), torch.randn(4, 8), 0),
        measure("demo MLP", MLP().eval(), torch.randn(4, 256), 0, 64)
        + model_checks(MLP().eval(), torch.randn(4, 256), 0),
    ]
    for layers in (2, 12, 32):
        ids = torch.randint(0, 128, (1, 8))
        llama = tiny_llama(layers)
        row = measure(f"tiny Llama, {layers} layers", llama, ids, 1, 100)
        rows.append(row + model_checks(llama, torch.randint(0, 128, (1, 8)), 1))
    headers = [
        "graph",
        "flat inputs",
        "tensor inputs",
        "art(*args) us (every input checked)",
        "trusting_caller() us (backend, Dynamo checked)",
        "model level: guards recorded",
        "model level: guards checked at bind ms",
        "model level: trace-read checks per call us",
        "model level, skip_guard_eval_unsafe() per call us",
        "torch.compile: Dynamo's guards per call us",
    ]
    print(table(headers, rows))
    document = {
        **environment("cpu"),
        "seconds_per_round": ROUND_S,
        "rounds": ROUNDS,
        "what": "host time added per memoized call over a no-op variant, median of rounds",
        "rows": [dict(zip(headers, row, strict=True)) for row in rows],
    }
    print(f"wrote {write_json('dispatch-cpu.json', document)}")


if __name__ == "__main__":
    main()
