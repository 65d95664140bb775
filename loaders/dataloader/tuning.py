"""``num_workers="auto"`` and ``prefetch_depth="auto"`` of ``loaders.DataLoader``: the choices made from a
pass's measured rates (the rules themselves: :mod:`datapipe.device.autotune`)."""
from __future__ import annotations

import statistics
import time

from datapipe.device import autotune

__all__ = ["check_options", "check_workers", "workers_from_first_batches", "workers_for_iterable", "retune"]


def check_options(*, num_workers, prefetch_depth, max_workers) -> None:
    """``ValueError`` for a worker count, prefetch depth or worker cap the loader cannot take.

    A negative ``num_workers`` is left to torch's own check (its ValueError and words); a worker
    count that is not an int is a TypeError, as in torch."""
    if num_workers != "auto" and (not isinstance(num_workers, int) or isinstance(num_workers, bool)):
        raise TypeError(f"num_workers={num_workers!r}: pass an int >= 0 or 'auto'")
    if prefetch_depth != "auto" and (not isinstance(prefetch_depth, int)
                                     or isinstance(prefetch_depth, bool) or prefetch_depth < 1):
        raise ValueError(f"prefetch_depth={prefetch_depth!r}: pass an int >= 1 or 'auto'")
    if max_workers is not None and (not isinstance(max_workers, int) or max_workers < 1):
        raise ValueError(f"max_workers={max_workers!r}: pass an int >= 1 or None")


def check_workers(num_workers) -> int:
    """A worker count set on a built loader (``loader.num_workers = 4``, which torch's loader takes for its next
    pass): an int >= 0, else the error torch would give (``"auto"`` is for the constructor)."""
    if not isinstance(num_workers, int) or isinstance(num_workers, bool):
        raise TypeError(f"num_workers={num_workers!r}: set an int >= 0 (num_workers='auto' goes to the constructor)")
    if num_workers < 0:
        raise ValueError("num_workers option should be non-negative; use num_workers=0 to disable multiprocessing.")
    return num_workers


def workers_from_first_batches(times: list[float], stats, *, prefetch_factor: int, max_workers: int | None) -> dict:
    """Map-style: the worker count from the first batches' production times (``times``, made in the main
    process) and the consumer's pace so far (``stats``: the pass's ``Progress.stats``)."""
    produce = statistics.median(times[1:]) if len(times) > 1 else (times[0] if times else 0.0)
    consume = stats.consume_s / stats.consume_n if stats.consume_n else None
    return autotune.choose_num_workers(produce_s=produce, consume_s=consume, batch_bytes=stats.batch_bytes,
                                       prefetch_factor=prefetch_factor, max_workers=max_workers)


def workers_for_iterable(max_workers: int | None) -> dict:
    """Iterable dataset: start at the CPU/memory bound (the consumer's rate is unknown before training)."""
    d = autotune.choose_num_workers(produce_s=0.0, consume_s=None, batch_bytes=0, max_workers=max_workers)
    d["reason"] = "iterable dataset, consumer rate unknown before training: " + d["reason"]
    return d


def retune(stats, *, workers: int | None, workers_hi: int, depth: int, depth_hi: int,
           tune_depth: bool) -> tuple[dict | None, dict]:
    """After a pass (``stats``): ``(depth choice, adapt)``. The depth is chosen anew from the batch size
    when ``tune_depth`` and it is known (else None); :func:`datapipe.device.autotune.adapt` then grows
    ``workers`` (None: fixed) and the depth while the consumer kept waiting."""
    elapsed = (stats.ended or time.perf_counter()) - (stats.started or 0.0)
    choice = None
    if tune_depth and stats.batch_bytes:
        choice = autotune.choose_depth(batch_bytes=stats.batch_bytes, start=depth)
        depth, depth_hi = choice["value"], choice["bounds"][1]
    res = autotune.adapt(num_workers=workers, workers_hi=workers_hi, depth=depth if tune_depth else None,
                         depth_hi=depth_hi, batches=stats.yielded, elapsed_s=elapsed, wait_s=stats.wait_s)
    return choice, res
