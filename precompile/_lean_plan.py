"""``lean_plan``: whether a variant runs on the lean path (its generated ``call`` run
directly, no torch compiler imported), decided from what AOTAutograd and inductor wrap
around that call at load (``adapter.wrapping``) and from its source (``_lean_scan``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from precompile.runtime import LeanCall

from . import _torch_adapter as adapter
from ._lean_scan import BUILTIN_OP_NAMESPACES, scan_lean_source

_TRIVIAL_DISPATCH_WRAPPERS = frozenset(
    {"AOTDedupeWrapper", "AOTSyntheticBaseWrapper", "EffectTokensWrapper"}
)


def _extern_path(name: str) -> str | None:
    """Where ``extern_kernels.<name>`` of this process lives under torch, outside its
    compiler (``torch.addmm``, ``torch.ops.aten.mm.out``), or None."""
    value = adapter.extern_kernel(name)
    if value is None:
        return None
    candidates = [f"torch.{name}"]
    ops = adapter.op_path(value)
    if ops is not None:
        candidates.append(ops)
    for path in candidates:
        parts = path.split(".")
        if parts[1] == "ops" and parts[2] not in BUILTIN_OP_NAMESPACES:
            continue
        if not adapter.extern_path_names(name, path):
            continue  # a load refuses a path naming another operator than the name
        try:
            if adapter.resolve_torch_path(path) is value:
                return path
        except (AttributeError, ValueError, RuntimeError):
            continue
    return None


@dataclass(frozen=True)
class LeanPlan:
    """A variant's lean call (None where its wrapping is not provably trivial: then
    ``reasons`` say why) and the source it runs. ``triton_kernels``: the Triton kernels
    the source creates, whose launches must still be recorded (``lean.triton``) by running
    the variant before the lean call is complete."""

    lean: LeanCall | None
    source: str
    reasons: tuple[str, ...]
    triton_kernels: tuple[str, ...] = ()


def lean_plan(payload: bytes, source_digest: Callable[[str], str]) -> LeanPlan:
    """Decide whether a variant runs on the lean path: what AOTAutograd and inductor wrap
    around its generated ``call`` at load must be nothing, or only what ``LeanCall``
    replays (grad mode off during the call, outputs as a list of the expected length,
    version bumps of inputs the graph writes in place, Dynamo's dynamic-dim marks on
    outputs, autocast off where it was on at load). Read against torch 2.10 to 2.13's
    ``runtime_wrappers``, ``aot_autograd_result`` and ``output_code``: any wrapper or
    field not known to be a no-op here keeps the variant on upstream's path."""
    entry, _, _ = adapter.unpickle_bundle(payload)
    graph = adapter.forward_graph(entry)
    source = adapter.graph_source(graph)
    reasons: list[str] = []

    def require(condition: Any, reason: str) -> None:
        if not condition:
            reasons.append(reason)

    wrap = adapter.wrapping(entry, graph)
    require(wrap.entry_type == "BundledAOTAutogradResult", "not a bundled AOTAutograd entry")
    require(not wrap.has_backward, "it has a backward graph")
    require(not wrap.has_subclasses, "it has tensor subclasses")
    require(not wrap.activation_inputs, "it has activation inputs")
    require(not wrap.functionalizes_rng, "it functionalizes RNG state")
    require(not wrap.returns_rng_offset, "it returns an RNG offset")
    require(wrap.effect_tokens == 0, "it threads effect tokens")
    require(not wrap.writes_inputs_outside, "it writes inputs outside the graph")
    require(wrap.aliased_outputs == 0, "an output aliases an input or intermediate")
    require(wrap.intermediate_bases == 0, "it returns intermediate bases")
    require(not wrap.changes_grad_mode, "it changes grad mode")
    require(not wrap.writes_on_streams, "it writes inputs on user streams")
    for name, needs_post_compile in wrap.dispatch_wrappers:
        require(
            name in _TRIVIAL_DISPATCH_WRAPPERS and not needs_post_compile,
            f"its {name} wraps calls",
        )
    require(wrap.graph_type == "CompiledFxGraph", "its output is not a CompiledFxGraph")
    devices = set(wrap.device_types)
    gpu = "cuda" in devices
    require(devices <= {"cpu", "cuda"}, f"it runs on {sorted(devices - {'cpu', 'cuda'})}")
    require(
        not gpu or getattr(torch.version, "hip", None) is None,
        "it runs on ROCm (whose kernels take other launch arguments)",
    )
    require(
        not gpu or adapter.static_launcher_available(),
        "this torch has no static CUDA launcher",
    )
    require(not wrap.constants, "it carries constants")
    require(not wrap.torchbind_constants, "it carries torchbind constants")
    require(not wrap.wraps_regions, "its regions are wrapped")
    require(gpu or not wrap.bundles_triton, "it bundles Triton kernels")
    check = list(wrap.inputs_to_check)
    mutated = wrap.mutated_inputs
    if wrap.defers_input_alignment:
        check = [i for i in check if i in mutated]
    require(gpu or not check, "inductor realigns its inputs")
    scan = scan_lean_source(source, gpu=gpu)
    names = scan.externs
    reasons.extend(f"its code {b}" for b in scan.blockers)
    externs = {}
    for name in names:
        path = _extern_path(name)
        require(path is not None, f"extern kernel {name} is not a torch operator")
        if path is not None:
            externs[name] = path
    reasons.extend(adapter.lean_support_mismatches())
    if reasons:
        return LeanPlan(None, source, tuple(dict.fromkeys(reasons)))
    bumps = adapter.inference_version_bumps(entry)
    dims = adapter.output_dynamic_dims(entry)
    attribute = adapter.dynamic_dims_attribute() if dims else None
    if dims and attribute is None:
        return LeanPlan(None, source, ("this torch marks outputs' dynamic dims unrecognizably",))
    lean = LeanCall(
        source=source_digest(source),
        externs=externs,
        outputs=adapter.output_count(entry),
        bump_versions=bumps,
        dynamic_dims=dims,
        dynamic_attribute=attribute,
        align=tuple(int(i) for i in check),
        realign=tuple(int(i) for i in check if i in mutated),
    )
    return LeanPlan(lean, source, (), scan.triton_kernels)
