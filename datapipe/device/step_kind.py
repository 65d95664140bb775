"""Which training step this thread runs: ``"CUDA graphs"``, ``"compiled"`` or ``"eager"`` (the doctor reports it;
ImageLoader's decoder choice reads it before moving to the hardware decoder).

Read from torch's own state, without importing anything torch has not imported itself: a CUDA-graph tree
manager (``torch.compile(mode="reduce-overhead")``) means CUDA graphs; graphs captured by ``torch.compile``
(dynamo's ``unique_graphs`` counter) mean compiled; otherwise eager. A step that captures a
``torch.cuda.CUDAGraph`` by hand reads as eager.

Both are left behind once made: a process that ran CUDA graphs and then an eager step would read "CUDA graphs"
forever. :func:`graph_marks` notes where this thread's graph trees are (the compiled call each last ran a graph
in); ``step_kind(since=mark)`` reads "CUDA graphs" only if a graph ran after that mark.
"""
from __future__ import annotations

import sys

__all__ = ["STEP_KINDS", "graph_marks", "step_kind"]

STEP_KINDS = ("eager", "compiled", "CUDA graphs")


def _managers(modules) -> list:
    """This thread's CUDA graph tree managers, one per device that has one."""
    trees = modules.get("torch._inductor.cudagraph_trees")
    torch = modules.get("torch")
    if trees is None or torch is None:
        return []
    try:
        count = torch.cuda.device_count() if torch.cuda.is_initialized() else 0
        found = (trees.get_manager(i, create_if_none_exists=False) for i in range(count))
        return [m for m in found if m is not None]
    except Exception:  # another torch's internals: not seen
        return []


def graph_marks(modules=None) -> tuple:
    """Where this thread's CUDA graph trees stand: ``(id, last graph's generation)`` per manager (the generation
    is torch.compile's call counter as of the manager's last recorded or replayed graph; None where this torch
    does not say)."""
    modules = sys.modules if modules is None else modules
    return tuple((id(m), getattr(m, "current_gen", None)) for m in _managers(modules))


def _graphs_ran(modules, since) -> bool:
    marks = graph_marks(modules)
    if not marks:
        return False
    if since is None:
        return True
    # a manager that is new, or whose last graph ran at another generation; one that cannot say counts as running
    return any(mark[1] is None or mark not in since for mark in marks)


def _compiled(modules) -> bool:
    utils = modules.get("torch._dynamo.utils")
    try:
        return utils is not None and utils.counters["stats"]["unique_graphs"] > 0
    except Exception:
        return False


def step_kind(modules=None, *, since: tuple | None = None) -> str:
    """What this process's step ran as, so far (call it in the training thread: CUDA graph trees are per thread).
    ``since``: a :func:`graph_marks` taken earlier in this thread: CUDA graphs only if a graph ran after it.
    ``modules``: ``sys.modules`` (tests pass their own)."""
    modules = sys.modules if modules is None else modules
    if _graphs_ran(modules, since):
        return "CUDA graphs"
    return "compiled" if _compiled(modules) else "eager"
