"""Pick worker count and prefetch depth from measured rates, within CPU and memory bounds.

Pure functions: the loader measures, these decide and log (logger ``datapipe.device.autotune``) what they
chose and why. Every decision is a dict ``{"value": n, "bounds": [lo, hi], "reason": str, ...}``.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any

logger = logging.getLogger("datapipe.device.autotune")

__all__ = ["usable_cores", "available_memory", "batch_nbytes", "choose_num_workers", "choose_depth",
           "adapt"]

WAIT_THRESHOLD = 0.05  # consumer waiting more than this fraction of wall time -> grow at the epoch boundary


def usable_cores() -> int:
    """Cores this process may use (affinity-aware), at least 1: the one core count of the project."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, n)


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def batch_nbytes(batch: Any) -> int:
    """Bytes held by the tensors / numpy arrays / bytes leaves of a nested batch."""
    if hasattr(batch, "element_size") and hasattr(batch, "numel"):
        return int(batch.element_size() * batch.numel())
    if hasattr(batch, "nbytes") and not isinstance(batch, type):
        try:
            return int(batch.nbytes)
        except TypeError:
            return 0
    if isinstance(batch, (bytes, bytearray)):
        return len(batch)
    if isinstance(batch, dict):
        return sum(batch_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_nbytes(v) for v in batch)
    fields = getattr(batch, "__dataclass_fields__", None)
    if fields:
        return sum(batch_nbytes(getattr(batch, k)) for k in fields)
    return 0


def _clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


def choose_num_workers(*, produce_s: float, consume_s: float | None, batch_bytes: int,
                       prefetch_factor: int = 2, max_workers: int | None = None,
                       available_bytes: int | None = None, memory_fraction: float = 0.5,
                       worker_overhead_bytes: int = 256 << 20, headroom: float = 1.25) -> dict:
    """Workers needed so that production keeps up with the consumer, within CPU and memory bounds.

    ``produce_s``: seconds one worker needs per batch; ``consume_s``: consumer seconds per batch
    (None: unknown, use the upper bound). Upper bound: cores minus one for the main process, and
    ``memory_fraction`` of available memory divided by what a worker holds (its overhead plus
    ``prefetch_factor + 1`` batches).
    """
    cpu_hi = max(1, usable_cores() - 1) if max_workers is None else max(1, max_workers)
    mem_hi = cpu_hi
    per_worker = worker_overhead_bytes + (prefetch_factor + 1) * max(0, batch_bytes)
    if available_bytes is None:
        available_bytes = available_memory()
    if available_bytes is not None and per_worker > 0:
        mem_hi = max(1, int(available_bytes * memory_fraction // per_worker))
    hi = min(cpu_hi, mem_hi)
    if consume_s is None or consume_s <= 0:
        need = hi
        why = "consumer step time unknown or ~0: using the upper bound"
    else:
        need = math.ceil(headroom * produce_s / consume_s)
        why = (f"one worker makes a batch in {produce_s * 1e3:.1f} ms, the consumer takes "
               f"{consume_s * 1e3:.1f} ms per batch -> ceil({headroom} x ratio) = {need}")
    value = _clamp(need, 1, hi)
    decision = {"value": value, "bounds": [1, hi], "cpu_bound": cpu_hi, "memory_bound": mem_hi,
                "produce_s": produce_s, "consume_s": consume_s, "batch_bytes": batch_bytes,
                "reason": f"{why}; bounds [1, {hi}] (cpu {cpu_hi}, memory {mem_hi})"}
    logger.info("num_workers=%d: %s", value, decision["reason"])
    return decision


def choose_depth(*, batch_bytes: int, available_bytes: int | None = None, start: int = 2,
                 max_depth: int = 8, memory_fraction: float = 0.1) -> dict:
    """Initial device prefetch depth: ``start``, capped so depth x batch fits the memory fraction."""
    if available_bytes is None:
        available_bytes = available_memory()
    hi = max_depth
    if available_bytes is not None and batch_bytes > 0:
        hi = _clamp(int(available_bytes * memory_fraction // batch_bytes), 1, max_depth)
    value = _clamp(start, 1, hi)
    decision = {"value": value, "bounds": [1, hi], "batch_bytes": batch_bytes,
                "reason": f"start at {start}; bounds [1, {hi}] ({memory_fraction:.0%} of available "
                          f"memory / {batch_bytes} B per batch, at most {max_depth})"}
    logger.info("prefetch_depth=%d: %s", value, decision["reason"])
    return decision


def adapt(*, num_workers: int | None, workers_hi: int, depth: int | None, depth_hi: int,
          batches: int, elapsed_s: float, wait_s: float, headroom: float = 1.25) -> dict:
    """Epoch-boundary adjustment: grow workers (and depth) when the consumer kept waiting.

    With ``W`` workers the loader delivered a batch every ``elapsed/batches`` s while the consumer
    needed ``(elapsed - wait)/batches`` s: one worker takes about ``W x elapsed/batches`` s per
    batch, so ``ceil(headroom x that / consumer time)`` workers are needed. Never shrinks; None
    means "not autotuned" and is left alone.
    """
    out = {"num_workers": num_workers, "prefetch_depth": depth, "reason": "no data"}
    if batches <= 0 or elapsed_s <= 0:
        return out
    wait_fraction = wait_s / elapsed_s
    if wait_fraction <= WAIT_THRESHOLD:
        out["reason"] = f"consumer waited {wait_fraction:.1%} <= {WAIT_THRESHOLD:.0%} of the time: keep"
        return out
    reasons = []
    if num_workers is not None:
        per_batch = elapsed_s / batches
        consume = max((elapsed_s - wait_s) / batches, 1e-9)
        need = math.ceil(headroom * max(num_workers, 1) * per_batch / consume)
        new = _clamp(max(need, num_workers + 1), num_workers, max(workers_hi, num_workers))
        reasons.append(f"num_workers {num_workers}->{new} (need ~{need}, bound {workers_hi})")
        out["num_workers"] = new
    if depth is not None:
        new_depth = _clamp(depth * 2, depth, max(depth_hi, depth))
        reasons.append(f"prefetch_depth {depth}->{new_depth} (bound {depth_hi})")
        out["prefetch_depth"] = new_depth
    out["reason"] = f"consumer waited {wait_fraction:.1%} of the time: " + "; ".join(reasons)
    logger.info("adapt: %s", out["reason"])
    return out
