"""Describing this process's build and device, and deciding if an artifact can run here."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from functools import cache

import torch

from ._errors import IncompatibleArtifactError
from ._manifest import Environment


@cache
def triton_version() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


@cache
def _cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` would start a
    ``uname`` process: a serving process starts none), else the machine type."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.machine()


@cache
def current_environment(device: str) -> Environment:
    """The environment a graph compiled for ``device`` (a torch device string) would record."""
    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        capability = f"{major}.{minor}"
    else:
        name = _cpu_name()
        capability = _cpu_capability()
    return Environment(
        torch=torch.__version__,
        torch_git=str(getattr(torch.version, "git_version", "unknown")),
        cuda=getattr(torch.version, "cuda", None),
        triton=triton_version() if dev.type == "cuda" else None,
        python=platform.python_version(),
        platform=f"{sys.platform}-{platform.machine()}",
        device_type=dev.type,
        device_name=name,
        capability=capability,
    )


def check_compatible(recorded: Environment, where: str) -> None:
    """Refuse artifacts from another torch build or for a device kind this process lacks."""
    here_torch = (torch.__version__, str(getattr(torch.version, "git_version", "unknown")))
    if (recorded.torch, recorded.torch_git) != here_torch:
        raise IncompatibleArtifactError(
            f"{where} was built by torch {recorded.torch} (git {recorded.torch_git[:12]}), "
            f"but this process runs torch {here_torch[0]} (git {here_torch[1][:12]}); "
            "compiled code is only valid for the torch build that produced it: recompile"
        )
    if recorded.device_type == "cuda":
        if not torch.cuda.is_available():
            raise IncompatibleArtifactError(
                f"{where} was compiled for CUDA ({recorded.device_name}), "
                "but this process has no CUDA device"
            )
        here = current_environment("cuda")
        if here.capability != recorded.capability:
            raise IncompatibleArtifactError(
                f"{where} was compiled for compute capability {recorded.capability} "
                f"({recorded.device_name}); this GPU is {here.device_name} "
                f"(capability {here.capability})"
            )
        if here.triton != recorded.triton:
            raise IncompatibleArtifactError(
                f"{where} was compiled with triton {recorded.triton}, this process has "
                f"triton {here.triton}"
            )
