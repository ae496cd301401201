"""Warm start: bundled C++ kernels (no compiler process), fallbacks, isolation, threads."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from typing import Any

import pytest
import torch
from conftest import Compiled, run_python
from warm_start_helpers import AUDIT

import precompile
from precompile.cache import decode_json
from precompile.runtime import Manifest, NativeKernel
from precompile.runtime import _native_kernels as native

SIZES = [1, 3, 5, 16, 100]


def cases(mlp: Compiled, directory: str, sizes: list[int] = SIZES) -> str:
    torch.manual_seed(5)
    args, expected = [], []
    for n in sizes:
        x = torch.randn(n, 32)
        # Served weights are plain tensors (a server loads them, it does not train them).
        args.append(
            [a.detach() if isinstance(a, torch.Tensor) else a for a in mlp.captured.flat(x)]
        )
        with torch.no_grad():
            expected.append(mlp.captured.model(x))
    path = os.path.join(directory, "cases.pt")
    torch.save({"args": args, "expected": expected}, path)
    return path


def fresh_inductor_dir() -> str:
    return os.path.join(tempfile.mkdtemp(prefix="user-inductor-"), "never-created")


@pytest.mark.parametrize("fmt", ["binary", "unpacked"])
def test_bundled_kernels_load_and_run_with_no_compiler_process(
    mlp: Compiled, saved: dict[str, str], fmt: str, tmp_path: object
) -> None:
    user_dir = fresh_inductor_dir()
    out = run_python(
        AUDIT
        + f"""
import torch, precompile
env_before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
art = precompile.CompiledArtifact.load(path={saved[fmt]!r}, format={fmt!r})
assert art.loaded_variants == (), art.loaded_variants  # lazy by default
c = torch.load({cases(mlp, str(tmp_path))!r})
for flat, want in zip(c["args"], c["expected"]):
    torch.testing.assert_close(art(*flat)[0], want, rtol=1e-4, atol=1e-4)
assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == env_before
print("variants", sorted(set(art.loaded_variants)))
print("spawned", len(spawned), spawned)
# Importing torch._dynamo creates the dir (torch's doing); nothing may be written in it.
print("files in user dir", sum(len(f) for _, _, f in os.walk({user_dir!r})))
""",
        env={"TORCHINDUCTOR_CACHE_DIR": user_dir},
    )
    assert "spawned 0 []" in out, out
    assert "files in user dir 0" in out
    assert "variants [0, 1, 2, 3]" in out  # every variant ran, hint and static


def in_fresh_process(patch: str, artifact: str, cases_path: str, body: str) -> str:
    """Run ``body`` in a fresh interpreter after ``patch``, with the artifact loaded as
    ``art``, the cases as ``c``, processes counted in ``spawned`` and our log messages
    kept in ``records``."""
    return run_python(
        AUDIT
        + patch
        + f"""
import logging, torch, precompile
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
logging.getLogger("precompile").addHandler(Keep())
art = precompile.CompiledArtifact.load(path={artifact!r})
c = torch.load({cases_path!r})
"""
        + body,
        env={"TORCHINDUCTOR_CACHE_DIR": fresh_inductor_dir()},
    )


def test_unusable_kernels_fall_back_to_building_with_a_warning(
    mlp: Compiled, saved: dict[str, str], tmp_path: object
) -> None:
    # This CPU "lacks" every feature: the binaries are skipped, the source is built (same
    # ISA as the compile, so the rebuild is correct), a warning says why, results match.
    out = in_fresh_process(
        "from precompile.runtime import _native_kernels\n"
        "_native_kernels.cpu_features = lambda: frozenset()\n",
        saved["binary"],
        cases(mlp, str(tmp_path), [5]),
        """
for flat, want in zip(c["args"], c["expected"]):
    torch.testing.assert_close(art(*flat)[0], want, rtol=1e-4, atol=1e-4)
print("spawned", len(spawned))
print("warnings", sum("building C++ kernel" in r and "lacks" in r for r in records))
""",
    )
    assert "spawned 0" not in out  # the compiler did run: the audit hook sees it
    warnings = int(out.split("warnings ")[1].split()[0])
    assert warnings >= 1, out


def test_binary_that_fails_to_load_falls_back_to_building(
    mlp: Compiled, saved: dict[str, str], tmp_path: object
) -> None:
    out = in_fresh_process(
        "from precompile.runtime import _torch_adapter\n"
        "def broken(path, key):\n"
        "    raise OSError('simulated: wrong glibc')\n"
        "_torch_adapter.import_cpp_kernel = broken\n",
        saved["binary"],
        cases(mlp, str(tmp_path), [16]),
        """
torch.testing.assert_close(art(*c["args"][0])[0], c["expected"][0], rtol=1e-4, atol=1e-4)
print("warnings", sum("simulated: wrong glibc" in r for r in records))
""",
    )
    assert int(out.split("warnings ")[1].split()[0]) >= 1, out


def test_rebuild_is_refused_where_inductor_would_generate_another_vector_width(
    mlp: Compiled, saved: dict[str, str], tmp_path: object
) -> None:
    out = in_fresh_process(
        "from precompile.runtime import _native_kernels, _torch_adapter\n"
        "_native_kernels.cpu_features = lambda: frozenset()\n"
        "_torch_adapter.vec_isa = lambda: ('some-other-isa', '')\n",
        saved["binary"],
        cases(mlp, str(tmp_path), [5]),
        """
try:
    art(*c["args"][0])
except precompile.IncompatibleArtifactError as exc:
    print("refused:", exc)
print("spawned", len(spawned))
""",
    )
    assert "refused:" in out and "some-other-isa" in out and "recompile" in out
    assert "spawned 0" in out


def test_threads_load_and_call_at_once_without_touching_the_process_cache_dir(
    mlp: Compiled, saved: dict[str, str], tmp_path: object
) -> None:
    out = run_python(
        AUDIT
        + f"""
import threading, torch, precompile
from torch._inductor.runtime import cache_dir_utils
user_dir = cache_dir_utils.cache_dir()
c = torch.load({cases(mlp, str(tmp_path))!r})
arts = [precompile.CompiledArtifact.load(path={saved["binary"]!r}) for _ in range(2)]
barrier = threading.Barrier(len(c["args"]) * 2 + 1)
errors, seen = [], set()
def call(art, flat, want):
    barrier.wait()
    try:
        torch.testing.assert_close(art(*flat)[0], want, rtol=1e-4, atol=1e-4)
    except BaseException as exc:
        errors.append(repr(exc))
def watch():
    barrier.wait()
    for _ in range(2000):
        seen.add(cache_dir_utils.cache_dir())
threads = [threading.Thread(target=call, args=(a, f, w))
           for a in arts for f, w in zip(c["args"], c["expected"])]
threads.append(threading.Thread(target=watch))
for t in threads: t.start()
for t in threads: t.join()
print("errors", errors)
print("other threads saw only the user dir", seen == {{user_dir}})
print("spawned", len(spawned))
""",
        env={"TORCHINDUCTOR_CACHE_DIR": fresh_inductor_dir()},
    )
    assert "errors []" in out, out
    assert "other threads saw only the user dir True" in out
    assert "spawned 0" in out


def test_variants_load_lazily_and_warm_up_in_the_background(saved: dict[str, str]) -> None:
    art = precompile.CompiledArtifact.load(path=saved["binary"])
    assert art.loaded_variants == ()
    assert art.warmup(background=True) is art
    assert art.wait_warm(timeout=300)
    assert art.loaded_variants == tuple(range(len(art.variants)))
    eager = precompile.CompiledArtifact.load(path=saved["binary"], warmup=True)
    assert eager.loaded_variants == tuple(range(len(eager.variants)))
    with pytest.raises(precompile.InvalidOptionError, match="warmup"):
        precompile.CompiledArtifact.load(path=saved["binary"], warmup="later")  # type: ignore[arg-type]


def test_background_warm_up_leaves_the_first_call_to_itself(
    mlp: Compiled, saved: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server calls right after loading: its variant loads first, in the calling
    thread, and the warm-up thread loads the others only after that call returned."""
    art = precompile.CompiledArtifact.load(path=saved["binary"])
    loads: list[tuple[str, int]] = []
    original = art._variant_callable

    def recorded(variant: Any) -> Any:
        found = original(variant)
        loads.append((threading.current_thread().name, variant.index))
        return found

    monkeypatch.setattr(art, "_variant_callable", recorded)
    art.warmup(background=True)
    x = torch.randn(100, 32)
    flat = [a.detach() if isinstance(a, torch.Tensor) else a for a in mlp.captured.flat(x)]
    with torch.no_grad():
        torch.testing.assert_close(art(*flat)[0], mlp.captured.model(x), rtol=1e-4, atol=1e-4)
    assert art.wait_warm(timeout=300)
    assert loads[0] == ("MainThread", art.explain(*flat).chosen), loads
    assert {name for name, _ in loads[1:]} == {"precompile-warmup"}, loads
    assert art.loaded_variants == tuple(range(len(art.variants)))
    monkeypatch.setenv("PRECOMPILE_WARMUP_GRACE", "soon")
    with pytest.raises(precompile.InvalidOptionError, match="PRECOMPILE_WARMUP_GRACE"):
        precompile.CompiledArtifact.load(path=saved["binary"], warmup="background")


def test_artifact_lists_its_kernels_and_the_binary_is_what_was_built(mlp: Compiled) -> None:
    manifest = mlp.artifact.manifest
    kernels = [k for v in manifest.variants for k in v.kernels]
    assert kernels and all(v.kernels for v in manifest.variants)
    for kernel in kernels:
        assert mlp.artifact.payload_bytes(kernel.binary)[:4] == b"\x7fELF"
        assert native.why_unusable(kernel) is None  # built here, usable here
    # Every kernel the wrappers build is bundled, under the key the loader computes.
    from precompile import _torch_adapter as adapter

    for variant in manifest.variants:
        sources = adapter.wrapper_sources(mlp.artifact.payload_bytes(variant.payload))
        keys = {native.kernel_key(a, s) for src in sources for a, s in native.find_cpp_kernels(src)}
        assert keys == {k.key for k in variant.kernels}


WRAPPER = '''r"""
docstring: async_compile = AsyncCompile()
"""
import torch
async_compile = AsyncCompile()
cpp_fused_0 = async_compile.cpp_pybinding(['float*', 'const int64_t'], r\'\'\'
extern "C" void kernel(float* a, const int64_t n) {}
\'\'\')
async_compile.wait(globals())
'''


def test_wrapper_rewrite_routes_cpp_kernels_through_the_loader() -> None:
    rewritten = native.redirect_cpp_kernels(WRAPPER)
    assert "async_compile.cpp_pybinding(" not in rewritten
    assert "cpp_fused_0 = __precompile_cpp_pybinding__(async_compile, ['float*'" in rewritten
    assert rewritten.startswith("from precompile.runtime._native_kernels import load_cpp_pybinding")
    compile(rewritten, "<wrapper>", "exec")  # still valid Python
    assert native.find_cpp_kernels(WRAPPER) == [
        (["float*", "const int64_t"], '\nextern "C" void kernel(float* a, const int64_t n) {}\n')
    ]
    plain = "import torch\nx = 1\n"
    assert native.redirect_cpp_kernels(plain) == plain
    future = "from __future__ import annotations\n" + WRAPPER.split('"""\n', 2)[2]
    second_line = native.redirect_cpp_kernels(future).splitlines()[1]
    assert second_line.startswith("from precompile.runtime.")


def test_cpu_features_needed_by_gcc_flags() -> None:
    flags = "-mavx512f -mavx512dq -mavx512vl -mavx512bw -mfma -mavx512bf16 -mamx-tile"
    assert native.cpu_features_for_flags(flags) == (
        "amx_tile", "avx512_bf16", "avx512bw", "avx512dq", "avx512f", "avx512vl", "fma",
    )  # fmt: skip
    assert native.cpu_features_for_flags("-march=armv8-a+sve -msve-vector-bits=256") == ()


def test_why_unusable_names_the_missing_feature_or_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    import platform

    kernel = NativeKernel("a" * 64, "b" * 64, "avx512", ("avx512f", "fma"), platform.machine())
    monkeypatch.setattr(native, "cpu_features", lambda: frozenset({"fma", "avx2"}))
    assert "lacks avx512f" in (native.why_unusable(kernel) or "")
    monkeypatch.setattr(native, "cpu_features", lambda: frozenset({"fma", "avx512f"}))
    assert native.why_unusable(kernel) is None
    foreign = NativeKernel("a" * 64, "b" * 64, "sve256", (), "not-" + platform.machine())
    assert "built for not-" in (native.why_unusable(foreign) or "")
    monkeypatch.setattr(native, "cpu_features", lambda: None)
    assert "cannot be checked" in (native.why_unusable(kernel) or "")


def test_manifests_of_earlier_formats_are_refused_with_the_reason(mlp: Compiled) -> None:
    """Formats 1 and 2 recorded no input strides: their calls could not be checked, so
    they are refused (recompile) rather than run on inputs of unknown layout."""
    document = mlp.artifact.manifest.to_json()
    for version in (1, 2, 99):
        document["format_version"] = version
        with pytest.raises(
            precompile.IncompatibleArtifactError, match=f"version {version}.*recompile"
        ):
            Manifest.from_json(decode_json(json.dumps(document).encode(), "manifest"))


def test_a_process_that_exits_during_background_warm_up_exits_cleanly(
    mlp: Compiled, saved: dict[str, str], tmp_path: object
) -> None:
    """Exit while the warm-up thread loads variants (each made to take 1 s): the process
    waits for the step in progress, then the thread stops; no C++ abort ("terminate
    called"), no warning, exit status 0 (run_python checks)."""
    out = in_fresh_process(
        "import time\n"
        "os.environ['PRECOMPILE_WARMUP_GRACE'] = '0'  # the warm-up starts at once\n"
        "from precompile.runtime import _artifact\n"
        "original = _artifact.CompiledArtifact._variant_callable\n"
        "def slow(self, variant):\n"
        "    time.sleep(1)\n"
        "    found = original(self, variant)\n"
        "    print('step done', flush=True)\n"
        "    return found\n"
        "_artifact.CompiledArtifact._variant_callable = slow\n",
        saved["binary"],
        cases(mlp, str(tmp_path), [5]),
        """
import atexit
atexit.register(lambda: print("warm-up records", [r for r in records if "warm" in r]))
art.warmup(background=True, inputs=c["args"][0])
print("exiting", flush=True)
""",
    )
    assert "warm-up records []" in out, out
    assert out.split("exiting")[1].count("step done") == 1, out  # the step it was in
