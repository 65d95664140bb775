"""The epoch of a stream: which epoch each loader pass runs at, and the copies in persistent workers.

Which epoch: a stream counts the passes loaders begin over it (``begin_pass``), so that every pass of any
``loaders.DataLoader`` over one stream object is a fresh epoch, the one after the last pass begun, unless
the epoch was set (``set_epoch``, ``load_state_dict``, a loader's own ``set_epoch`` / resume): then the
pass runs at that epoch and the passes after it count on from it.

The copies: persistent workers keep the copy of a stream they started with, so a new epoch set in the main
process would never reach them: each pass would repeat the first one's order. :class:`SharedEpoch` puts
the epoch in a one-element shared-memory tensor the copies share; a copy takes it at the start of each
pass it runs in a worker.
"""
from __future__ import annotations

import torch
import torch.utils.data

__all__ = ["SharedEpoch"]


class SharedEpoch:
    """Mixin for a stream with an ``epoch`` attribute and a ``set_epoch`` method.

    Every assignment to ``epoch`` (``set_epoch``, ``load_state_dict``, the constructor) is a choice the next
    pass keeps; ``begin_pass`` (called by ``loaders.DataLoader`` as a pass begins) takes that choice, or
    else moves on to the epoch after the last pass begun (:meth:`next_pass_epoch`).

    ``share_epoch()``: ``loaders.DataLoader`` calls it before it starts persistent workers. From then on
    every assignment to ``epoch`` in the main process writes it into the shared cell, and
    :meth:`_follow_epoch` (at the start of a pass) reads it there, in a worker only: the main process's
    own epoch is always its ``epoch`` attribute.
    """

    _epoch_cell: torch.Tensor | None = None
    _last_pass: int | None = None  # the epoch of the last pass a loader began over this object (this process)
    _epoch_chosen = True  # epoch was assigned since that pass began: the next pass runs at it

    @property
    def epoch(self) -> int:
        return self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch = int(value)
        self._epoch_chosen = True
        self._publish_epoch()  # every assignment reaches the worker copies, wherever it is made

    def next_pass_epoch(self) -> int:
        """The epoch the next loader pass runs at: the one assigned last, else the one after the last pass begun."""
        if self._epoch_chosen or self._last_pass is None:
            return self.epoch
        return self._last_pass + 1

    def begin_pass(self, epoch: int | None = None) -> int:
        """(``loaders.DataLoader``, as a pass begins.) Move to ``epoch`` (None: :meth:`next_pass_epoch`), count
        it as begun, and return it."""
        epoch = self.next_pass_epoch() if epoch is None else int(epoch)
        if epoch != self.epoch:
            self.set_epoch(epoch)
        self._epoch_chosen = False
        self._last_pass = epoch
        return epoch

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
