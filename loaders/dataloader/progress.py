"""One pass of a ``loaders.DataLoader``: its position, its timing, and the ``stats()`` built from them."""
from __future__ import annotations

import math
import time
from collections.abc import Mapping

import torch

from datapipe.device import autotune
from datapipe.device.prefetch import first_tensor
from loaders.dataloader.resume import RngRecord
from loaders.dataloader.workers import WorkerStates

__all__ = ["Progress", "PassStats", "count_samples", "stats"]


class PassStats:
    """Throughput and data-wait of one pass, measured on the consumer side of ``next()``."""

    def __init__(self):
        self.yielded = 0  # batches handed out by this run of the pass
        self.samples = 0
        self.batch_bytes = 0  # of the first batch
        self.started: float | None = None
        self.ended: float | None = None
        self.wait_s = 0.0  # in next(), waiting for data
        self.consume_s = 0.0  # between next() calls, in the training step
        self.consume_n = 0
        self._last: float | None = None  # when the latest batch was handed out

    def asked(self) -> float:
        """``next()`` was called: the consumer's step since the latest batch ends; returns the time."""
        t0 = time.perf_counter()
        if self.started is None:
            self.started = t0
        if self._last is not None:
            self.consume_s += t0 - self._last
            self.consume_n += 1
        return t0

    def got(self, t0: float) -> None:
        """A batch (or a batch's error) arrived for the ``next()`` called at ``t0``."""
        self.wait_s += time.perf_counter() - t0
        self._last = time.perf_counter()

    def over(self, t0: float) -> None:
        """The pass ended (exhausted or broken) in the ``next()`` called at ``t0``."""
        self.wait_s += time.perf_counter() - t0
        self.ended = time.perf_counter()

    def delivered(self, batch, samples: int) -> None:
        """``batch`` of ``samples`` samples is handed out."""
        self.yielded += 1
        self.samples += samples
        if self.yielded == 1:
            self.batch_bytes = autotune.batch_nbytes(batch)

    def elapsed(self) -> float:
        return (self.ended if self.ended is not None else time.perf_counter()) - self.started


class Progress:
    """One pass: where it is (``epoch``, ``batches``, ``finished``) and its bookkeeping: ``stats``
    (:class:`PassStats`), ``workers`` (the worker-state protocol's merge), ``rng`` (what a resume
    replays) and ``gate`` (an :class:`~loaders.dataloader.end_gate.EndGate`, or None)."""

    def __init__(self, epoch: int, batches: int, num_workers: int):
        self.epoch = epoch
        self.batches = batches  # position in the epoch, skipped ones included
        self.num_workers = num_workers
        self.finished = False
        self.stats = PassStats()
        self.workers = WorkerStates(num_workers)
        self.rng = RngRecord()
        self.gate = None  # where a thread runs torch's iterator ahead: its pulls' schedule (dataloader.end_gate)


_LEAVES = frozenset({bytes, bytearray, memoryview, str, int, float, type(None)})


def _first_tensor(obj):
    """``first_tensor(obj)``, with the leaves of plain lists and tuples (raw samples' keys, bytes, labels)
    passed over without a call each."""
    if type(obj) is list or type(obj) is tuple:
        leaves = _LEAVES
        for child in obj:
            if type(child) in leaves:
                continue
            found = _first_tensor(child)
            if found is not None:
                return found
        return None
    return first_tensor(obj)


def count_samples(batch, *, auto_collation: bool, batch_size: int | None) -> int:
    """Samples in a batch: its first column's (a tensor's leading dimension, or a list of per-sample values in a
    tuple or dict of columns), a list of samples' length, else the first tensor's leading dimension, else
    ``batch_size``."""
    if not auto_collation:
        return 1
    if isinstance(batch, Mapping):
        first = next(iter(batch.values()), None)
    else:
        first = batch[0] if isinstance(batch, (list, tuple)) and batch else None
    if torch.is_tensor(first) and first.dim() > 0:
        return int(first.shape[0])
    if isinstance(batch, (tuple, Mapping)) and isinstance(first, (list, tuple)):
        return len(first)  # columns: (keys, [images], labels), {"__key__": [...], ...}
    if type(batch) is list and batch:
        return len(batch)  # a list of samples
    found = _first_tensor(batch)
    if found is not None and found.dim() > 0:
        return int(found.shape[0])
    if isinstance(batch, (list, tuple)) and batch and found is None:
        return len(batch)
    return batch_size or 1


def stats(p: Progress | None, *, epoch: int, num_workers: int, prefetch_depth: int | None, tuning: dict,
          prefetcher=None) -> dict:
    """``DataLoader.stats()``: the current (or last) pass ``p``, else zeros for ``epoch``, plus the autotune choices."""
    out = {"epoch": epoch, "samples": 0, "batches": 0, "elapsed_s": 0.0, "samples_per_s": 0.0,
           "batches_per_s": 0.0, "wait_s": 0.0, "wait_fraction": 0.0, "batch_bytes": 0,
           "num_workers": num_workers, "prefetch_depth": prefetch_depth,
           "autotune": {k: v for k, v in tuning.items()}}
    if p is None or p.stats.started is None:
        return out
    s = p.stats
    elapsed = s.elapsed()
    out.update(epoch=p.epoch, samples=s.samples, batches=s.yielded, elapsed_s=elapsed,
               wait_s=s.wait_s, batch_bytes=s.batch_bytes, num_workers=p.num_workers,
               samples_per_s=s.samples / elapsed if elapsed > 0 else 0.0,
               batches_per_s=s.yielded / elapsed if elapsed > 0 else 0.0,
               wait_fraction=min(1.0, s.wait_s / elapsed) if elapsed > 0 else 0.0)
    if prefetcher is not None:
        out["pinned_pool"] = prefetcher.pool_stats()
        out["producer"] = prefetcher.producer_stats()
    if not math.isfinite(out["samples_per_s"]):
        out["samples_per_s"] = 0.0
    return out
