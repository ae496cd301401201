"""Tensor arguments the compiled graph does not take, held to what the trace saw of them.

Dynamo leaves an argument out of the graph when no op uses its values, yet the forward
may still have read it: its dtype, its sizes against another argument's (``a.shape[0] ==
b.shape[0]``), its layout (``is_contiguous()``). Dynamo's tensor guard checks such an
argument on every call; the artifact's input contract never sees it. So a compiled model
checks each one per call as that guard does (a probe found two such forwards served the
traced branch: 2.2 off eager for another dtype, 2.0 for another size): dtype, device
type, ``requires_grad``, rank, each size (the traced one, or, for a dim the call made
dynamic whose traced size a graph argument's dynamic dim shared, that dim's: Dynamo gave
them one symbol) and whether it is contiguous (and channels-last, at rank 4).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._dtypes import dtype_name
from ._errors import CorruptArtifactError

Size = int | tuple[int, int]  # the traced size, or the (leaf, dim) whose size it equals


@dataclass(frozen=True)
class UnboundTensor:
    dtype: str
    device_type: str
    requires_grad: bool
    sizes: tuple[Size, ...]
    contiguous: tuple[bool, bool]  # is_contiguous(), is_contiguous(channels_last)

    @staticmethod
    def of(tensor: torch.Tensor, tied: Mapping[int, tuple[int, int]]) -> UnboundTensor:
        """``tensor`` as traced; ``tied``: its dims whose size is another leaf's dim."""
        sizes: list[Size] = [tied.get(dim, int(size)) for dim, size in enumerate(tensor.shape)]
        return UnboundTensor(
            dtype_name(tensor.dtype), tensor.device.type, tensor.requires_grad, tuple(sizes),
            _contiguity(tensor),
        )  # fmt: skip

    def failure(self, value: Any, leaves: Sequence[Any]) -> str | None:
        """What of ``value`` differs from the traced tensor, or None."""
        if not isinstance(value, torch.Tensor):
            return f"is a {type(value).__name__}, traced as a tensor"
        if dtype_name(value.dtype) != self.dtype:
            return f"has dtype {dtype_name(value.dtype)}, traced as {self.dtype}"
        if value.device.type != self.device_type:
            return f"is on {value.device.type}, traced on {self.device_type}"
        if value.requires_grad is not self.requires_grad:
            return f"has requires_grad={value.requires_grad}, traced with {self.requires_grad}"
        if value.dim() != len(self.sizes):
            return f"has rank {value.dim()}, traced with rank {len(self.sizes)}"
        for dim, size in enumerate(self.sizes):
            if isinstance(size, tuple):
                other = leaves[size[0]]
                if not isinstance(other, torch.Tensor) or other.dim() <= size[1]:
                    return f"dim {dim} was traced equal to argument leaf {size[0]}'s dim {size[1]}"
                expected = int(other.shape[size[1]])
                said = f"{expected} (argument leaf {size[0]} dim {size[1]}, traced equal)"
            else:
                expected, said = size, str(size)
            if int(value.shape[dim]) != expected:
                return f"has size {int(value.shape[dim])} in dim {dim}, traced with {said}"
        if _contiguity(value) != self.contiguous:
            return (
                f"is {'' if value.is_contiguous() else 'not '}contiguous (channels-last: "
                f"{_contiguity(value)[1]}), traced as {self.contiguous[0]} ({self.contiguous[1]})"
            )
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "device_type": self.device_type,
            "requires_grad": self.requires_grad,
            "sizes": [list(s) if isinstance(s, tuple) else s for s in self.sizes],
            "contiguous": list(self.contiguous),
        }

    @staticmethod
    def from_json(value: Any, where: str) -> UnboundTensor:
        if not isinstance(value, dict):
            raise CorruptArtifactError(f"{where} is malformed")
        sizes: list[Size] = []
        raw = value.get("sizes")
        if not isinstance(raw, list) or len(raw) > 64:
            raise CorruptArtifactError(f"{where} field sizes is malformed")
        for size in raw:
            if type(size) is int and size >= 0:
                sizes.append(size)
            elif (
                isinstance(size, list)
                and len(size) == 2
                and all(type(i) is int and i >= 0 for i in size)
            ):
                sizes.append((size[0], size[1]))
            else:
                raise CorruptArtifactError(f"{where} field sizes is malformed")
        contiguous = value.get("contiguous")
        fields_ok = (
            isinstance(value.get("dtype"), str)
            and len(value["dtype"]) < 64
            and isinstance(value.get("device_type"), str)
            and len(value["device_type"]) < 64
            and isinstance(value.get("requires_grad"), bool)
            and isinstance(contiguous, list)
            and len(contiguous) == 2
            and all(isinstance(c, bool) for c in contiguous)
        )
        if not fields_ok:
            raise CorruptArtifactError(f"{where} is malformed")
        assert isinstance(contiguous, list)
        return UnboundTensor(
            value["dtype"], value["device_type"], value["requires_grad"], tuple(sizes),
            (contiguous[0], contiguous[1]),
        )  # fmt: skip


def _contiguity(tensor: torch.Tensor) -> tuple[bool, bool]:
    channels_last = tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last)
    return tensor.is_contiguous(), channels_last
