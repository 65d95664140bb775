"""Raw-batch segments that outlive a pass's workers, for the next pass's fresh workers (torch's default,
``persistent_workers=False``).

A worker makes each shared-memory segment it packs raw batches into (:mod:`loaders.dataloader.rawshm`), and a
new segment costs its first batch twice: the worker's writes fault in and zero every page, and the main process
maps it and faults it in again as it copies out. On the 2-core machine, a batch of 256 samples of ~100 KB: 20-22 ms
to pack into a new segment against 3.6-4.4 ms into a used one, 12-23 ms to copy out of a new one against 4.4-5.7
ms. Workers that serve one pass pay that every pass, for every segment (a worker holds up to its prefetch
factor + 2).

Here the segments of a pass whose workers have all exited stay mapped in the main process (:meth:`fill`), and
the next pass hands them to its workers before they fork (:meth:`hand_out`): a worker inherits the mapping, its
pool starts with those segments free (:meth:`loaders.dataloader.shm.SegmentPool.adopt`), and names each by the
token the main process already keeps it under, so none is made, zeroed, sent or mapped again.

Only passes whose workers fork (they inherit the main process's mappings), write raw batches alone (no pin
thread of the loader's recycling their tensors) and serve one pass; segments go back only once every worker
that could write into them is gone (``processes``); two passes alive at once never share one (a handed-out
segment leaves the stock).
"""
from __future__ import annotations

import multiprocessing
import threading

from loaders.dataloader.shm import _STATE, FREE, MAPPED

__all__ = ["SegmentStock", "forks", "note_workers", "stock_for_pass"]


def forks(context) -> bool:
    """Whether a DataLoader with ``multiprocessing_context=context`` starts its workers by ``fork``."""
    if context is None:
        context = multiprocessing.get_context()  # torch's default: the process's default start method
    elif isinstance(context, str):
        return context == "fork"
    return context.get_start_method() == "fork"


class SegmentStock:
    """(Main process) the segments of finished passes, kept mapped, waiting for the next pass's workers."""

    def __init__(self):
        self._lock = threading.RLock()  # fill may run again in a collection while this thread is inside it
        self.entries: list[tuple] = []  # (token, rawshm._Mapped)
        self.reused = 0  # segments handed to later passes' workers (stats)

    def __len__(self) -> int:
        return len(self.entries)

    def fill(self, copies) -> bool:
        """A pass ended: if every process that wrote into its segments has exited, keep its mapped segments here
        (each ``FREE``) and take them from ``copies``; whether it did (else the caller unmaps them). The stock
        keeps at most one pass's worth (the pass's workers x the segments each may hold), the largest: passes
        that ran side by side give back more than the next one takes, and the rest are unmapped."""
        processes = getattr(copies, "processes", None)
        if not processes or any(p.is_alive() for p in processes):
            return False
        entries = list(copies.kept.items())
        copies.kept.clear()
        for _, entry in entries:
            entry.header[_STATE] = FREE  # in flight when the pass ended: nobody reads or writes it now
            entry.header[MAPPED] = 1
        limit = max(1, copies.workers) * copies.batches
        with self._lock:  # list operations alone under the lock (see __init__)
            kept = sorted(self.entries + entries, key=lambda e: e[1].storage.nbytes(), reverse=True)
            self.entries, extra = kept[:limit], kept[limit:]
        for _, entry in extra:
            entry.header[MAPPED] = 0
        return True

    def hand_out(self, copies, workers: int) -> list[list[tuple]] | None:
        """(Before a pass's workers fork) every kept segment, split among ``workers``: worker ``i``'s share as
        ``(token, storage)`` pairs, each also kept by ``copies`` (the pass's receiver) under its token. None:
        nothing to hand out."""
        with self._lock:
            entries, self.entries = self.entries, []
        if not entries:
            return None
        for token, entry in entries:
            copies.kept[token] = entry
        self.reused += len(entries)
        return [[(token, entry.storage) for token, entry in entries[w::workers]] for w in range(workers)]

    def clear(self) -> None:
        """Unmap every kept segment (the loader closes)."""
        with self._lock:
            entries, self.entries = self.entries, []
        for _, entry in entries:
            entry.header[MAPPED] = 0


def stock_for_pass(loader, copies, workers: int, *, raw: bool, tensors: bool) -> list[list[tuple]] | None:
    """(Main process, before the pass's workers fork) the shares of ``loader._stock`` its workers start with, or
    None; a pass that may give its segments back at its end gets ``copies.processes`` (see the module)."""
    if not raw or tensors or workers < 1 or loader.persistent_workers or not forks(loader.multiprocessing_context):
        return None
    if copies.processes is None:
        copies.processes = []  # the pass's worker processes, as they start (note_workers)
    return loader._stock.hand_out(copies, workers)


def note_workers(copies, torch_iter) -> None:
    """(Main process) the worker processes of one of torch's iterators write into this pass's segments."""
    if copies is not None and copies.processes is not None:
        copies.processes.extend(getattr(torch_iter, "_workers", ()))
