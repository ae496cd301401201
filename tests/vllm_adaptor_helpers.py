"""vLLM's piecewise compilation, reduced to the calls it makes of standalone_compile.

What vLLM does with a model (vllm/compilation/backends.py, piecewise_backend.py,
compiler_interface.py), written here so that a test can run it against any
implementation of ``standalone_compile`` / ``CompiledArtifact`` (ours or upstream's):

- Dynamo captures the model once with the token dim dynamic; vLLM's backend cuts the graph
  with ``split_module`` at each attention op (a custom op, "splitting op"), which runs
  eagerly between the compiled pieces.
- Each piece is compiled by ``InductorStandaloneAdaptor.compile`` for a range of token counts
  (``dynamic_shapes="from_graph"``, the placeholders' fake values as inputs) and for each
  compile size (``dynamic_shapes="from_example_inputs"``), then saved under
  ``torch_compile_cache/<hash>/rank_0_0/backbone/artifact_compile_range_<a>_<b>_subgraph_<i>``.
- In the compiling process the returned artifact is called as it is. A later process loads
  each one with ``CompiledArtifact.load`` and calls it through vLLM's wrapper, which takes
  ``graph_output[0]`` where the piece's graph does not return a tuple.

Two generations of the adaptor: the older one (no ``donate_graph_module``, compile sizes
compiled lazily at their first call from the real inputs) and the one for torch >= 2.13
(``donate_graph_module=True``, compile sizes compiled up front from fake inputs made by
``create_concrete_args`` in a fresh FakeTensorMode, with its ``FakeTensorMode`` patch of
torch's standalone_compile module, and its check that the artifact can be saved).

This module is imported by the test and by the fresh processes it starts.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import os
import pprint
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from unittest import mock

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.passes.split_module import split_module

HIDDEN = 32
HEADS = 2
TRACE_TOKENS = 16  # the size Dynamo traces at: neither a compile size nor 1
RANGE = (1, 256)  # vLLM's compile range [1, max_num_batched_tokens]
COMPILE_SIZES = (8,)
SIZES = (1, 5, 8, 37, 256)  # checked after compiling: range ends, a compile size, others

Generation = Literal["older", "newer"]
Format = Literal["binary", "unpacked"]


@torch.library.custom_op("precompile_vllm_test::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over the tokens of one sequence: the graph's splitting op."""
    tokens = q.shape[0]
    qh, kh, vh = (t.reshape(tokens, HEADS, -1).transpose(0, 1) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return out.transpose(0, 1).reshape(tokens, -1)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


SPLITTING_OPS = (torch.ops.precompile_vllm_test.attention,)


class TinyDecoderLayer(torch.nn.Module):
    """One pre-norm decoder layer over [tokens, hidden], attention through the custom op,
    per-head q/k norms before it."""

    def __init__(self) -> None:
        super().__init__()
        self.input_norm = torch.nn.RMSNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.q_norm = torch.nn.RMSNorm(HIDDEN // HEADS)
        self.k_norm = torch.nn.RMSNorm(HIDDEN // HEADS)
        self.o_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.post_norm = torch.nn.RMSNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(self.input_norm(x)).chunk(3, dim=-1)
        # Qwen3's per-head norms, outside vLLM's attention op: views by the token count
        q = self.q_norm(q.reshape(tokens, HEADS, -1)).reshape(tokens, -1)
        k = self.k_norm(k.reshape(tokens, HEADS, -1)).reshape(tokens, -1)
        x = x + self.o_proj(torch.ops.precompile_vllm_test.attention(q, k, v))
        return x + self.down(F.silu(self.up(self.post_norm(x))))


def build_model(state_path: str | None = None) -> torch.nn.Module:
    """The model, weights frozen as vLLM keeps them; from ``state_path`` when given."""
    torch.manual_seed(0)
    model = TinyDecoderLayer().eval().requires_grad_(False)
    if state_path is not None:
        model.load_state_dict(torch.load(state_path))
    return model


@dataclass(frozen=True)
class Range:
    """vLLM's compile range: both ends included; start == end is a compile size."""

    start: int
    end: int

    def is_single_size(self) -> bool:
        return self.start == self.end

    def __contains__(self, size: object) -> bool:
        return isinstance(size, int) and self.start <= size <= self.end


def range_key(compile_range: Range, graph_index: int) -> str:
    """The artifact's file name under vLLM's cache dir (CompilerManager.compile)."""
    start, end = compile_range.start, compile_range.end
    return f"artifact_compile_range_{start}_{end}_subgraph_{graph_index}"


def vllm_cache_dir(root: str, generation: Generation, fmt: Format) -> str:
    """``torch_compile_cache/<hash>/rank_0_0/backbone``, one hash per configuration."""
    config_hash = hashlib.sha256(f"{generation}-{fmt}".encode()).hexdigest()[:10]
    path = os.path.join(root, "torch_compile_cache", config_hash, "rank_0_0", "backbone")
    os.makedirs(path, exist_ok=True)
    return path


def split_graph(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str], list[str]]:
    """vLLM's split_graph: every splitting op gets a piece of its own; the others are cut
    between them. Returns the split module, its compiled pieces and its splitting pieces."""
    subgraph_id = 0
    ids: dict[torch.fx.Node, int] = {}
    splitting: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        is_split = node.op == "call_function" and (
            node.target in SPLITTING_OPS
            or getattr(node.target, "overloadpacket", None) in SPLITTING_OPS
        )
        if is_split:
            subgraph_id += 1
            ids[node] = subgraph_id
            splitting.add(subgraph_id)
            subgraph_id += 1
        else:
            ids[node] = subgraph_id
    split = split_module(gm, None, lambda node: ids[node], keep_original_order=True)
    names = [n.target for n in split.graph.nodes if n.op == "call_module"]
    compiled = [n for n in names if int(n.split("_")[-1]) not in splitting]
    return split, compiled, [n for n in names if n not in compiled]


def get_fake_args_from_graph(graph: torch.fx.GraphModule) -> list[Any]:
    """The range compile's inputs: the placeholders' fake values (piecewise_backend)."""
    args = []
    for node in graph.graph.nodes:
        if node.op != "placeholder":
            break
        args.append(node.meta["example_value"])
    return args


def create_concrete_args(graph: torch.fx.GraphModule, size: int) -> list[Any]:
    """The newer backend's inputs for a compile size: fake tensors in a fresh FakeTensorMode
    with every symbol replaced by ``size`` (piecewise_backend.create_concrete_args)."""
    from torch._prims_common import compute_required_storage_length
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, is_symbolic

    def concrete(value: Any) -> int:
        if not is_symbolic(value):
            return int(value)
        expr = value.node.expr
        return int(expr.subs({s: size for s in expr.free_symbols}))

    args: list[Any] = []
    with FakeTensorMode(shape_env=ShapeEnv()):
        for value in get_fake_args_from_graph(graph):
            if isinstance(value, torch.SymInt):
                args.append(concrete(value))
            elif isinstance(value, torch.Tensor):
                shape = tuple(concrete(d) for d in value.shape)
                stride = tuple(concrete(s) for s in value.stride())
                offset = concrete(value.storage_offset())
                storage = torch.empty(
                    compute_required_storage_length(shape, stride, offset),
                    dtype=value.dtype,
                    device=value.device,
                )
                args.append(storage.as_strided(shape, stride, offset))
            else:
                args.append(value)
    return args


@dataclass
class Implementation:
    """The two names vLLM's adaptor takes from torch._inductor."""

    standalone_compile: Callable[..., Any]
    CompiledArtifact: Any


def implementation(name: str) -> Implementation:
    if name == "precompile":
        import precompile

        return Implementation(precompile.standalone_compile, precompile.CompiledArtifact)
    import torch._inductor

    return Implementation(torch._inductor.standalone_compile, torch._inductor.CompiledArtifact)


class StandaloneAdaptor:
    """vLLM's InductorStandaloneAdaptor: the calls it makes, in the order it makes them."""

    def __init__(
        self, impl: Implementation, generation: Generation, save_format: Format, cache_dir: str
    ) -> None:
        self.impl = impl
        self.generation = generation
        self.save_format = save_format
        self.cache_dir = cache_dir

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        compiler_config: dict[str, Any],
        compile_range: Range,
        key: str,
    ) -> tuple[Any, tuple[str, str]]:
        dynamic_shapes = "from_example_inputs" if compile_range.is_single_size() else "from_graph"
        kwargs: dict[str, Any] = {
            "dynamic_shapes": dynamic_shapes,
            "options": {"config_patches": dict(compiler_config)},
        }
        patch_fake_mode: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.generation == "newer":
            # vLLM passes it from torch 2.13 on: it hands each piece's graph over, and
            # compiles the same graph object again for the next range.
            kwargs["donate_graph_module"] = True
            # Fake inputs from create_concrete_args bring their own FakeTensorMode; vLLM
            # makes torch's standalone_compile module build that one instead of a fresh one
            # (pytorch/pytorch#176562).
            fake_mode = next(
                (x.fake_mode for x in example_inputs if isinstance(x, FakeTensor)),
                None,
            )
            if fake_mode is not None:
                patch_fake_mode = mock.patch.object(
                    sys.modules["torch._inductor.standalone_compile"],
                    "FakeTensorMode",
                    lambda *a, **k: fake_mode,
                )
        with patch_fake_mode:
            compiled = self.impl.standalone_compile(graph, example_inputs, **kwargs)
        path = os.path.join(self.cache_dir, key)
        # The newer adaptor refuses to save what it could not load back: vLLM's
        # is_saveable_2_10 reads upstream's private pair; is_saveable() (torch >= 2.11) is
        # the public form of the same check, and both must say yes.
        if self.generation == "newer" and not (self.saveable(compiled) and compiled.is_saveable()):
            raise RuntimeError("The compiled artifact is not serializable.")
        compiled.save(path=path, format=self.save_format)
        return compiled, (key, path)

    @staticmethod
    def saveable(compiled: Any) -> bool:
        """The newer adaptor's check (vLLM's ``is_saveable_2_10``): it reads upstream's
        ``_artifacts`` pair, whose cache info must name exactly one AOTAutograd entry."""
        if compiled._artifacts is None:
            return False
        _, cache_info = compiled._artifacts
        return len(cache_info.aot_autograd_artifacts) == 1

    def load(
        self,
        handle: tuple[str, str],
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        graph_index: int,
        compile_range: Range,
    ) -> Callable[..., Any]:
        from torch._inductor.compile_fx import graph_returns_tuple

        key, path = handle
        assert isinstance(key, str) and isinstance(path, str)
        loaded = self.impl.CompiledArtifact.load(path=path, format=self.save_format)
        returns_tuple = graph_returns_tuple(graph)

        def compiled_graph_wrapper(*args: Any) -> Any:
            graph_output = loaded(*args)
            # vLLM: "unpack the tuple if needed"
            if returns_tuple:
                return graph_output
            return graph_output[0]

        return compiled_graph_wrapper


@dataclass
class PieceCheck:
    """One call of a compiled piece, next to the same piece run eagerly on the same args."""

    piece: str
    size: int
    compiled: Any
    eager: Any


@dataclass
class PiecewiseBackend:
    """One compiled piece: an entry per range and compile size, dispatched by the token
    count (the piece's first SymInt input), as vLLM's PiecewiseBackend does."""

    name: str
    graph: torch.fx.GraphModule
    graph_index: int
    adaptor: StandaloneAdaptor
    mode: Literal["compile", "load"]
    handles: dict[str, tuple[str, str]]
    checks: list[PieceCheck] | None
    entries: dict[Range, Callable[..., Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sym_index = next(
            i
            for i, v in enumerate(get_fake_args_from_graph(self.graph))
            if isinstance(v, torch.SymInt)
        )
        # The eager reference is taken before any compile: a donated graph may be changed.
        self.eager_graph = torch.fx.GraphModule(self.graph, self.graph.graph.__deepcopy__())
        # vLLM's order: the compile sizes' entries first, then the range (with
        # donate_graph_module, each compile gets the graph the one before it was handed).
        ranges = [Range(s, s) for s in COMPILE_SIZES] + [Range(*RANGE)]
        for compile_range in ranges:
            # The older backend compiled (and loaded) a compile size at its first call.
            lazy = self.adaptor.generation == "older" and compile_range.is_single_size()
            if not lazy:
                self.entries[compile_range] = self._compile_or_load(compile_range, None)

    def _compile_or_load(self, compile_range: Range, runtime_args: Sequence[Any] | None) -> Any:
        key = range_key(compile_range, self.graph_index)
        if self.mode == "load":
            return self.adaptor.load(
                self.handles[key],
                self.graph,
                get_fake_args_from_graph(self.graph),
                self.graph_index,
                compile_range,
            )
        if runtime_args is not None:
            inputs = list(runtime_args)  # older vLLM: compiled at the size's first call
        elif compile_range.is_single_size():
            inputs = create_concrete_args(self.graph, compile_range.start)
        else:
            inputs = get_fake_args_from_graph(self.graph)
        compiled, handle = self.adaptor.compile(self.graph, inputs, {}, compile_range, key)
        self.handles[key] = handle
        return compiled

    def __call__(self, *args: Any) -> Any:
        size = args[self.sym_index]
        if size in COMPILE_SIZES:
            compile_range = Range(size, size)
        else:
            compile_range = Range(*RANGE)
            assert size in compile_range, f"{size} is outside {compile_range}"
        if compile_range not in self.entries:
            self.entries[compile_range] = self._compile_or_load(compile_range, args)
        out = self.entries[compile_range](*args)
        if self.checks is not None:
            self.checks.append(PieceCheck(self.name, size, out, self.eager_graph(*args)))
        return out


@dataclass
class Captured:
    """The split graph with its compiled pieces swapped in, and the traced inputs."""

    split: torch.fx.GraphModule
    example_inputs: list[Any]
    input_index: int  # which graph input is the model's x
    pieces: dict[str, PiecewiseBackend]

    def flat_args(self, x: torch.Tensor) -> list[Any]:
        """The graph's inputs for a call with ``x``: sizes as ints, parameters as traced."""
        args: list[Any] = []
        for i, value in enumerate(self.example_inputs):
            if i == self.input_index:
                args.append(x)
            elif isinstance(value, torch.SymInt):
                args.append(x.shape[0])
            else:
                args.append(value)
        return args

    def __call__(self, x: torch.Tensor) -> Any:
        return self.split(*self.flat_args(x))


def capture_and_build(
    model: torch.nn.Module,
    adaptor: StandaloneAdaptor,
    mode: Literal["compile", "load"],
    handles: dict[str, tuple[str, str]],
    checks: list[PieceCheck] | None,
) -> Captured:
    """Trace ``model`` with Dynamo; inside the backend (Dynamo's tracing context, as vLLM's
    VllmBackend runs), split the graph and compile or load every piece."""
    built: list[Captured] = []
    x = torch.randn(TRACE_TOKENS, HIDDEN)
    torch._dynamo.mark_dynamic(x, 0)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        split, compiled, _ = split_graph(gm)
        pieces = {}
        for index, name in enumerate(compiled):
            piece = PiecewiseBackend(
                name, getattr(split, name), index, adaptor, mode, handles, checks
            )
            pieces[name] = piece
            split.delete_submodule(name)
            split.add_submodule(name, _Callable(piece))
        input_index = next(i for i, v in enumerate(example_inputs) if v is x)
        built.append(Captured(split, list(example_inputs), input_index, pieces))
        return split

    torch._dynamo.reset()
    with torch.inference_mode():
        torch.compile(model, backend=backend, fullgraph=True)(x)
    assert len(built) == 1, f"Dynamo handed the backend {len(built)} graphs, expected 1"
    return built[0]


class _Callable(torch.nn.Module):
    """Lets a PiecewiseBackend sit where split_module put the piece's GraphModule."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def write_handles(cache_dir: str, handles: dict[str, tuple[str, str]]) -> None:
    """vLLM's ``vllm_compile_cache.py``: the handles as a Python literal."""
    with open(os.path.join(cache_dir, "vllm_compile_cache.py"), "w") as f:
        f.write(pprint.pformat(handles))


def read_handles(cache_dir: str) -> dict[str, tuple[str, str]]:
    with open(os.path.join(cache_dir, "vllm_compile_cache.py")) as f:
        handles: dict[str, tuple[str, str]] = ast.literal_eval(f.read())
    return handles


@dataclass
class SizeResult:
    """What one call at ``size`` returned (or raised), next to eager, and every piece check
    it made."""

    size: int
    output: Any
    expected: torch.Tensor
    checks: list[PieceCheck]


def run_sizes(
    model: torch.nn.Module, captured: Captured, checks: list[PieceCheck]
) -> list[SizeResult]:
    results = []
    for size in SIZES:
        torch.manual_seed(size)
        x = torch.randn(size, HIDDEN)
        checks.clear()
        with torch.inference_mode():
            expected = model(x)
            try:
                output = captured(x)
            except Exception as exc:  # reported with the size; the other sizes still run
                output = exc
        results.append(SizeResult(size, output, expected, list(checks)))
    return results


def describe_mismatches(results: Sequence[SizeResult]) -> list[str]:
    """Every output that differs from eager, in shape, type or value; empty when all match."""
    problems = []
    for result in results:
        # The split graph is Dynamo's: it returns a 1-tuple around the model's output.
        output = result.output
        where = f"model output at {result.size} tokens"
        if isinstance(output, Exception):
            first_line = str(output).strip().splitlines()[0] if str(output).strip() else ""
            problems.append(f"{where}: raised {type(output).__name__}: {first_line}")
            continue
        if not (isinstance(output, tuple) and len(output) == 1):
            problems.append(f"{where}: expected Dynamo's 1-tuple, got {type(output).__name__}")
            continue
        problems += _compare(where, output[0], result.expected)
        for check in result.checks:
            where = f"{check.piece} at {check.size} tokens"
            problems += _compare(where, check.compiled, check.eager)
    return problems


def _compare(where: str, actual: Any, expected: Any) -> list[str]:
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{where}: expected a tensor, got {type(actual).__name__}"]
        if actual.shape != expected.shape:
            return [f"{where}: shape {tuple(actual.shape)}, eager {tuple(expected.shape)}"]
        if not torch.allclose(actual, expected, rtol=1e-4, atol=1e-4):
            diff = (actual - expected).abs().max().item()
            return [f"{where}: values differ from eager by up to {diff:.3g}"]
        return []
    assert isinstance(expected, (tuple, list)), type(expected)
    if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
        return [f"{where}: expected {len(expected)} outputs, got {type(actual).__name__}"]
    problems = []
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        problems += _compare(f"{where} output {i}", a, e)
    return problems


def run(
    impl: str, generation: Generation, fmt: Format, root: str, mode: Literal["compile", "load"]
) -> list[str]:
    """One vLLM start: cold (``compile``: compile, save, record the handles) or warm
    (``load``: read the handles and load every artifact). Returns every mismatch with
    eager at SIZES, each piece included; an empty list when all outputs match."""
    state_path = os.path.join(root, "weights.pt")
    if mode == "compile" and not os.path.exists(state_path):
        torch.save(build_model().state_dict(), state_path)
    model = build_model(state_path)
    cache_dir = vllm_cache_dir(root, generation, fmt)
    adaptor = StandaloneAdaptor(implementation(impl), generation, fmt, cache_dir)
    handles = read_handles(cache_dir) if mode == "load" else {}
    checks: list[PieceCheck] = []
    captured = capture_and_build(model, adaptor, mode, handles, checks)
    results = run_sizes(model, captured, checks)
    if mode == "compile":
        write_handles(cache_dir, handles)
    return describe_mismatches(results)


def fresh_process_report(impl: str, root: str, configs: Sequence[str]) -> dict[str, Any]:
    """What a fresh process started on the artifacts of ``configs`` (each
    "<generation>-<format>") saw: per configuration its mismatches, or the error it raised."""
    report: dict[str, Any] = {}
    for config in configs:
        generation, fmt = config.split("-")
        try:
            report[config] = run(impl, generation, fmt, root, "load")  # type: ignore[arg-type]
        except Exception as exc:
            report[config] = f"{type(exc).__name__}: {exc}"[:3000]
    return report
