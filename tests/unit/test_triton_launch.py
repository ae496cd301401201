"""The GPU lean path's parts that need no GPU: reading a CUDA wrapper module for the lean
path, the ``TritonLaunch`` schema (written, read back, hostile fields refused) and the
launch functions built from it. Internal modules are this file's subject:
``precompile._lean_scan`` (source scan), ``precompile.runtime._manifest`` (schema) and
``precompile.runtime._triton_launch`` (launch functions). The GPU runs are in
``test_gpu_lean.py``."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import pytest
from synthetic_helpers import digest

from precompile._lean_scan import scan_lean_source
from precompile.runtime import (
    CorruptArtifactError,
    LeanCall,
    Manifest,
    Symbol,
    SymbolSource,
    Variant,
)
from precompile.runtime._triton_launch import launcher_source
from precompile.runtime.compiler_interface import TensorInput, TritonLaunch, current_environment

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
# A wrapper module inductor generated on an H100 (torch 2.11, Triton 3.6) for
# layer_norm(relu(linear(x))) -> softmax * sum, amax: an extern mm and two Triton kernels.
with open(os.path.join(DATA, "cuda_wrapper_torch211.txt"), encoding="utf-8") as _file:
    CUDA_WRAPPER = _file.read()


def test_a_cuda_wrapper_is_lean_on_gpus_only() -> None:
    scan = scan_lean_source(CUDA_WRAPPER, gpu=True)
    assert scan.blockers == ()
    assert scan.triton_kernels == ("triton_per__0", "triton_red__1")
    assert scan.externs == ("mm",)
    cpu = scan_lean_source(CUDA_WRAPPER, gpu=False)
    assert "imports triton" in cpu.blockers
    assert "compiles kernels with async_compile.triton" in cpu.blockers


STREAM = "stream0 = get_raw_stream(0)"


@pytest.mark.parametrize(
    ("edit", "blocker"),
    [
        ((STREAM, "start_graph()\n            " + STREAM), "uses start_graph outside its imports"),
        ((STREAM, "tl.debug_barrier()\n            " + STREAM), "uses tl outside its imports"),
        (("import triton.language as tl\nfrom torch._inductor.runtime.triton_heuristics",
          "from triton import cdiv\nfrom torch._inductor.runtime.triton_heuristics"),
         "imports from triton"),
        (("async_compile.triton('triton_red__1',", "async_compile.triton(NAME,"),
         "creates a Triton kernel with no literal name"),
        (("async_compile.triton('triton_red__1',", "async_compile.triton('triton_per__0',"),
         "creates a Triton kernel name twice"),
    ],
)  # fmt: skip
def test_what_keeps_a_cuda_wrapper_off_the_lean_path(edit: tuple[str, str], blocker: str) -> None:
    old, new = edit
    # the module's executed part starts after its docstring (the compile-time autotune block)
    head, separator, tail = CUDA_WRAPPER.partition('\n"""\n')
    assert old in tail
    edited = head + separator + tail.replace(old, new, 1)
    assert blocker in scan_lean_source(edited, gpu=True).blockers


def _launch(**changes: Any) -> TritonLaunch:
    launch = TritonLaunch(
        name="triton_red__1",
        function="triton_red__1",
        binary=digest("cubin"),
        device=0,
        num_warps=4,
        shared=0,
        arg_types="OOiiOO",
        parameters=("in_ptr0", "out_ptr0", "xnumel", "r0_numel"),
        grid_prefix=(("y_grid_raw_", "-((xnumel) // -(32))"),),
        grid=("-((xnumel) // -(32))", "max(1, y_grid_raw_)", "1"),
        arguments=("in_ptr0", "out_ptr0", "xnumel", "r0_numel"),
        scratch=2,
    )
    return dataclasses.replace(launch, **changes)


def _manifest(launch: TritonLaunch) -> Manifest:
    lean = LeanCall(
        source=digest("source"),
        externs={"mm": "torch.ops.aten.mm.out"},
        outputs=2,
        triton=(launch,),
        align=(0, 1),
        realign=(1,),
    )
    variant = Variant(0, "hint", {"s0": 16}, (), digest("graph"), digest("code"), (), lean)
    return Manifest(
        environment=current_environment("cpu"),  # (a GPU build would say cuda)
        symbols=(Symbol("s0", (SymbolSource(0, 0),)),),
        inputs=(
            TensorInput("float32", "cuda:0", ("s0", 4)),
            TensorInput("float32", "cuda:0", (4,)),
        ),
        variants=(variant,),
    )


def test_triton_launches_round_trip_and_ship_their_binaries() -> None:
    manifest = _manifest(_launch())
    document = json.loads(json.dumps(manifest.to_json()))
    again = Manifest.from_json(document)
    assert again == manifest
    assert again.variants[0].lean is not None
    assert again.variants[0].lean.triton == (_launch(),)
    assert digest("cubin") in again.payload_digests  # written with the artifact, checked at load


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("grid", ["__import__('os').system('x')", "1", "1"], "expression"),
        ("grid", ["xnumel", "1"], "3 expressions"),
        ("grid_prefix", [["y", "open('f')"]], "expression"),
        ("grid_prefix", [["not an identifier", "1"]], "assigns no identifier"),
        ("arg_types", "OOiiZZ", "type codes"),
        ("arguments", ["in_ptr0", "out_ptr0", "xnumel", "secret"], "should be parameters"),
        ("arguments", ["in_ptr0"], "one per type code"),
        ("parameters", ["in_ptr0", "a-b"], "identifiers"),
        ("function", "x; import os", "no identifier"),
        ("binary", "../../etc/passwd", "binary"),
        ("device", -1, "device"),
        ("num_warps", 0, "num_warps"),
        ("scratch", 3, "scratch"),
    ],
)
def test_hostile_triton_launch_fields_are_corrupt_artifacts(
    field: str, value: Any, message: str
) -> None:
    document = json.loads(json.dumps(_manifest(_launch()).to_json()))
    document["variants"][0]["lean"]["triton"][0][field] = value
    with pytest.raises(CorruptArtifactError, match=message):
        Manifest.from_json(document)


def test_a_lean_call_with_unknown_or_inconsistent_fields_is_refused() -> None:
    document = json.loads(json.dumps(_manifest(_launch()).to_json()))
    lean = document["variants"][0]["lean"]
    lean["triton"][0]["extra"] = 1
    with pytest.raises(CorruptArtifactError, match="unexpected keys"):
        Manifest.from_json(document)
    del lean["triton"][0]["extra"]
    lean["triton"].append(dict(lean["triton"][0]))
    with pytest.raises(CorruptArtifactError, match="names a kernel twice"):
        Manifest.from_json(document)
    lean["triton"].pop()
    lean["realign"] = [0, 1]
    lean["align"] = [1]
    with pytest.raises(CorruptArtifactError, match="realign"):
        Manifest.from_json(document)


def test_the_launch_function_computes_the_grid_and_passes_scratch_pointers() -> None:
    source = launcher_source(_launch())
    calls: list[tuple[Any, ...]] = []
    namespace: dict[str, Any] = {
        "_launch": lambda *args: calls.append(args),
        "_function": 1234,
        "_num_warps": 4,
        "_shared": 0,
        "_arg_types": "OOiiOO",
        "max": max,
    }
    exec(compile(source, "<test>", "exec"), namespace)
    namespace["run"]("in", "out", 100, 16, stream=77)
    assert calls == [(1234, 4, 4, 1, 4, 0, "OOiiOO", ("in", "out", 100, 16, None, None), 77)]
    # parameters are renamed: a parameter named like the launcher's own names is harmless
    clash = _launch(
        parameters=("_launch", "out_ptr0", "xnumel", "r0_numel"),
        arguments=("_launch", "out_ptr0", "xnumel", "r0_numel"),
    )
    namespace2 = dict(namespace)
    exec(compile(launcher_source(clash), "<test>", "exec"), namespace2)
    namespace2["run"]("in", "out", 33, 16, stream=5)
    assert calls[-1] == (1234, 2, 2, 1, 4, 0, "OOiiOO", ("in", "out", 33, 16, None, None), 5)


@pytest.mark.parametrize(
    ("name", "path", "message"),
    [
        ("system", "torch.os.system", "not a torch module"),  # torch re-exports os
        ("loads", "torch.serialization.pickle.loads", "not a torch module"),
        ("load", "torch.load", "not a torch operator"),
        ("__builtins__", "torch.__builtins__", "not a torch operator"),
        ("addmm", "torch.sub", "another operator"),  # an operator, not the one named
    ],
)
def test_extern_kernels_name_operators_of_their_own_name_only(
    name: str, path: str, message: str
) -> None:
    """A lean call's ``extern_kernels`` come from the manifest: each must be the torch
    operator its name says, reached through torch's modules only."""
    from precompile.runtime._lean import _externs

    lean = LeanCall(source=digest("source"), externs={name: path}, outputs=1)
    with pytest.raises(CorruptArtifactError, match=message):
        _externs(lean)
    assert (
        _externs(dataclasses.replace(lean, externs={"addmm": "torch.addmm"}))["addmm"] is not None
    )
    mm = _externs(dataclasses.replace(lean, externs={"mm": "torch.ops.aten.mm.out"}))
    assert str(mm["mm"]) == "aten.mm.out"


def test_a_format_4_manifest_has_no_triton_fields_and_a_format_3_no_lean_call() -> None:
    document = json.loads(json.dumps(_manifest(_launch()).to_json()))
    document["format_version"] = 4
    with pytest.raises(
        CorruptArtifactError, match=r"unexpected keys \['align', 'realign', 'triton'\]"
    ):
        Manifest.from_json(document)
    document["format_version"] = 3
    with pytest.raises(CorruptArtifactError, match="which format 3 has not"):
        Manifest.from_json(document)
    document["format_version"] = 5
    del document["variants"][0]["lean"]["source"]
    with pytest.raises(CorruptArtifactError, match=r"missing keys \['source'\]"):
        Manifest.from_json(document)
