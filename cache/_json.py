"""JSON from files no reader trusts: every defect is a ``CorruptArtifactError`` naming
where the bytes came from (cache entries, artifact indexes and manifests alike)."""

from __future__ import annotations

import json
from typing import Any

from ._errors import CorruptArtifactError


def decode_json(raw: bytes, where: str) -> Any:
    """Parse JSON bytes from a file; malformed, non-UTF-8 or absurdly nested input is a
    CorruptArtifactError (never a RecursionError or UnicodeDecodeError)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptArtifactError(f"{where} is not UTF-8: {exc}") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise CorruptArtifactError(f"{where} is not valid JSON: {str(exc)[:200]}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
