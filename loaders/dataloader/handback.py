"""(Main process) torch's next index for a worker, held until the batch just received is copied out of its
worker's segment and the segment handed back (:mod:`loaders.dataloader.rawshm`).

torch sends a worker its next index the moment one of its batches arrives, before the loader copies that batch's
raw leaves out. The worker can then start its next batch while that segment is still busy, finds none free and
makes a new one: a worker's third segment, each made, zeroed, sent and mapped anew in the first pass (on the
2-core machine, 2 workers, batches of 27 MB). Held until the copy-out, the index reaches the worker once the
segment is free, so two segments serve a worker with torch's prefetch factor of 2. The worker still has its other
index to work on meanwhile, so it does not wait.

Only where the workers and the main process outnumber the usable cores. There each new segment costs CPU that
the others need, and a worker without an index frees its core (the 2-core machine, 2 and 4 workers: segments a
pass 8 -> 4 and 16 -> 8, epoch 1 +12% and +7%). Where cores are spare, the held index idles a worker that had a
core to work on (a 16-core host, 4 fresh workers: epoch 1 43.7k against 47.0k samples/s; 8 workers level), so
torch's timing stays (docs/performance.md).

Passes of workers that serve one pass only (torch's default): persistent workers keep their segments from pass to
pass, and their one torch iterator starts each pass anew (``_reset``), which a held index must not cross.
Only the index that torch's ``_process_data`` sends for the batch it returns is held (the ones it sends while it
looks for a batch, as a worker of an iterable dataset ends, go as torch sends them). Every held index is sent
before the next ``next()`` on torch's iterator, so torch's count of outstanding tasks is what it would have been.
"""
from __future__ import annotations

__all__ = ["HOLD", "IndexAfterCopy", "holds"]

HOLD = True  # loaders.DataLoader holds the index (False: torch's timing, for an A/B)


def holds(copies, workers: int, persistent: bool) -> bool:
    """Whether a pass holds the index: its workers' raw batches are copied out (``copies``, a
    :class:`~loaders.dataloader.rawshm.RawCopies`), its workers serve it alone, and they and the main process
    outnumber the usable cores."""
    if not (HOLD and copies is not None and workers > 0 and not persistent):
        return False
    from datapipe.device.autotune import usable_cores

    return workers + 1 > usable_cores()


class IndexAfterCopy:
    """Holds the index torch's multi-process iterator sends as it returns a batch (:meth:`next`), until
    :meth:`send` (the caller copied the batch out; called again before every :meth:`next`). ``held``: indices
    held so far."""

    def __init__(self):
        self._it = None
        self.pending = 0
        self.held = 0

    def next(self, torch_it):
        """``next(torch_it)``, with the index its ``_process_data`` sends held back."""
        self.send()
        if getattr(type(torch_it), "_process_data", None) is None:  # single-process: nothing to hold
            return next(torch_it)
        self._it = torch_it
        torch_it._process_data = self._process
        try:
            return next(torch_it)
        finally:
            del torch_it._process_data

    def _process(self, data, *args):
        it = self._it
        it._try_put_index = self._hold
        try:
            return type(it)._process_data(it, data, *args)
        finally:
            del it._try_put_index

    def _hold(self) -> None:
        self.pending += 1
        self.held += 1

    def send(self) -> None:
        """Send the held indices (none to an iterator already shut down)."""
        it = self._it
        while self.pending:
            self.pending -= 1
            if it is not None and not getattr(it, "_shutdown", False):
                type(it)._try_put_index(it)
