"""``ImageLoader``'s epochs: a pass that runs to its end makes the next pass the next epoch, reshuffled.

The rule is ``loaders.DataLoader``'s (:class:`loaders.dataloader.state.LoaderState`), run here, not
rewritten: a finished pass moves the loader's epoch on, and its stream is told before the next pass
unless someone else set the stream's epoch meanwhile; ``set_epoch`` chooses the epoch explicitly.
ImageLoader's epoch is its stream's (DALI's seeds and the sample numbering read it), so a pass
takes the stream's epoch as it starts. Between passes the loader's state is the start of its next
epoch (:func:`loaders.source.stream_start`), as a ``loaders.DataLoader``'s is.
"""
from __future__ import annotations

from loaders.dataloader.state import LoaderState


class EpochClock:
    """The epoch of an ImageLoader's next pass (or of the pass under way), and when its stream hears of it."""

    # loaders.DataLoader's rule, run on this object (it reads dataset, sampler, _pending, _epoch,
    # _tell_dataset and _ds_epoch_seen): one rule for both loaders
    _set_epoch = LoaderState.set_epoch
    _choose_epoch = LoaderState._choose_epoch
    _sync_dataset_epoch = LoaderState._sync_dataset_epoch

    def __init__(self, stream):
        self.dataset = stream
        self.sampler = None
        self._pending = None
        self._epoch = 0
        self._tell_dataset = False
        self._ds_epoch_seen = None
        self.between = False  # no pass under way: the last one ran to its end, or the epoch was set since

    @property
    def epoch(self) -> int:
        return self._epoch

    def set(self, epoch: int, *, keep: bool = False) -> None:
        """``set_epoch``: the next pass is ``epoch``. ``keep``: a resume is loaded; the same epoch keeps it."""
        same = int(epoch) == self._epoch
        self._set_epoch(int(epoch))
        self.between = self.between or not (keep and same)

    def begin(self, *, resumed: bool) -> int:
        """A pass starts: unless it resumes a loaded state, the stream hears of the epoch if the rule says so
        and the pass is the stream's epoch. Returns the pass's epoch."""
        if not resumed:
            self._sync_dataset_epoch()
            self._epoch = int(self.dataset.epoch)
        self.between = False
        return self._epoch

    def end(self, epoch: int) -> None:
        """The pass of ``epoch`` ran to its end: the next pass is the next epoch."""
        self._epoch = epoch + 1
        self._tell_dataset = True
        self.between = True

    def load(self, epoch: int) -> None:
        """A state of ``epoch`` was loaded (its stream is at that epoch now)."""
        self._epoch = int(epoch)
        self._tell_dataset = False
        self._ds_epoch_seen = getattr(self.dataset, "epoch", None)
        self.between = False
