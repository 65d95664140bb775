"""The main process's side of ``loaders.DataLoader``'s recycled shared memory (:mod:`loaders.dataloader.shm`):
segments given back to their workers once a batch is pinned, and kept mapped (and page-locked) meanwhile."""
from __future__ import annotations

import collections
import os

import torch

from datapipe.device import host_register
from loaders.dataloader.shm import _STATE, FREE, _segment_header, _tensors

__all__ = ["SegmentReturns"]


class SegmentReturns:
    """(Main process) gives a pinned batch's segments back to their workers and keeps them mapped.

    ``release(batch)``: each tensor of ``batch`` in a segment marked ``mark`` is set ``FREE`` and its
    segment kept, so the next batch a worker writes into it arrives without a new mapping. At most
    twice the segments the workers can hold are kept (``workers`` x ``batches`` in flight x the
    tensors of a batch), the least recently used dropped first. ``clear()`` drops them all.

    One per set of workers (the loader makes one for each pass that starts workers): it only ever gives
    back its own pass's deliveries. ``next_pass()``: a new pass over the same persistent workers starts;
    they then free the segments of batches the last pass left in flight, which torch drops unread (see
    :meth:`SegmentPool.new_pass`).

    ``register=True`` (the loader copies batches to a GPU itself): ``adopt(batch)``, before pinning,
    keeps the batch's segments and page-locks each for CUDA the first time it is seen
    (:mod:`datapipe.device.host_register`), so pinning returns those tensors as they are and the GPU
    copies straight from the segment. Such a batch is released only once that copy has finished; its
    segments are not dropped meanwhile. A segment is unregistered when dropped.
    """

    def __init__(self, mark: bytes, *, workers: int, batches: int, register: bool = False):
        self.mark = mark
        self.workers = workers
        self.batches = batches
        self.register = register
        self.kept: collections.OrderedDict[int, torch.UntypedStorage] = collections.OrderedDict()
        self.registered: set[int] = set()
        self.released = 0
        self._copying: collections.Counter[int] = collections.Counter()  # segment -> batches a copy reads
        self._leaves = 1
        self._pid = os.getpid()
        self.passes: torch.Tensor | None = None  # persistent workers' pass counter (SegmentPool.new_pass)

    def pass_counter(self) -> torch.Tensor:
        """The (persistent) workers' pass counter in shared memory (made on first use), for their collates."""
        if self.passes is None:
            self.passes = torch.zeros(1, dtype=torch.int64).share_memory_()
        return self.passes

    def next_pass(self) -> None:
        """A new pass starts (after the last one gave back all it took): persistent workers free the
        segments of the batches the last pass left in flight."""
        if self.passes is not None:
            self.passes += 1

    def _segments(self, batch):
        for t in _tensors(batch):
            head = _segment_header(t, self.mark)
            if head is not None:
                yield t.untyped_storage(), head

    def _keep(self, storage: torch.UntypedStorage) -> int:
        ptr = storage.data_ptr()
        if ptr in self.kept:
            self.kept.move_to_end(ptr)
        else:
            self.kept[ptr] = storage
        return ptr

    def adopt(self, batch) -> bool:
        """Keep ``batch``'s segments, registered for CUDA with ``register``; True when a GPU copy will
        read one of them in place (release the batch only once that copy has finished)."""
        if not self.register:
            return False
        direct = False
        for storage, _ in self._segments(batch):
            ptr = self._keep(storage)
            if ptr not in self.registered and host_register.register(ptr, storage.nbytes()):
                self.registered.add(ptr)
            if ptr in self.registered:
                self._copying[ptr] += 1
                direct = True
        return direct

    def release(self, batch, *, adopted: bool = False) -> None:
        """Give ``batch``'s segments back to their workers (``adopted``: it went through ``adopt``, its
        copy is done)."""
        leaves = 0
        for storage, head in self._segments(batch):
            leaves += 1
            ptr = self._keep(storage)
            if adopted and ptr in self._copying:
                self._copying[ptr] -= 1
                if not self._copying[ptr]:
                    del self._copying[ptr]
            head[_STATE] = FREE
            self.released += 1
        self._leaves = max(self._leaves, leaves)
        over = len(self.kept) - 2 * max(1, self.workers) * self.batches * self._leaves
        if over > 0:  # the least recently used (a replaced or departed worker's), none a copy still reads
            for ptr in [p for p in self.kept if p not in self._copying][:over]:
                self._drop(ptr)

    def _drop(self, ptr: int) -> None:
        if ptr in self.registered:
            self.registered.discard(ptr)
            host_register.unregister(ptr)
        del self.kept[ptr]

    def clear(self) -> None:
        """Drop every kept segment (no copy may still read one)."""
        for ptr in list(self.kept):
            self._drop(ptr)
        self._copying.clear()

    def __del__(self):  # a loader dropped without close(): registered segments would stay page-locked
        try:
            if self.registered and os.getpid() == self._pid:  # not a forked copy: CUDA is the parent's
                self.clear()
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already
            pass
