"""A loader's iterations, timed for :class:`datapipe.tools.doctor.report.Doctor`: ``next()`` is data wait, the
time until the next ``next()`` is compute. During a data-free ceiling measurement the cached batch is handed out
in place of the loader's (:mod:`datapipe.tools.doctor.ceiling`)."""
from __future__ import annotations

from typing import Iterable, Iterator

__all__ = ["TimedIteration", "WrappedLoader"]


class TimedIteration:
    """One iteration of a loader, timed: ``next()`` is wait, the time until the next ``next()`` is compute."""

    def __init__(self, doctor, it: Iterator, entry: dict):
        self._doctor = doctor
        self._it = it
        self._entry = entry
        self._first = True  # the first batch of an iteration carries its start-up (workers, pipeline build)

    def __iter__(self):
        return self

    def __next__(self):
        d = self._doctor
        if d._replay_left:
            batch = d._replayed()
            if batch is not None:
                return batch
        d._wait_start()
        try:
            batch = next(self._it)
        except StopIteration:
            d._exhausted()
            raise
        except BaseException:
            d._exhausted()
            raise
        self._entry["batches"] += 1
        self._entry["_first"], self._first = self._first, False
        d._ready(batch, self._entry)
        if d.ceiling_steps and d._ceiling is None and d._replay_left == 0 and self._entry["batches"] == d.ceiling_after:
            d._replay, d._replay_left = batch, d.ceiling_steps + 1
        return batch

    def __len__(self):
        return len(self._it)

    def __getattr__(self, name):  # _shutdown_workers, close, ... of the wrapped iterator
        return getattr(self._it, name)


class WrappedLoader:
    """What ``Doctor.wrap(loader)`` returns: every ``iter()`` is a timed iteration of ``loader``."""

    def __init__(self, doctor, loader: Iterable):
        self._doctor = doctor
        self._loader = loader

    def __iter__(self):
        return self._doctor._timed(self._loader, iter(self._loader))

    def __len__(self):
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)
