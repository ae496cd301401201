"""The process groups a graph's collectives run over, described when compiling and
checked before a loaded graph runs.

A traced ``torch.distributed._functional_collectives`` call names its group by a string
(``all_reduce(x, "sum", "0")``): the name torch registered the group under in the
compiling process, which is the order groups were created in ("0" for the default
group, then "1", "2"...). The compiled code resolves that name again at every call. So a
process that runs the graph must have registered a group under the same name, of the
same size, backend and members; else the collective fails deep in generated code, or
sums over other ranks than were compiled for, or waits for ranks that never come.
The check runs in this process alone (no collective), before any of the graph's
collectives does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from . import _torch_adapter as adapter
from ._errors import IncompatibleArtifactError, UnsupportedGraphError
from ._manifest import ProcessGroupSpec

log = logging.getLogger("precompile.runtime")


def describe_group(name: str) -> ProcessGroupSpec | None:
    """The group registered under ``name`` here, or None if there is none."""
    import torch.distributed as dist

    group = adapter.resolve_process_group(name)
    if group is None:
        return None
    return ProcessGroupSpec(
        name=name,
        size=int(dist.get_world_size(group)),
        backend=str(dist.get_backend(group)),
        ranks=tuple(int(r) for r in dist.get_process_group_ranks(group)),
    )


def describe_groups(
    names: Sequence[str], opaque: Sequence[str] = ()
) -> tuple[ProcessGroupSpec, ...]:
    """The groups a graph being compiled names; each must exist in the compiling process.

    ``opaque``: the graph's other collectives, a framework's own ops that name groups of
    its own registry (vLLM's ``vllm::all_reduce(x, group_name="tp:0")``), which this
    library cannot resolve. For those the default group stands in: the world the graph
    was compiled in, so that a world of another size or backend is a miss or a refusal.
    """
    wanted = set(names)
    if opaque:
        world = default_group_name()
        if world is None:
            log.debug("collectives %s outside torch.distributed: keyed by nothing", opaque)
        else:
            wanted.add(world)
    found = []
    for name in sorted(wanted):
        spec = describe_group(name)
        if spec is None:
            raise UnsupportedGraphError(
                f"the graph runs collectives over process group {name!r}, which is not "
                "registered in this process (torch.distributed.init_process_group first)"
            )
        found.append(spec)
    return tuple(found)


def default_group_name() -> str | None:
    """The name the default group is registered under here, or None outside
    torch.distributed."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return str(dist.group.WORLD.group_name)


def registered_groups() -> tuple[ProcessGroupSpec, ...]:
    """Every group registered in this process, by name: what a graph traced here can name
    (the layout a process made, in the order it made it)."""
    found = (describe_group(name) for name in adapter.process_group_names())
    return tuple(spec for spec in found if spec is not None)


def _said(spec: ProcessGroupSpec) -> str:
    return f"{spec.size} ranks {list(spec.ranks)} ({spec.backend})"


def check_groups(specs: Sequence[ProcessGroupSpec], where: str) -> None:
    """Refuse to run a graph whose groups this process does not have as compiled."""
    for spec in specs:
        here = describe_group(spec.name)
        if here is None:
            raise IncompatibleArtifactError(
                f"{where} runs collectives over process group {spec.name!r} of {_said(spec)}, "
                "but no group is registered under that name in this process (a rank "
                "outside a group does not register it): call "
                "torch.distributed.init_process_group (and create further groups in the "
                "order the compiling processes did) before calling it"
            )
        if here != spec:
            raise IncompatibleArtifactError(
                f"{where} was compiled for process group {spec.name!r} of {_said(spec)}, "
                f"but here that group has {_said(here)}; compile it for this world size "
                "and group layout"
            )


def this_rank() -> tuple[int, int, str] | None:
    """(rank, world size, backend) of this process's default group, or None outside
    torch.distributed."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return int(dist.get_rank()), int(dist.get_world_size()), str(dist.get_backend())
