"""The one rank / world-size lookup."""
from __future__ import annotations

import os
from typing import Any


def rank_world(source: Any = None) -> tuple[int, int]:
    """``(rank, world_size)``: ``source``'s own, else torch.distributed's if initialised, else the
    ``RANK`` / ``WORLD_SIZE`` variables torchrun sets, else ``(0, 1)``.

    ``source``: a stream with ``rank`` / ``world_size`` settings (None: not set), or anything holding
    one (a loader's ``stream`` or ``dataset``, a mix's ``streams``: the first that sets them).
    """
    if source is not None:
        found = _own(source, depth=0)
        if found is not None:
            return found
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _own(source: Any, depth: int) -> tuple[int, int] | None:
    if depth > 4:
        return None
    world = getattr(source, "world_size", None)
    if world is not None and not callable(world) and getattr(source, "rank", None) is not None:
        return int(source.rank), int(world)
    for name in ("stream", "dataset"):
        inner = getattr(source, name, None)
        if inner is not None and inner is not source:
            found = _own(inner, depth + 1)
            if found is not None:
                return found
    for inner in getattr(source, "streams", None) or ():
        found = _own(inner, depth + 1)
        if found is not None:
            return found
    return None
