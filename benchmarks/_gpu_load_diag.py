"""The GPU diagnostics behind results/gpu-load-h100.json (the README's GPU load rows).

    python benchmarks/_gpu_load_diag.py env OUT      # torch/Triton facts, sources to OUT
    python benchmarks/_gpu_load_diag.py blas OUT     # eager GEMM first call at new sizes
    python benchmarks/_gpu_load_diag.py build OUT dynamic    # compile_model the Llama, time it
    python benchmarks/_gpu_load_diag.py warm OUT dynamic TAG # a fresh process: load, first
                                                             # output, new sizes, processes

Run ``build`` and then ``warm`` with the same PRECOMPILE_CACHE_DIR and fresh, empty
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR for each process. ``warm`` with a TAG starting
"prof" loads with no warm-up and writes a cProfile of the first call; "nowarm": no warm-up,
no profile; "stacks": every thread's stack every 0.2 s until the first output; "graphs": CUDA
graphs captured at GRAPH_SIZES in the warm-up, other sizes padded up to the next one.
DIAG_QUICK=1 makes ``build`` stop after compiling. The SETTING argument is historical: the
measurements of cuDNN attention in hint variants ("none") were taken with
PRECOMPILE_CUDNN_ATTENTION=1's behaviour; today set that variable instead.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

SPAWNED: list[dict] = []
# Sizes captured (and padded up to) by the "graphs" rows.
GRAPH_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)


def audit(event, args):
    if event in ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.system"):
        try:
            if event == "subprocess.Popen":
                argv = args[1] if isinstance(args[1], (list, tuple)) else [args[0] or args[1]]
            else:
                argv = (
                    args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else [args[0]]
                )
            argv = [str(a) for a in argv][:8]
            stack = [
                f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                for f in traceback.extract_stack()[:-1]
            ][-30:]
            SPAWNED.append({"event": event, "argv": argv, "stack": stack})
        except Exception as exc:  # never break the program
            SPAWNED.append({"event": event, "error": repr(exc)})


def env(out: str) -> None:
    import inspect
    import subprocess

    import torch
    import triton

    lines = [f"torch {torch.__version__} triton {triton.__version__}"]
    import torch._inductor.config as c

    lines.append("static keys: " + repr({k: getattr(c, k) for k in dir(c) if "static" in k}))
    lines.append("compile_threads " + repr(c.compile_threads))
    lines.append("bundle_triton " + repr(c.bundle_triton_into_fx_graph_cache))
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys,torch; import torch._inductor.config; "
            "print('dynamo imported by torch._inductor:', 'torch._dynamo' in sys.modules)",
        ],
        capture_output=True,
        text=True,
    )
    lines.append(r.stdout + r.stderr[-500:])
    from torch._inductor import async_compile, triton_bundler
    from torch._inductor.runtime import triton_heuristics as th

    sources = []
    from torch._inductor.choices import InductorChoices
    from torch._inductor.codecache import StaticAutotunerFuture

    lines.append("customize hook: " + repr(hasattr(InductorChoices, "customize_fused_kernel_name")))
    for obj in [
        th.CachingAutotuner._dynamic_scale_rblock,
        th.CachingAutotuner.recheck_autotune_cache,
        StaticAutotunerFuture.result,
        th.CachingAutotuner.run,
        th.StaticTritonCompileResult,
        th.CachingAutotuner.precompile,
        th.CachingAutotuner._make_launchers,
        async_compile.AsyncCompile.triton,
        async_compile.AsyncCompile.use_process_pool,
        triton_bundler.TritonBundler.load_autotuners,
        triton_bundler.TritonBundler.put_static_autotuner,
    ]:
        try:
            sources.append(f"##### {obj}\n{inspect.getsource(obj)}")
        except Exception as exc:
            sources.append(f"##### {obj}: {exc}")
    try:
        from torch._inductor.runtime import benchmarking

        sources.append(inspect.getsource(benchmarking))
    except Exception as exc:
        sources.append(f"benchmarking: {exc}")
    with open(os.path.join(out, "sources.txt"), "w") as handle:
        handle.write("\n\n".join(sources))
    print("\n".join(lines))


def _log_to(path):
    import logging

    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    for name in (
        "torch._inductor.runtime.triton_heuristics",
        "torch._inductor.triton_bundler",
        "torch._inductor.codecache",
        "torch._inductor.async_compile",
        "torch._inductor.runtime.autotune_cache",
    ):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)


def _autotuners(art):
    from precompile.runtime import _torch_adapter as ra

    rows = []
    for v in art.variants:
        entry, _, _ = ra.unpickle_bundle(art.payload_bytes(v.payload))
        g = ra.forward_graph(entry)
        bundle = getattr(g, "_triton_bundle", None)
        src = str(g.source_code)
        import re

        names = re.findall(r"^(\w+) = async_compile\.triton\('(\w+)'", src, re.M)
        static = []
        for a in bundle.static_autotuners if bundle else []:
            k = a.kernel
            static.append(
                [
                    a.kernel_name,
                    len(k.compile_results),
                    [str(r.config) for r in k.compile_results][:4],
                    k.inductor_meta.get("dynamic_scale_rblock"),
                ]
            )
        rows.append(
            {
                "variant": v.index,
                "max_name": max(len(n[1]) for n in names) if names else 0,
                "source_kernels": [n[1] for n in names],
                "static": static,
                "missing": sorted(set(n[1] for n in names) - set(a[0] for a in static)),
            }
        )
    return rows


def _head(path: str) -> str:
    with open(path) as handle:
        return handle.read()[:300]


def _model():
    import torch

    from _common import llama

    return llama("issue", "cuda", torch.bfloat16)


def _set(setting: str) -> None:
    if setting == "none":  # cuDNN attention in hint variants too
        os.environ["PRECOMPILE_CUDNN_ATTENTION"] = "1"


def _bench(fn, reps=20):
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def build(out: str, setting: str) -> None:
    import torch

    import precompile
    from precompile.runtime import _torch_adapter as ra

    _set(setting)
    _log_to(os.path.join(out, f"build-{setting}-torchlog.txt"))
    model = _model()
    vocab = model.config.vocab_size
    ids = lambda n: torch.randint(0, vocab, (1, n), device="cuda")  # noqa: E731
    result: dict = {"setting": setting}
    with torch.no_grad():
        t = time.perf_counter()
        compiled = precompile.compile_model(
            model, (ids(128),), dynamic={0: [1]}, hints=[16, 256, 2048], warmup=False
        )
        result["compile_s"] = time.perf_counter() - t
        art = compiled.artifact if hasattr(compiled, "artifact") else None
        result["artifact_attr"] = [a for a in dir(compiled) if not a.startswith("__")][:60]
        if art is None:
            for name in ("_artifact", "_art"):
                art = getattr(compiled, name, None)
                if art is not None:
                    break
        if art is not None:
            info = []
            for v in art.variants:
                payload = art.payload_bytes(v.payload)
                entry, _, _ = ra.unpickle_bundle(payload)
                g = ra.forward_graph(entry)
                bundle = getattr(g, "_triton_bundle", None)
                src = str(g.source_code)
                info.append(
                    {
                        "variant": v.index,
                        "kind": v.kind,
                        "point": dict(v.point),
                        "static_autotuners": None
                        if bundle is None
                        else len(bundle.static_autotuners),
                        "kernel_artifacts": None
                        if bundle is None
                        else len(bundle.kernel_artifacts),
                        "cudnn_attention": src.count("_scaled_dot_product_cudnn_attention"),
                        "efficient_attention": src.count("_scaled_dot_product_efficient_attention"),
                        "flash_attention": src.count("_scaled_dot_product_flash_attention"),
                        "triton_kernels": src.count("async_compile.triton("),
                    }
                )
            result["variants"] = info
        if os.environ.get("DIAG_QUICK"):
            print(json.dumps(result))
            return
        # steady state per S, first call at new sizes
        first_new = {}
        for n in (300, 301, 777):
            x = ids(n)
            torch.cuda.synchronize()
            t = time.perf_counter()
            compiled(x)
            torch.cuda.synchronize()
            first_new[n] = (time.perf_counter() - t) * 1e3
        result["first_call_new_size_ms_after_load"] = first_new
        steady = {}
        for n in (1, 16, 64, 128, 200, 512, 1024, 2048):
            x = ids(n)
            steady[n] = _bench(lambda x=x: compiled(x))
        result["steady_ms"] = steady
        again = {}
        for n in (300, 301, 777, 333, 1500):
            x = ids(n)
            torch.cuda.synchronize()
            t = time.perf_counter()
            compiled(x)
            torch.cuda.synchronize()
            again[n] = (time.perf_counter() - t) * 1e3
        result["call_ms_after_steady (333,1500 new)"] = again
        result["autotuners"] = _autotuners(compiled.artifact)
        from precompile.runtime.compiler_interface import build_dir

        best = []
        for root, _, files in os.walk(build_dir()):
            best += [os.path.join(root, f) for f in files if f.endswith(".best_config")]
        result["best_config_files"] = len(best)
        result["best_config_sample"] = [_head(b) for b in best[:3]]
        from torch.profiler import ProfilerActivity, profile

        x = ids(345)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            compiled(x)
            torch.cuda.synchronize()
        with open(os.path.join(out, "profile-new-size.txt"), "w") as handle:
            handle.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
        x = ids(346)
        compiled(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            compiled(x)
            torch.cuda.synchronize()
        with open(os.path.join(out, "profile-same-size.txt"), "w") as handle:
            handle.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    print(json.dumps(result))
    with open(os.path.join(out, f"build-{setting}.json"), "w") as handle:
        json.dump(result, handle, indent=1, default=str)


def warm(out: str, setting: str, tag: str) -> None:

    sys.addaudithook(audit)
    started = time.perf_counter()
    import torch

    import precompile

    precompile.compile_model  # noqa: B018  (the lazy import belongs to import_s, not to the load)
    imported = time.perf_counter()
    _log_to(os.path.join(out, f"warm-{tag}-torchlog.txt"))
    _set(setting)
    model = _model()
    vocab = model.config.vocab_size
    ids = lambda n: torch.randint(0, vocab, (1, n), device="cuda")  # noqa: E731
    built = time.perf_counter()
    result: dict = {
        "setting": setting,
        "tag": tag,
        "import_s": imported - started,
        "model_s": built - imported,
    }
    prof = None
    if tag.startswith("stacks"):  # every thread's stack every 0.2 s during the first call
        import faulthandler

        stacks = open(os.path.join(out, f"stacks-{tag}.txt"), "w")  # noqa: SIM115
        faulthandler.dump_traceback_later(0.2, repeat=True, file=stacks)
    if tag.startswith("prof"):
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    with torch.no_grad():
        x = ids(128)
        torch.cuda.synchronize()
        t = time.perf_counter()
        compiled = precompile.compile_model(
            model,
            (x,),
            dynamic={0: [1]},
            hints=[16, 256, 2048],
            warmup=False if prof or tag.startswith("nowarm") else "background",
            cudagraphs=precompile.CudaGraphs(capture_sizes=GRAPH_SIZES, pad=True)
            if tag.startswith("graphs")
            else None,
        )
        result["load_s"] = time.perf_counter() - t
        compiled(x)
        torch.cuda.synchronize()
        result["first_output_s"] = time.perf_counter() - t
        result["spawned_at_first_output"] = len(SPAWNED)
        if tag.startswith("stacks"):
            faulthandler.cancel_dump_traceback_later()
        if prof is not None:
            prof.disable()
            import io
            import pstats

            stream = io.StringIO()
            pstats.Stats(prof, stream=stream).sort_stats("cumulative").print_stats(60)
            stream.write("\n\n===== tottime\n")
            pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(40)
            with open(os.path.join(out, f"{tag}.txt"), "w") as handle:
                handle.write(stream.getvalue())
        compiled.wait_warm(timeout=600)
        result["warm_done_s"] = time.perf_counter() - t
        if tag.startswith("newprof"):  # where a size first seen after warm-up spends its time
            import cProfile
            import io
            import pstats

            from torch.profiler import ProfilerActivity, profile

            y = ids(250)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
                compiled(y)
                torch.cuda.synchronize()
            with open(os.path.join(out, f"newsize-torchprof-{tag}.txt"), "w") as handle:
                handle.write(tprof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
            y = ids(260)
            torch.cuda.synchronize()
            cprof = cProfile.Profile()
            cprof.enable()
            compiled(y)
            torch.cuda.synchronize()
            cprof.disable()
            stream = io.StringIO()
            pstats.Stats(cprof, stream=stream).sort_stats("tottime").print_stats(40)
            with open(os.path.join(out, f"newsize-cprof-{tag}.txt"), "w") as handle:
                handle.write(stream.getvalue())
        for n in (200, 201, 333, 1500, 1):
            y = ids(n)
            torch.cuda.synchronize()
            s = time.perf_counter()
            compiled(y)
            torch.cuda.synchronize()
            result[f"call_{n}_ms"] = (time.perf_counter() - s) * 1e3
            if n == 200:
                y = ids(n)
                torch.cuda.synchronize()
                s = time.perf_counter()
                compiled(y)
                torch.cuda.synchronize()
                result["call_200_again_ms"] = (time.perf_counter() - s) * 1e3
        y = ids(333)  # the served logits against eager's (bf16): padding must not show
        got, want = compiled(y).logits.float(), model(y).logits.float()
        result["max_abs_diff_333_vs_eager"] = (got - want).abs().max().item()
        result["max_abs_logit_333"] = want.abs().max().item()
    try:
        from torch._inductor.async_compile import CompiledTritonKernels

        kinds = {}
        for value in CompiledTritonKernels._cache.values():
            kinds[type(value).__name__] = kinds.get(type(value).__name__, 0) + 1
        result["compiled_triton_kernels"] = kinds
    except Exception as exc:
        result["compiled_triton_kernels"] = repr(exc)
    result["spawned"] = [s.get("argv", s)[:3] for s in SPAWNED]
    result["compilers"] = sum(
        1
        for s in SPAWNED
        if any(
            k in os.path.basename(s.get("argv", ["?"])[0])
            for k in ("gcc", "cc", "ptxas", "clang", "nvcc", "ld")
        )
    )
    result["modules"] = len(sys.modules)
    print(json.dumps({k: v for k, v in result.items() if k != "spawned"}))
    with open(os.path.join(out, f"warm-{tag}.json"), "w") as handle:
        json.dump({**result, "spawn_detail": SPAWNED}, handle, indent=1, default=str)


def blasinit(out: str) -> None:
    """What a fresh process's first GEMM costs: cuBLAS's handle, then first GEMMs, with
    the handle made on the main thread or (``thread`` in argv) on another one."""
    import threading

    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    row = {}
    t = time.perf_counter()
    if "thread" in sys.argv:
        worker = threading.Thread(target=torch.cuda.current_blas_handle)
        worker.start()
        worker.join()
    else:
        torch.cuda.current_blas_handle()
    row["handle_ms"] = (time.perf_counter() - t) * 1e3
    for m, n, k in ((64, 2048, 2048), (128, 3072, 2048), (128, 2048, 2048), (128, 11264, 2048),
                    (128, 2048, 5632), (128, 32000, 2048)):  # fmt: skip
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t = time.perf_counter()
        torch.mm(a, b.t())
        torch.cuda.synchronize()
        row[f"mm_{m}x{n}x{k}_ms"] = (time.perf_counter() - t) * 1e3
    print(json.dumps(row))


def blas(out: str) -> None:
    """First call of eager bf16 GEMMs at new M: the per-shape host cost of cuBLAS."""
    import torch

    w = torch.randn(5632, 2048, device="cuda", dtype=torch.bfloat16)
    rows = {}
    for label in ("default", "cublaslt"):
        if label == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
        torch.nn.functional.linear(x, w)
        torch.cuda.synchronize()
        firsts, seconds = [], []
        for m in range(
            301 + (0 if label == "default" else 50), 311 + (0 if label == "default" else 50)
        ):
            x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            t = time.perf_counter()
            torch.nn.functional.linear(x, w)
            torch.cuda.synchronize()
            firsts.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            torch.nn.functional.linear(x, w)
            torch.cuda.synchronize()
            seconds.append((time.perf_counter() - t) * 1e3)
        rows[label] = {
            "first_ms": [round(v, 3) for v in firsts],
            "again_ms": [round(v, 3) for v in seconds],
        }
    print(json.dumps(rows))


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    if mode == "env":
        env(out)
    elif mode == "blasinit":
        blasinit(out)
    elif mode == "blas":
        blas(out)
    elif mode == "build":
        build(out, sys.argv[3])
    else:
        warm(out, sys.argv[3], sys.argv[4])
