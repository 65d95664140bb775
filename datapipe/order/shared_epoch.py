"""The epoch a stream's copies in persistent DataLoader workers follow.

Persistent workers keep the copy of a stream they started with, so a new epoch set in the main process
(``set_epoch``, or the loader moving on) would never reach them: each pass would repeat the first one's
order. :class:`SharedEpoch` puts the epoch in a one-element shared-memory tensor the copies share;
a copy takes it at the start of each pass it runs in a worker.
"""
from __future__ import annotations

import torch
import torch.utils.data

__all__ = ["SharedEpoch"]


class SharedEpoch:
    """Mixin for a stream with an ``epoch`` attribute and a ``set_epoch`` method.

    ``share_epoch()``: ``loaders.DataLoader`` calls it before it starts persistent workers. From then on
    every assignment to ``epoch`` in the main process writes it into the shared cell, and
    :meth:`_follow_epoch` (at the start of a pass) reads it there, in a worker only: the main process's
    own epoch is always its ``epoch`` attribute.
    """

    _epoch_cell: torch.Tensor | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch = int(value)
        self._publish_epoch()  # every assignment reaches the worker copies, wherever it is made

    def share_epoch(self) -> None:
        """Give this stream's epoch a shared-memory cell its worker copies read (idempotent)."""
        if self._epoch_cell is None:
            self._epoch_cell = torch.full((1,), int(self.epoch), dtype=torch.int64).share_memory_()

    def _publish_epoch(self) -> None:
        if self._epoch_cell is not None and torch.utils.data.get_worker_info() is None:
            self._epoch_cell[0] = int(self.epoch)

    def _follow_epoch(self) -> None:
        """(At the start of a pass) in a worker, take the epoch the main process set last."""
        if self._epoch_cell is not None and torch.utils.data.get_worker_info() is not None:
            epoch = int(self._epoch_cell[0])
            if epoch != self.epoch:
                self.set_epoch(epoch)
