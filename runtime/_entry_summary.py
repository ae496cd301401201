"""What a cache entry the runtime wrote holds, in words a person reads (``cache ls``).

Read from what the entry already has: its document (a graph's manifest, or a compiled
model's manifest and plan), its key factors (the device), and the ``about`` its writer
recorded at save time (what the document lacks: a graph's name, a model's config).
Entries written before ``about`` was recorded, and documents this version cannot read,
still summarize: what cannot be known is None. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._errors import CorruptArtifactError, IncompatibleArtifactError
from ._manifest import InputSpec, IntInput, Manifest

# The document of a compiled model's entry says so (a graph's is its bare manifest).
MODEL_ENTRY = "precompile-model"
# Names in an entry's ``about`` (see ``ArtifactCache.put``).
ABOUT_GRAPH = "graph"  # what the graph was traced from (function, file, line) or its class
ABOUT_CONFIG = "config"  # a compiled model's config, in short
ABOUT_BLOCKS = "blocks"  # the repeated blocks compiled once (``4 x LlamaDecoderLayer ...``)

_DTYPES = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "bool": "b8",
}


@dataclass(frozen=True)
class EntrySummary:
    """One entry, for people. None: not known (not recorded, or not readable here)."""

    kind: str  # "graph", "model", or "unknown" (a document this version cannot read)
    name: str | None  # a graph's name (see ABOUT_GRAPH); a model's class
    config: str | None  # a model's config, in short
    blocks: str | None  # the repeated blocks compiled once, where any were
    inputs: tuple[str, ...] | None  # the graph's flat inputs: "f32[s0, 256]", "s0", ...
    hints: tuple[Mapping[str, int], ...] | None  # each hint variant's point
    sizes: tuple[Mapping[str, int], ...] | None  # each exact-size variant's sizes
    device: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "config": self.config,
            "blocks": self.blocks,
            "inputs": None if self.inputs is None else list(self.inputs),
            "hints": None if self.hints is None else [dict(p) for p in self.hints],
            "sizes": None if self.sizes is None else [dict(p) for p in self.sizes],
            "device": self.device,
        }


def input_text(spec: InputSpec) -> str:
    """``f32[s0, 256]`` for a tensor input, its symbol (or value) for an int input."""
    if isinstance(spec, IntInput):
        return str(spec.value)
    dims = ", ".join(str(d) for d in spec.shape)
    return f"{_DTYPES.get(spec.dtype, spec.dtype)}[{dims}]"


def summarize_entry(
    document: Any, factors: Mapping[str, str], about: Mapping[str, str]
) -> EntrySummary:
    """The summary of an entry's ``document`` (None where it could not be read)."""
    is_model = isinstance(document, dict) and document.get("kind") == MODEL_ENTRY
    plan = document.get("model") if is_model else None
    manifest = _manifest(document.get("manifest") if is_model else document)
    if is_model:
        recorded = plan.get("model_class") if isinstance(plan, dict) else None
        name = recorded if isinstance(recorded, str) else factors.get("model_class")
    else:
        name = about.get(ABOUT_GRAPH)
    kind = "model" if is_model else "graph" if manifest is not None else "unknown"
    return EntrySummary(
        kind=kind,
        name=name,
        config=about.get(ABOUT_CONFIG) if is_model else None,
        blocks=about.get(ABOUT_BLOCKS),
        inputs=None if manifest is None else tuple(input_text(i) for i in manifest.inputs),
        hints=None if manifest is None else _points(manifest, "hint"),
        sizes=None
        if manifest is None
        else _points(manifest, "static") + _traced_apart(manifest, plan),
        device=factors.get("device"),
    )


def _traced_apart(manifest: Manifest, plan: Any) -> tuple[Mapping[str, int], ...]:
    """A compiled model's traces at lengths of 1 (its pieces), as points of the graph's
    own symbols: ``{"s81": 1}`` for the decode trace of a model whose length is s81."""
    if not isinstance(plan, dict):
        return ()
    lengths, pieces, bindings = plan.get("lengths"), plan.get("pieces"), plan.get("bindings")
    if not (isinstance(lengths, list) and isinstance(pieces, list) and isinstance(bindings, list)):
        return ()
    names: list[str | None] = []
    for place in lengths:
        names.append(next(
            (symbol.name for symbol in manifest.symbols for src in symbol.sources
             if isinstance(place, list) and len(place) == 2 and src.dim == place[1]
             and 0 <= src.input_index < len(bindings)
             and bindings[src.input_index] == ["leaf", place[0]]),
            None,
        ))  # fmt: skip
    points = []
    for piece in pieces:
        ones = piece.get("ones") if isinstance(piece, dict) else None
        if isinstance(ones, list) and all(
            type(i) is int and 0 <= i < len(names) and names[i] for i in ones
        ):
            points.append({str(names[i]): 1 for i in ones})
    return tuple(points)


def _manifest(document: Any) -> Manifest | None:
    if document is None:
        return None
    try:
        return Manifest.from_json(document)
    except (CorruptArtifactError, IncompatibleArtifactError):
        return None  # another format version, or not a manifest: shown as unknown


def _points(manifest: Manifest, kind: str) -> tuple[Mapping[str, int], ...]:
    """The points of the variants of ``kind``; a graph with no dynamic dim has none (its
    one variant's point is empty: listed as static)."""
    return tuple(dict(v.point) for v in manifest.variants if v.kind == kind and v.point)
