"""How a manifest names dtypes and devices: one encoding, both directions."""

from __future__ import annotations

import torch

from ._errors import CorruptArtifactError


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (what manifests and messages say)."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise CorruptArtifactError(f"manifest names unknown dtype {name!r}")
    return value


def device_of(name: str) -> torch.device:
    try:
        return torch.device(name)
    except (RuntimeError, ValueError):
        raise CorruptArtifactError(f"manifest names unknown device {name!r}") from None
