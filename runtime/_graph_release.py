"""``release_cuda_graphs``: every CUDA graph this process captured through precompile,
destroyed at once, so that ``torch.distributed.destroy_process_group()`` can return.

NCCL's communicator destroy waits until every CUDA graph that captured one of its
collectives is destroyed (its count of such graphs, ``localPersistentRefs``, drops only
when a graph is): a process whose compiled models still held graphs of NCCL all-reduces
hung in ``destroy_process_group()``. Holders of captured graphs (an artifact's per-size
executor, a compiled model's decode-step graphs) register here; releasing empties them,
and a later call captures again where CUDA graphs are still on.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol


class GraphHolder(Protocol):
    def release_graphs(self) -> int:
        """Destroy the graphs held; how many there were."""
        ...


_HOLDERS: weakref.WeakSet[GraphHolder] = weakref.WeakSet()
_LOCK = threading.Lock()


def register(holder: GraphHolder) -> None:
    with _LOCK:
        _HOLDERS.add(holder)


def release_cuda_graphs() -> int:
    """Destroy every CUDA graph captured through precompile in this process (artifacts',
    compiled models', ``generate``'s decode steps) and return how many. Later calls run
    plainly or capture again, as at their first call.

    Call it before ``torch.distributed.destroy_process_group()`` in a process whose graphs
    captured NCCL collectives: NCCL's destroy waits for each such graph to be destroyed."""
    with _LOCK:
        holders = list(_HOLDERS)
    released = sum(holder.release_graphs() for holder in holders)
    if released:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the graphs' destruction reaches the driver
    return released
