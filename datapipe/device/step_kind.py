"""Which training step this thread runs: ``"CUDA graphs"``, ``"compiled"`` or ``"eager"`` (the doctor reports it;
ImageLoader's decoder choice reads it before moving to the hardware decoder).

Read from torch's own state, without importing anything torch has not imported itself: a CUDA-graph tree
manager (``torch.compile(mode="reduce-overhead")``) means CUDA graphs; graphs captured by ``torch.compile``
(dynamo's ``unique_graphs`` counter) mean compiled; otherwise eager. A step that captures a
``torch.cuda.CUDAGraph`` by hand reads as eager.
"""
from __future__ import annotations

import sys

__all__ = ["STEP_KINDS", "step_kind"]

STEP_KINDS = ("eager", "compiled", "CUDA graphs")


def _graph_trees(modules) -> bool:
    trees = modules.get("torch._inductor.cudagraph_trees")
    torch = modules.get("torch")
    if trees is None or torch is None:
        return False
    try:
        count = torch.cuda.device_count() if torch.cuda.is_initialized() else 0
        return any(trees.get_manager(i, create_if_none_exists=False) is not None for i in range(count))
    except Exception:  # another torch's internals: not seen
        return False


def _compiled(modules) -> bool:
    utils = modules.get("torch._dynamo.utils")
    try:
        return utils is not None and utils.counters["stats"]["unique_graphs"] > 0
    except Exception:
        return False


def step_kind(modules=None) -> str:
    """What this process's step ran as, so far (call it in the training thread: CUDA graph trees are per thread).
    ``modules``: ``sys.modules`` (tests pass their own)."""
    modules = sys.modules if modules is None else modules
    if _graph_trees(modules):
        return "CUDA graphs"
    return "compiled" if _compiled(modules) else "eager"
