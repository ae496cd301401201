"""The decode loop on the GPU: prefill a prompt, then greedy decode token by token against
a transformers ``StaticCache``, every row side by side in one process.

    python benchmarks/decode.py                 # the issue's Llama, H100/H200
    python benchmarks/decode.py --smoke         # a tiny config, fewer steps (any GPU)
    python benchmarks/decode.py --plot benchmarks/results/decode-llama.json
    python benchmarks/decode.py --warm-start-only --out OUT.json   # only the fresh processes

Model: ``transformers.LlamaForCausalLM`` from a config (hidden 2048, intermediate 5632,
4 layers, 16 heads, 4 KV heads, vocab 32000), bf16, random init; one ``StaticCache`` of
``--cache-len`` (1152: room for the 1024-token prefill, so that every row keeps one cache
shape) per batch size, shared by the rows, ``reset()`` before each run. A run: prefill
128 tokens, then 64 greedy steps (the next token is the argmax, kept on the GPU: no host
sync per step).

Rows: ``eager``; ``torch.compile fullgraph`` (``torch.compile(step, fullgraph=True)``);
``precompile.backend`` (``torch.compile`` with our backend, hints 16/256; batch 1);
``transformers generate`` (its own ``generate(cache_implementation="static")``, which
compiles the decode steps itself, with reduce-overhead CUDA graphs by default on CUDA;
batch 1, on a cache it is passed, reset before each call; per token = (time of 65 new
tokens - time of 1) / 64, prefill excluded);
``torch.compile + hand-captured graph`` (the fullgraph step captured by hand in one
``torch.cuda.CUDAGraph`` per batch size, replayed per decode step); ``ours`` (
``compile_model`` with the cache: batch and sequence dynamic, hint points (1|8, 1|128));
``ours + cudagraphs`` (the same compiled model with ``cudagraphs=True``);
``ours generate + cudagraphs`` (``serve_generate``: every forward of transformers'
``generate`` on compiled models with CUDA graphs; batch 1, per token as for generate);
``ours generate, loop=True + cudagraphs`` (``serve_generate(loop=True)``: transformers'
``generate`` answered by the compiled decode loop; the same, with no EOS token instead of
``min_new_tokens``, which the loop leaves to transformers; batch 1 and 8, a process each).

Decode ms/token: the 64 steps' wall time / 64 (median of ``--rounds`` interleaved rounds).
Prefill ms at 128 and 1024 tokens (batch 1, median of 5). Also: GPU memory in CUDA-graph
pools per graph row, tokens of ``ours + cudagraphs`` against ``ours`` (identical?), and a
fresh process on the warm cache: ``compile_model`` (no warm-up thread) call to the first
token of a batch-1 request on a new cache, Dynamo frames, inductor compiles, compiler
processes. And a cProfile of the host's time in 64 steps of ``ours + cudagraphs``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

ROWS = [
    "eager",
    "torch.compile fullgraph",
    "precompile.backend",
    "transformers generate",
    "torch.compile + hand-captured graph",
    "ours",
    "ours + cudagraphs",
    "ours + cudagraphs, no output copy",
    "ours + cudagraphs, cuDNN off in hint variants",
    "ours CompiledModel.generate + cudagraphs",
    "ours CompiledModel.generate + cudagraphs, cuBLAS GEMMs",
    "ours generate + cudagraphs",
    "ours generate, loop=True + cudagraphs",
]
# The attention policy's two settings, built side by side: the default (cuDNN where a
# variant's attention lengths are fixed) and the previous one (never in hint variants).
CUDNN_OFF = "ours + cudagraphs, cuDNN off in hint variants"
# The GEMM policy's two sides for decode variants that serve several batch sizes: Triton
# templates (the default: a new batch launches at once) and inductor's cuBLAS calls (the
# caller's choice, ``max_autotune_gemm_backends="ATEN"``), built side by side.
CUBLAS = "ours CompiledModel.generate + cudagraphs, cuBLAS GEMMs"
CUBLAS_OPTIONS = {"config_patches": {"max_autotune_gemm_backends": "ATEN"}}
LOOP = "ours generate, loop=True + cudagraphs"
BATCH_ONE_ONLY = {"precompile.backend", "transformers generate", "ours generate + cudagraphs"}
# the loop row runs at batch 1 and the largest batch, a child process each (the issue's
# goal: batch 1 and 8 against ``CompiledModel.generate``)
# transformers' own compiled generate runs in a child process of its own: in one run its
# reduce-overhead graphs hit a device-side assert (an index past the cache), which
# poisons the CUDA context of every row beside it. serve_generate, the row it is compared
# with, runs in one too: both drive transformers' Python loop, whose host time (it waits
# for the GPU every step) grew by up to 40% beside the other rows' objects in one process.
SERVE = "ours generate + cudagraphs"
IN_CHILD = {"transformers generate", SERVE, LOOP}
GENERATE_ROWS = {
    "transformers generate",
    "ours generate + cudagraphs",
    LOOP,
    "ours CompiledModel.generate + cudagraphs",
    CUBLAS,
}
PROMPT, STEPS = 128, 64
PREFILLS = [128, 1024]


def build(smoke: bool) -> torch.nn.Module:
    from _common import llama

    model: torch.nn.Module = llama("tiny" if smoke else "issue", "cuda", torch.bfloat16)
    model.config.use_cache = True  # the shared builder turns it off (cache-less serving)
    model.generation_config.use_cache = True  # else generate feeds the whole sequence
    return model


def our_call(model: torch.nn.Module, batch: int, length: int, cache_len: int) -> dict[str, Any]:
    """The example call ``compile_model`` is compiled for (fresh process too)."""
    import transformers

    config = model.config
    cache = transformers.StaticCache(config=config, max_cache_len=cache_len)
    head_dim = config.hidden_size // config.num_attention_heads
    cache.early_initialization(batch, config.num_key_value_heads, head_dim, torch.bfloat16,
                               torch.device("cuda"))  # fmt: skip
    ids = torch.randint(0, config.vocab_size, (batch, length), device="cuda")
    return {"input_ids": ids, "past_key_values": cache, "use_cache": True}


OUR_OPTIONS: dict[str, Any] = {
    "dynamic": {"input_ids": [0, 1]},
    "hints": {("input_ids", 0): [1, 8], ("input_ids", 1): [1, PROMPT]},
    "sizes": [],
}


def entry_point(function: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """``function`` under a code object of its own: Dynamo keeps one cache per code
    object, so every compiled row stays live side by side."""
    code = function.__code__.replace(
        co_name="row_" + "".join(c if c.isalnum() else "_" for c in tag)
    )
    return types.FunctionType(code, function.__globals__, code.co_name, None, function.__closure__)


def graph_pool_bytes() -> int:
    snapshot = torch.cuda.memory._snapshot()
    return sum(
        segment["total_size"]
        for segment in snapshot["segments"]
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
    )


class HandCaptured:
    """One ``torch.cuda.CUDAGraph`` of the compiled decode step per cache: the step's
    input ids copied into a static buffer, the cache used in place."""

    def __init__(self, step: Callable[..., Any]) -> None:
        self.step = step
        self.graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        if ids.shape[1] != 1:
            return self.step(ids, cache)  # prefill: the compiled step, no graph
        found = self.graphs.get(id(cache))
        if found is None:
            static = ids.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self.step(static, cache)  # this call's step, and the warm-up
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self.step(static, cache)
            self.graphs[id(cache)] = (graph, static, out)
            return logits
        graph, static, out = found
        static.copy_(ids)
        graph.replay()
        return out


def compile_ours(model: torch.nn.Module, cache_dir: str, cache_len: int, cudnn: str,
                 cudagraphs: Any, options: dict[str, Any] | None = None) -> Any:  # fmt: skip
    """``compile_model`` of the decode model under ``PRECOMPILE_CUDNN_ATTENTION=cudnn``."""
    import precompile

    example = our_call(model, 2, PROMPT, cache_len)  # sizes 0 and 1 are never dynamic
    before = os.environ.get("PRECOMPILE_CUDNN_ATTENTION")
    os.environ["PRECOMPILE_CUDNN_ATTENTION"] = cudnn
    try:
        started = time.perf_counter()
        compiled = precompile.compile_model(model, (), example, cache=cache_dir, warmup=True,
                                            cudagraphs=cudagraphs, options=options,
                                            **OUR_OPTIONS)  # fmt: skip
        print(f"[decode] compile_model (cuDNN attention {cudnn}, cudagraphs {cudagraphs}, "
              f"options {options}): "
              f"{time.perf_counter() - started:.1f} s", flush=True)  # fmt: skip
    finally:
        if before is None:
            del os.environ["PRECOMPILE_CUDNN_ATTENTION"]
        else:
            os.environ["PRECOMPILE_CUDNN_ATTENTION"] = before
    return compiled


def make_rows(model: torch.nn.Module, cache_dir: str, cache_len: int) -> dict[str, Any]:
    import precompile

    def step(ids: torch.Tensor, cache: Any) -> torch.Tensor:
        return model(input_ids=ids, past_key_values=cache, use_cache=True).logits

    fullgraph = torch.compile(entry_point(step, "fullgraph"), fullgraph=True)
    rows: dict[str, Any] = {
        "eager": step,
        "torch.compile fullgraph": fullgraph,
        "precompile.backend": torch.compile(
            entry_point(step, "backend"),
            backend=precompile.backend(hints=[16, 256], cache=cache_dir),
        ),
        "torch.compile + hand-captured graph": HandCaptured(fullgraph),
    }
    ours = compile_ours(model, cache_dir, cache_len, "auto", False)
    graphs = compile_ours(model, cache_dir, cache_len, "auto", True)
    shared = compile_ours(model, cache_dir, cache_len, "auto", {"copy_outputs": False})
    off = compile_ours(model, cache_dir, cache_len, "0", True) if CUDNN_OFF in ROWS else None
    rows["ours"] = lambda ids, cache: ours(input_ids=ids, past_key_values=cache,
                                           use_cache=True).logits  # fmt: skip
    rows["ours + cudagraphs, no output copy"] = lambda ids, cache: shared(
        input_ids=ids, past_key_values=cache, use_cache=True).logits  # fmt: skip
    rows["ours + cudagraphs"] = lambda ids, cache: graphs(input_ids=ids, past_key_values=cache,
                                                          use_cache=True).logits  # fmt: skip
    rows[CUDNN_OFF] = lambda ids, cache: off(input_ids=ids, past_key_values=cache,
                                             use_cache=True).logits  # fmt: skip
    rows["ours CompiledModel.generate + cudagraphs"] = graphs
    if CUBLAS in ROWS:
        cublas = compile_ours(model, cache_dir, cache_len, "auto", True, CUBLAS_OPTIONS)
        rows[CUBLAS] = cublas
        rows[CUBLAS + ", per call"] = lambda ids, cache: cublas(
            input_ids=ids, past_key_values=cache, use_cache=True).logits  # fmt: skip
    rows["_artifacts"] = {"ours": ours, "ours + cudagraphs": graphs}
    if off is not None:
        rows["_artifacts"][CUDNN_OFF] = off
    return rows


def driver(name: str, rows: dict[str, Any]) -> Any:
    """What a generate row of this process runs: our CompiledModel's own loop, or
    transformers' own generate (None); serve_generate's row runs in a child."""
    if name in ("ours CompiledModel.generate + cudagraphs", CUBLAS):
        return rows[name]
    return None


def decode_run(
    row: Callable[..., Any], prompt: torch.Tensor, cache: Any
) -> tuple[float, torch.Tensor]:
    """Prefill, then STEPS greedy steps; (ms per step, the tokens)."""
    cache.reset()
    logits = row(prompt, cache)
    ids = logits[:, -1:].argmax(-1)
    tokens = [ids]
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(STEPS):
        logits = row(ids, cache)
        ids = logits[:, -1:].argmax(-1)
        tokens.append(ids)
    torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3 / STEPS, torch.cat(tokens, dim=1)


def new_batch_first_calls(row: Callable[..., Any], model: torch.nn.Module, cache_len: int,
                          batches: list[int]) -> dict[str, dict[str, float]]:  # fmt: skip
    """A batch size first seen after the warm-up (its own new cache): ms of its prefill,
    of its first decode step and of its second (median of the next 8)."""
    import transformers

    found: dict[str, dict[str, float]] = {}
    for batch in batches:
        cache = transformers.StaticCache(config=model.config, max_cache_len=cache_len)
        prompt = torch.randint(0, model.config.vocab_size, (batch, PROMPT), device="cuda")
        times = []
        ids = prompt
        for _ in range(10):
            torch.cuda.synchronize()
            began = time.perf_counter()
            ids = row(ids, cache)[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - began) * 1e3)
        found[str(batch)] = {"prefill_ms": times[0], "first_step_ms": times[1],
                             "steady_step_ms": statistics.median(times[2:])}  # fmt: skip
    print(f"[decode] new batch sizes: {found}", flush=True)
    return found


def new_batch_generate(
    compiled: Any, model: torch.nn.Module, cache_len: int, batches: list[int], prepare: bool
) -> dict[str, dict[str, float]]:
    """``CompiledModel.generate`` at a batch size first seen now, on its own new cache
    (``prepare``: ``prepare_generate`` on it first, in another thread, as a server would
    while it waits for requests): ms of the first generate of 9 new tokens, of the same
    generate again (the cache reset), and the difference (what being new cost)."""
    import threading

    import transformers

    found: dict[str, dict[str, float]] = {}
    for batch in batches:
        cache = transformers.StaticCache(config=model.config, max_cache_len=cache_len)
        prompt = torch.randint(0, model.config.vocab_size, (batch, PROMPT), device="cuda")
        entry: dict[str, float] = {}
        if prepare:
            began = time.perf_counter()
            side = threading.Thread(target=compiled.prepare_generate, args=(cache, batch))
            side.start()
            side.join()
            entry["prepare_ms"] = (time.perf_counter() - began) * 1e3
        times = []
        for _ in range(2):
            cache.reset()
            torch.cuda.synchronize()
            began = time.perf_counter()
            compiled.generate(prompt, cache, max_new_tokens=9)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - began) * 1e3)
        entry.update(first_generate_ms=times[0], again_ms=times[1],
                     extra_ms=times[0] - times[1])  # fmt: skip
        found[str(batch)] = entry
    print(f"[decode] new batch, generate, prepared={prepare}: {found}", flush=True)
    return found


def generate_run(model: torch.nn.Module, prompt: torch.Tensor, cache: Any,
                 served: Any = None) -> float:  # fmt: skip
    """transformers' generate on a static cache the caller keeps (``reset()`` before each
    call: a new cache per call would make torch.compile recompile, its tensors being
    guarded by identity, and our graphs re-capture): ms per new token, prefill excluded,
    (65 new - 1 new) / 64."""
    times = []
    for new in (1, STEPS + 1):
        options: dict[str, Any] = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                       pad_token_id=0)  # fmt: skip
        if getattr(served, "loops", None) is not None:  # the compiled loop: no EOS instead
            options.update(min_new_tokens=None, eos_token_id=None)
        if isinstance(cache, int):  # transformers' default: a new static cache per call
            options.update(cache_implementation="static", max_cache_len=cache)
        else:
            cache.reset()
            options["past_key_values"] = cache
        torch.cuda.synchronize()
        began = time.perf_counter()
        if hasattr(served, "generate"):  # our CompiledModel: its own decode loop
            served.generate(prompt, cache, max_new_tokens=new)
        elif served is not None:
            with served:
                model.generate(prompt, **options)
        else:
            model.generate(prompt, **options)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return (times[1] - times[0]) * 1e3 / STEPS


class _Warnings(logging.Handler):
    """precompile's warnings in this run (a capture that failed, graphs turned off):
    kept in the result, since a row run without its graphs reads as slow, not as off."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()[:400]
        if message not in self.messages:
            self.messages.append(message)


def run_children(args: argparse.Namespace, cache_dir: str, decode: dict[str, Any],
                 ready_s: dict[str, float], captured: dict[str, Any],
                 warned: _Warnings) -> str:  # fmt: skip
    """The rows run in fresh processes of their own, into ``decode``: serve_generate's
    profile, the host's time in a served generate."""
    host_generate = ""
    largest = 4 if args.smoke else 8
    for name, batch in ((SERVE, 1), (LOOP, 1), (LOOP, largest), ("transformers generate", 1)):
        if name not in ROWS:
            continue
        generate = generate_child(args.smoke, args.cache_len, args.rounds,
                                  cache_dir if name in (SERVE, LOOP) else None,
                                  loop=name == LOOP, batch=batch)  # fmt: skip
        if "ms_per_token" in generate:
            ready_s[name if batch == 1 else f"{name}, batch {batch}"] = generate.pop("ready_s")
            profile = generate.pop("profile", None)  # served per forward: serve_generate's
            host_generate = (profile if name == SERVE else None) or host_generate
            if "captured" in generate and name == SERVE:
                captured["serve_generate"] = generate.pop("captured")
                warned.messages.extend(generate.pop("warnings"))
            decode[name][str(batch)] = generate
        elif batch == 1:
            decode[name]["error"] = generate
        else:
            decode[name][f"error at batch {batch}"] = generate
    return host_generate


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    from _common import environment

    warned = _Warnings()
    logging.getLogger("precompile").addHandler(warned)

    torch._dynamo.config.recompile_limit = 64  # the torch.compile rows: every batch and S
    model = build(args.smoke)
    vocab = model.config.vocab_size
    cache_dir = args.cache or tempfile.mkdtemp(prefix="precompile-decode-")
    batches = [1, 4] if args.smoke else [1, 4, 8]
    if all(name in IN_CHILD for name in ROWS):  # only the generate loops, each alone
        decode: dict[str, dict[str, Any]] = {name: {} for name in ROWS}
        ready_s: dict[str, float] = {}
        captured: dict[str, Any] = {}
        profile = run_children(args, cache_dir, decode, ready_s, captured, warned)
        return {"environment": environment("cuda"), "transformers": transformers.__version__,
                "model": "smoke" if args.smoke else "llama-2048x4", "cache_len": args.cache_len,
                "prompt": PROMPT, "steps": STEPS, "batches": batches, "rounds": args.rounds,
                "decode": decode, "ready_s": ready_s, "captured_sizes": captured,
                "host_profile_ours_generate": profile,
                "precompile_warnings": warned.messages}  # fmt: skip
    memory: dict[str, float] = {}
    ready_s: dict[str, float] = {}
    with torch.no_grad():
        rows = make_rows(model, cache_dir, args.cache_len)
        artifacts = rows.pop("_artifacts")
        # One cache per batch size, shared by the rows (reset before each run): its
        # tensors keep their addresses, as a server keeps its cache.
        shared = {
            batch: transformers.StaticCache(config=model.config, max_cache_len=args.cache_len)
            for batch in batches
        }
        caches = {(name, batch): shared[batch] for name in ROWS for batch in batches}
        prompts = {b: torch.randint(0, vocab, (b, PROMPT), device="cuda") for b in batches}
        # First runs: compiles, recompiles and captures, timed as "ready".
        for name in ROWS:
            if name in IN_CHILD:
                continue
            torch.cuda.synchronize()
            pools = graph_pool_bytes()
            began = time.perf_counter()
            for batch in batches:
                if batch > 1 and name in BATCH_ONE_ONLY:
                    continue
                for _ in range(2):  # graphs that write their inputs capture at a 2nd call
                    if name in GENERATE_ROWS:
                        generate_run(model, prompts[batch], caches[(name, batch)],
                                     driver(name, rows))  # fmt: skip
                    else:
                        decode_run(rows[name], prompts[batch], caches[(name, batch)])
            torch.cuda.synchronize()
            ready_s[name] = time.perf_counter() - began
            memory[name] = (graph_pool_bytes() - pools) / 2**20
            print(f"[decode] {name}: ready in {ready_s[name]:.1f} s, "
                  f"+{memory[name]:.0f} MiB in CUDA-graph pools", flush=True)  # fmt: skip
        decode: dict[str, dict[str, Any]] = {name: {} for name in ROWS}
        tokens: dict[tuple[str, int], torch.Tensor] = {}
        for batch in batches:
            rounds: dict[str, list[float]] = {name: [] for name in ROWS}
            for _ in range(args.rounds):
                for name in ROWS:
                    if (batch > 1 and name in BATCH_ONE_ONLY) or name in IN_CHILD:
                        continue
                    if name in GENERATE_ROWS:
                        ms = generate_run(model, prompts[batch], caches[(name, batch)],
                                          driver(name, rows))  # fmt: skip
                    else:
                        ms, tokens[(name, batch)] = decode_run(
                            rows[name], prompts[batch], caches[(name, batch)]
                        )
                    rounds[name].append(ms)
            for name, values in rounds.items():
                if values:
                    ms = statistics.median(values)
                    decode[name][str(batch)] = {
                        "ms_per_token": ms, "tokens_per_s": batch * 1e3 / ms, "rounds": values,
                    }  # fmt: skip
            print(f"[decode] batch {batch}: " + "  ".join(
                f"{n}={decode[n][str(batch)]['ms_per_token']:.3f}" for n in ROWS
                if str(batch) in decode[n]), flush=True)  # fmt: skip
        same = {
            str(b): bool(torch.equal(tokens[("ours", b)], tokens[("ours + cudagraphs", b)]))
            for b in batches
            if ("ours", b) in tokens and ("ours + cudagraphs", b) in tokens
        }
        print(f"[decode] ours + cudagraphs tokens identical to ours: {same}", flush=True)
        # The same question for torch.compile's step and its hand-captured graph, and
        # the first step where ours and ours + cudagraphs part, with the logits there.
        same_hand = {
            str(b): bool(torch.equal(tokens[("torch.compile fullgraph", b)],
                                     tokens[("torch.compile + hand-captured graph", b)]))
            for b in batches
            if ("torch.compile fullgraph", b) in tokens
            and ("torch.compile + hand-captured graph", b) in tokens
        }  # fmt: skip
        print(f"[decode] hand-captured graph tokens identical to its step: {same_hand}")
        parting = {str(b): first_difference(rows["ours"], rows["ours + cudagraphs"],
                                            prompts[b], shared[b], model.config,
                                            args.cache_len)
                   for b in batches if not same.get(str(b), True)}  # fmt: skip
        print(f"[decode] where ours and ours + cudagraphs part: {parting}", flush=True)
        prefill: dict[str, dict[str, float]] = {name: {} for name in ROWS}
        for length in PREFILLS:
            ids = torch.randint(0, vocab, (1, length), device="cuda")
            for name in ROWS:
                if name in GENERATE_ROWS:
                    continue
                cache = caches[(name, 1)]
                times = []
                for _ in range(6):
                    cache.reset()
                    torch.cuda.synchronize()
                    began = time.perf_counter()
                    rows[name](ids, cache)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - began) * 1e3)
                prefill[name][str(length)] = statistics.median(times[1:])
            print(f"[decode] prefill {length}: " + "  ".join(
                f"{n}={v[str(length)]:.2f}" for n, v in prefill.items() if str(length) in v),
                flush=True)  # fmt: skip
        # cuDNN keeps its plans per thread and shape: each row of the default policy gets
        # batch sizes no row ran before it.
        new_batch = {
            name: new_batch_first_calls(rows[name], model, args.cache_len, sizes)
            for name, sizes in (
                ("ours", [3, 6]),
                ("ours + cudagraphs", [5, 7]),
                (CUDNN_OFF, [3, 6]),
                (CUBLAS + ", per call", [3, 6]),
            )
            if name in rows and (name in ROWS or name.startswith(CUBLAS))
        }
        # The generate row's new batches (sizes no row ran before, so no cuDNN plan of
        # this thread helps): unprepared, then on caches prepared in another thread.
        generate_new_batch = {}
        if "ours CompiledModel.generate + cudagraphs" in ROWS:
            compiled = rows["ours CompiledModel.generate + cudagraphs"]
            generate_new_batch = {
                "unprepared": new_batch_generate(compiled, model, args.cache_len, [10, 14], False),
                "prepared": new_batch_generate(compiled, model, args.cache_len, [2, 12], True),
            }
        captured = {k: [list(s) for s in v.artifact.captured_sizes] for k, v in artifacts.items()}
        host = host_profile(rows["ours + cudagraphs"], prompts[1], shared[1])
    print(f"[decode] precompile warnings: {warned.messages}", flush=True)
    host_generate = run_children(args, cache_dir, decode, ready_s, captured, warned)
    return {
        "environment": environment("cuda"),
        "transformers": transformers.__version__,
        "model": "smoke" if args.smoke else "llama-2048x4",
        "cache_len": args.cache_len,
        "prompt": PROMPT,
        "steps": STEPS,
        "batches": batches,
        "rounds": args.rounds,
        "decode": decode,
        "prefill_ms": prefill,
        "ready_s": ready_s,
        "graph_memory_mb": memory,
        "ours_cudagraphs_tokens_identical": same,
        "hand_captured_tokens_identical_to_fullgraph": same_hand,
        "ours_cudagraphs_first_difference": parting,
        "captured_sizes": captured,
        "new_batch_first_call_ms": new_batch,
        "new_batch_generate_ms": generate_new_batch,
        "host_profile_ours_cudagraphs": host,
        "host_profile_ours_generate": host_generate,
        "warm_start": warm_start(args.smoke, cache_dir, args.cache_len),
        "precompile_warnings": warned.messages,
    }


GENERATE = """
import sys, time, statistics
sys.path.insert(0, {here!r})
sys.path.insert(0, {root!r})
import logging
import torch, transformers
from decode import PROMPT, _Warnings, build, generate_profile, generate_run
torch.manual_seed(0)
model = build({smoke})
cache = transformers.StaticCache(config=model.config, max_cache_len={cache_len})
if {new_caches}:
    cache = {cache_len}  # a new static cache per generate call, transformers' default
# no pad token (0) in the prompt: transformers would mask it, a padded batch to it
prompt = torch.randint(1, model.config.vocab_size, ({batch}, PROMPT), device="cuda")
served, found, serve_cache = None, {{}}, {serve_cache!r}
if serve_cache is not None:  # transformers' generate under our serve_generate
    import precompile
    warned = _Warnings()
    logging.getLogger("precompile").addHandler(warned)
    served = precompile.serve_generate(model, cache=serve_cache, cudagraphs=True,
                                       hints=[PROMPT], warmup=True, loop={loop})
began = time.perf_counter()
with torch.no_grad():
    for _ in range(2 if served else 1):  # graphs that write their inputs: 2nd call
        generate_run(model, prompt, cache, served)
    ready = time.perf_counter() - began
    rounds = [generate_run(model, prompt, cache, served) for _ in range({rounds})]
    if served is not None and not isinstance(cache, int):
        found["profile"] = generate_profile(model, prompt, cache, served)
        found["captured"] = {{
            ",".join(str(part[0]) for part in key[:-1]): [
                [list(s) for s in piece.artifact.captured_sizes]
                for piece in (compiled, *compiled.pieces.values())]
            for key, compiled in served.compiled.items()}}
        found["warnings"] = warned.messages
    if served is not None and hasattr(served, "stats"):
        found["stats"] = served.stats  # loop_generates, fallbacks: the route each call took
ms = statistics.median(rounds)
found.update({{"ms_per_token": ms, "tokens_per_s": {batch} * 1e3 / ms, "rounds": rounds,
               "ready_s": ready, "transformers": transformers.__version__}})
print("RESULT", found)
"""


def generate_child(smoke: bool, cache_len: int, rounds: int, serve_cache: str | None = None,
                   loop: bool = False, batch: int = 1) -> dict[str, Any]:  # fmt: skip
    """transformers' ``generate`` in a fresh process, at ``batch``, on a cache it is passed:
    its own (it compiles the decode steps itself), or under ``serve_generate`` on our
    artifact cache ``serve_cache`` (then with its profile and captured sizes; ``loop``:
    ``serve_generate(loop=True)``, no EOS instead of ``min_new_tokens``); the error where
    it fails."""
    failures: dict[str, Any] = {}
    label = LOOP if loop else SERVE if serve_cache is not None else "transformers generate"
    label += f", batch {batch}"
    for new_caches in (False, True):
        how = "a new cache per call" if new_caches else "a cache it is passed, reset per call"
        code = GENERATE.format(here=HERE, root=ROOT, smoke=smoke, cache_len=cache_len,
                               rounds=rounds, new_caches=new_caches,
                               serve_cache=serve_cache, loop=loop, batch=batch)  # fmt: skip
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 timeout=240)  # fmt: skip
        except subprocess.TimeoutExpired:
            failures[how] = {"error": "did not finish in 240 s"}
            continue
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if out.returncode != 0 or line is None:
            lines = [x for x in out.stderr.splitlines() if "Assertion" not in x]
            asserts = len(out.stderr.splitlines()) - len(lines)
            failures[how] = {"error": "\n".join(lines[-25:]), "rc": out.returncode,
                             "device_asserts": asserts}  # fmt: skip
            print(f"[decode] {label}, {how}: failed {failures[how]}", flush=True)
            continue
        found: dict[str, Any] = eval(line[len("RESULT ") :])  # our own child's dict literal
        found["how"] = how
        found["failed_before"] = failures
        print(f"[decode] {label}, {how}: " + str({k: v for k, v in found.items()
                                                 if k != "profile"}), flush=True)  # fmt: skip
        if "profile" in found:
            print(found["profile"], flush=True)
        return found
    return failures


def first_difference(plain: Callable[..., Any], graphs: Callable[..., Any],
                     prompt: torch.Tensor, cache: Any, config: Any,
                     cache_len: int) -> dict[str, Any]:  # fmt: skip
    """Decode in lock step (both fed plain's tokens, each on its own cache): the first
    step whose logits differ, by how much, and whether the greedy token flips there."""
    import transformers

    cache.reset()
    other = transformers.StaticCache(config=config, max_cache_len=cache_len)
    ids = prompt
    for step in range(STEPS + 1):
        a = plain(ids, other)[:, -1]
        b = graphs(ids, cache)[:, -1]
        if not torch.equal(a, b):
            diff = (a.float() - b.float()).abs().max().item()
            flips = bool((a.argmax(-1) != b.argmax(-1)).any())
            return {"step": step, "max_abs_logit_diff": diff, "token_flips": flips}
        ids = a.argmax(-1, keepdim=True)
    return {"step": None}


def generate_profile(model: torch.nn.Module, prompt: torch.Tensor, cache: Any, served: Any) -> str:
    """Where a served ``generate`` of 64 tokens spends its host time: cProfile (own time,
    and our code's cumulative time), then, unprofiled, the share inside our forward (the
    router and the compiled call) and the GPU waits per call site."""
    import collections
    import cProfile
    import io
    import pstats

    from precompile import GenerateServer

    from _common import gpu_waits

    def run() -> None:
        cache.reset()
        with served:
            model.generate(prompt, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                           past_key_values=cache, pad_token_id=0)  # fmt: skip

    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats("precompile", 15)
    inside = [0.0]
    real = GenerateServer.__call__

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - began

    GenerateServer.__call__ = timed  # type: ignore[method-assign]
    try:
        torch.cuda.synchronize()
        began = time.perf_counter()
        run()
        torch.cuda.synchronize()
        total = time.perf_counter() - began
    finally:
        GenerateServer.__call__ = real  # type: ignore[method-assign]
    sites = collections.Counter(
        f"{os.path.relpath(filename, ROOT)}:{line}" for filename, line in gpu_waits(run)
    )
    text.write(f"\nunprofiled: {total * 1e3:.1f} ms for {STEPS} tokens with the prefill, "
               f"{inside[0] * 1e3:.1f} ms of it inside our forward (router and compiled "
               f"call)\nGPU waits per call site: {dict(sites.most_common(10))}\n")  # fmt: skip
    print(text.getvalue(), flush=True)
    return text.getvalue()


def host_profile(row: Callable[..., Any], prompt: torch.Tensor, cache: Any) -> str:
    """Where the host's time goes in 64 decode steps (cProfile, top functions by own
    time): what a replayed step costs before the GPU does anything."""
    import cProfile
    import io
    import pstats

    cache.reset()
    ids = row(prompt, cache)[:, -1:].argmax(-1)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(STEPS):
        ids = row(ids, cache)[:, -1:].argmax(-1)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
    print(text.getvalue(), flush=True)
    return text.getvalue()


WARM = """
import sys, time
started = time.perf_counter()
sys.path.insert(0, {here!r})
sys.path.insert(0, {root!r})
from _common import watch_processes
spawned = watch_processes()
import torch, precompile
from _common import count_tracing_and_compiles, is_compiler
from decode import OUR_OPTIONS, PROMPT, build, our_call
precompile.compile_model  # the lazy import is import time, not load time
frames, compiles = count_tracing_and_compiles()
model = build({smoke})
call = our_call(model, 2, PROMPT, {cache_len})
torch.cuda.synchronize()
built = time.perf_counter()
with torch.no_grad():
    compiled = precompile.compile_model(model, (), call, cache={cache!r}, cudagraphs=True,
                                        warmup=False, **OUR_OPTIONS)
    request = our_call(model, 1, PROMPT, {cache_len})  # a request of batch 1, its own cache
    out = compiled(**request)
    token = out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    first = time.perf_counter() - built
    began = time.perf_counter()
    for _ in range(8):
        token = compiled(input_ids=token, past_key_values=request["past_key_values"],
                         use_cache=True).logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    decode8 = time.perf_counter() - began
print("RESULT", {{"call_to_first_token_s": first, "first_8_decode_steps_s": decode8,
       "process_start_to_model_built_s": built - started, "dynamo_frames": len(frames),
       "inductor_compiles": len(compiles), "processes": len(spawned),
       "compiler_processes": sorted(p for p in spawned if is_compiler(p))}})
"""


def warm_start(smoke: bool, cache: str, cache_len: int) -> dict[str, Any]:
    """Fresh processes on the warm artifact cache (the second with a warm Triton cache
    too): ``compile_model`` (no tracing) and the first prefill, to its first token."""
    found: dict[str, Any] = {}
    triton_dir = tempfile.mkdtemp(prefix="triton-")
    for label in ("fresh process, empty Triton cache", "fresh process, warm Triton cache"):
        code = WARM.format(here=HERE, root=ROOT, smoke=smoke, cache=cache, cache_len=cache_len)
        env = {**os.environ, "TRITON_CACHE_DIR": triton_dir,
               "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-")}  # fmt: skip
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if out.returncode != 0 or line is None:
            found[label] = {"error": out.stderr[-2000:]}
        else:
            found[label] = eval(line[len("RESULT ") :])  # our own child's dict literal
        print(f"[decode] {label}: {found[label]}", flush=True)
    return found


def warm_start_only(args: argparse.Namespace) -> dict[str, Any]:
    """Compile the decode model once into a new cache, then the fresh-process rows."""
    import precompile

    from _common import environment

    cache_dir = args.cache or tempfile.mkdtemp(prefix="precompile-decode-")
    model = build(args.smoke)
    with torch.no_grad():
        example = our_call(model, 2, PROMPT, args.cache_len)
        precompile.compile_model(model, (), example, cache=cache_dir, warmup=False, **OUR_OPTIONS)
    document = {
        "environment": environment("cuda"),
        "warm_start": warm_start(args.smoke, cache_dir, args.cache_len),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2)
    return document


def summarize(document: dict[str, Any]) -> str:
    from _common import table

    batches = document["batches"]
    headers = ["row", *(f"decode ms/token, batch {b}" for b in batches),
               *(f"tokens/s, batch {b}" for b in batches),
               *(f"prefill {n} ms" for n in PREFILLS), "graph memory MiB"]  # fmt: skip
    body = []
    for name in ROWS:
        decode = document["decode"][name]
        cells: list[Any] = [name]
        if "error" in decode:
            body.append([name, "failed: see the JSON", *["-"] * (len(headers) - 2)])
            continue
        cells += [decode[str(b)]["ms_per_token"] if str(b) in decode else "-" for b in batches]
        cells += [decode[str(b)]["tokens_per_s"] if str(b) in decode else "-" for b in batches]
        prefill = document.get("prefill_ms", {}).get(name, {})
        cells += [prefill.get(str(n), "-") for n in PREFILLS]
        cells.append(document.get("graph_memory_mb", {}).get(name, "-"))
        body.append(cells)
    lines = [table(headers, body), ""]
    lines.append("ready (compiles and captures of the first runs), s: " + ", ".join(
        f"{k} {v:.1f}" for k, v in document["ready_s"].items()))  # fmt: skip
    lines.append(f"ours + cudagraphs tokens identical to ours: "
                 f"{document.get('ours_cudagraphs_tokens_identical')}")  # fmt: skip
    for label, numbers in document.get("new_batch_generate_ms", {}).items():
        lines.append(f"generate at a new batch, {label} cache: " + ", ".join(
            f"batch {b}: +{v['extra_ms']:.1f} ms" for b, v in numbers.items()))  # fmt: skip
    for label, numbers in document.get("warm_start", {}).items():
        lines.append(f"{label}: {numbers}")
    return "\n".join(lines)


def plot(path: str) -> None:
    from _common import result_figure

    found = result_figure(path, (9, 5))
    if found is None:
        return
    _, document, figure, axis = found
    batches = document["batches"]
    width = 0.8 / len(ROWS)
    for index, name in enumerate(ROWS):
        decode = document["decode"][name]
        xs = [i + index * width for i, b in enumerate(batches) if str(b) in decode]
        ys = [decode[str(b)]["ms_per_token"] for b in batches if str(b) in decode]
        axis.bar(xs, ys, width=width, label=name)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))])
    axis.set_xticklabels([f"batch {b}" for b in batches])
    axis.set_ylabel("decode ms per token (lower is better)")
    axis.set_yscale("log")
    axis.set_title(f"Llama 2048x4 bf16 decode on {document['environment']['device']}")
    axis.legend(fontsize=8)
    axis.grid(True, axis="y", which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path.replace(".json", ".png"), dpi=120)
    print(f"wrote {path.replace('.json', '.png')}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-len", type=int, default=1152)
    parser.add_argument("--cache", help="the precompile artifact cache (default: a new one)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "decode-llama.json"))
    parser.add_argument("--plot", metavar="JSON", help="only draw the plot of a result file")
    parser.add_argument(
        "--warm-start-only",
        action="store_true",
        help="compile once into the cache, then only the fresh-process rows (JSON to --out)",
    )
    parser.add_argument("--rows", help="only these rows, ';'-separated (default: every row)")
    parser.add_argument(
        "--build-only",
        metavar="WHAT",
        help="only compile into --cache: 'auto', '0' (compile_model under that "
        "PRECOMPILE_CUDNN_ATTENTION), 'serve' (serve_generate's models); ';'-separated",
    )
    args = parser.parse_args()
    if args.rows:
        chosen = [r.strip() for r in args.rows.split(";") if r.strip()]
        unknown = [r for r in chosen if r not in ROWS]
        if unknown:
            parser.error(f"unknown rows {unknown}; the rows are {ROWS}")
        ROWS[:] = [r for r in ROWS if r in chosen]
    if args.build_only:
        if not args.cache:
            parser.error("--build-only needs --cache")
        model = build(args.smoke)
        with torch.no_grad():
            for what in args.build_only.split(";"):
                if what == "serve":
                    import precompile

                    served = precompile.serve_generate(model, cache=args.cache, cudagraphs=True,
                                                       hints=[PROMPT], warmup=True)  # fmt: skip
                    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT), device="cuda")
                    cache = __import__("transformers").StaticCache(
                        config=model.config, max_cache_len=args.cache_len
                    )
                    generate_run(model, prompt, cache, served)
                elif what in ("auto", "0"):
                    compile_ours(model, args.cache, args.cache_len, what, False)
                else:
                    parser.error(f"--build-only takes auto, 0 or serve, got {what!r}")
        return
    if args.plot:
        plot(args.plot)
        return
    if args.warm_start_only:
        print(json.dumps(warm_start_only(args), indent=1))
        return
    document = measure(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2)
    print(summarize(document))
    print(f"wrote {args.out}")
    plot(args.out)


if __name__ == "__main__":
    main()
