"""An artifact compiled on one CUDA device, served on another of the same kind.

Inductor's generated code names its device index (``torch.cuda._DeviceGuard(0)``,
``get_raw_stream(0)``, ``device(type='cuda', index=0)``), and a Triton kernel loads onto
the device its launch names; the kernels' binaries are the same for every device of one
GPU model. So a lean variant moves to another index by rewriting exactly those places:
its wrapper's source (read with ``ast``, never run here) and its launches' device.

Anything else in the source that could name a device (a ``torch.cuda`` call other than
the guard and ``set_device``, an integer device, a device call of another form) refuses
the move, as does a variant with no lean call (its code is inductor's pickled wrapping,
compiled for the first device): a rank then compiles its own.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Callable

from ._manifest import LeanCall, Manifest, TensorInput

# calls taking the device index as their one argument (the last name of their path)
_INDEX_CALLS = frozenset({"_DeviceGuard", "set_device", "get_raw_stream"})
_CUDA_STRING = re.compile(r"cuda:(\d+)")


class RelocationRefused(ValueError):
    """Why an artifact cannot move to another device index (said in the caller's error)."""


def dotted_name(node: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain rooted at a name, else None (the lean scan of the
    compile side reads wrapper sources with it too)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _int_constant(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def relocate_source(source: str, old: int, new: int) -> str:
    """``source`` with every place that names device ``old`` naming ``new``; raises
    ``RelocationRefused`` where it names another device or names one in a way not read
    here. Kernel sources (strings handed to ``async_compile.triton``) are left as they
    are: the lean path launches binaries and never compiles them."""
    tree = ast.parse(source)
    edits: list[tuple[int, int, int, int, str]] = []  # (line, col, end line, end col, text)

    def replace(node: ast.AST, text: str) -> None:
        assert isinstance(node, ast.expr)
        end_line = node.end_lineno or node.lineno
        edits.append((node.lineno, node.col_offset, end_line, node.end_col_offset or 0, text))

    def index(node: ast.AST, where: str) -> None:
        value = _int_constant(node)
        if value is None:
            raise RelocationRefused(f"{where} takes a device that is not a literal index")
        if value != old:
            raise RelocationRefused(f"{where} names device {value}, not the artifact's {old}")
        replace(node, str(new))

    kernel_sources: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and dotted_name(node.func) == "async_compile.triton":
            kernel_sources.update(id(a) for a in node.args[1:2])
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            path = dotted_name(node.func) or ""
            last = path.rpartition(".")[2]
            if last in _INDEX_CALLS:
                if len(node.args) != 1 or node.keywords:
                    raise RelocationRefused(f"{path} is called with other arguments than an index")
                index(node.args[0], path)
            elif path in ("device", "torch.device"):
                keywords = {k.arg: k.value for k in node.keywords}
                kind = keywords.get("type", node.args[0] if node.args else None)
                if not (isinstance(kind, ast.Constant) and kind.value in ("cuda", "cpu")):
                    raise RelocationRefused(f"{path}(...) of a device type not read here")
                at = keywords.get("index", node.args[1] if len(node.args) > 1 else None)
                if kind.value == "cuda" and at is not None:
                    index(at, f"{path}(...)")
            elif path.startswith("torch.cuda."):  # (the guard and set_device: above)
                raise RelocationRefused(f"the code calls {path}")
            elif (
                isinstance(node.func, ast.Attribute)
                and node.func.attr in ("cuda", "to")
                and any(_int_constant(a) is not None for a in node.args)
            ):
                raise RelocationRefused(f".{node.func.attr}(<index>) in the code")
            for keyword in node.keywords:
                if keyword.arg == "device" and _int_constant(keyword.value) is not None:
                    raise RelocationRefused("a device given as an integer in the code")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in kernel_sources
        ):
            # a device as a string is the whole string ('cuda:0'); one inside a longer
            # string is text (inductor's autotune-at-compile code, kept as a string)
            match = _CUDA_STRING.fullmatch(node.value)
            if match is not None:
                if int(match.group(1)) != old:
                    raise RelocationRefused(f"the code names 'cuda:{match.group(1)}'")
                replace(node, repr(f"cuda:{new}"))
    lines = source.splitlines(keepends=True)
    for line, col, end_line, end_col, text in sorted(edits, reverse=True):
        if line != end_line:
            raise RelocationRefused("a device index spans lines")
        row = lines[line - 1]
        # ast's offsets count UTF-8 bytes
        raw = row.encode("utf-8")
        lines[line - 1] = (raw[:col] + text.encode("utf-8") + raw[end_col:]).decode("utf-8")
    return "".join(lines)


def artifact_device_index(manifest: Manifest) -> int:
    """The one CUDA device index every tensor input of ``manifest`` is on."""
    devices = {s.device for s in manifest.inputs if isinstance(s, TensorInput)}
    indices = {int(d.partition(":")[2] or -1) for d in devices if d.startswith("cuda")}
    if manifest.environment.device_type != "cuda" or len(devices) != 1 or len(indices) != 1:
        raise RelocationRefused(
            f"it is not compiled for one CUDA device (its inputs are on {sorted(devices)})"
        )
    (found,) = indices
    if found < 0:
        raise RelocationRefused("its inputs name no device index")
    return found


def relocate(
    manifest: Manifest, read: Callable[[str], bytes], new: int, digest: Callable[[str], str]
) -> tuple[Manifest, dict[str, bytes]]:
    """``manifest`` moved to CUDA device ``new``, and the new payloads (the rewritten
    sources) it names beside the old ones. ``read`` gives a payload's bytes."""
    old = artifact_device_index(manifest)
    sources: dict[str, bytes] = {}
    variants = []
    for variant in manifest.variants:
        lean = variant.lean
        if lean is None:
            raise RelocationRefused(
                f"variant {variant.index} has no lean call (inductor's own wrapping, "
                f"compiled for cuda:{old})"
            )
        text = relocate_source(read(lean.source).decode("utf-8"), old, new)
        sources[digest(text)] = text.encode("utf-8")
        moved: LeanCall = dataclasses.replace(
            lean,
            source=digest(text),
            triton=tuple(dataclasses.replace(t, device=new) for t in lean.triton),
        )
        variants.append(dataclasses.replace(variant, lean=moved))
    inputs = tuple(
        dataclasses.replace(s, device=f"cuda:{new}") if isinstance(s, TensorInput) else s
        for s in manifest.inputs
    )
    return dataclasses.replace(manifest, inputs=inputs, variants=tuple(variants)), sources


def move_refusal(manifest: Manifest, read: Callable[[str], bytes]) -> str | None:
    """Why ``manifest`` cannot move to another device index, or None where it can (the
    compile side stores such a graph once for every device of its GPU model)."""
    try:
        old = artifact_device_index(manifest)
        relocate(manifest, read, old + 1, lambda text: text)
    except RelocationRefused as exc:
        return str(exc)
    return None
