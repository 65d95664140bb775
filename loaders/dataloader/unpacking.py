"""(Main process) a pass's batches with their raw leaves copied out of the workers' segments or memory
(:class:`loaders.dataloader.rawshm.RawCopies`), one at a time or, with ``ahead``, the next one's copies started in
a thread of its own while the consumer takes this one.

Where the main process reads its workers' memory, it took one batch at a time: torch's ``next()`` (the pipe, the
index it sends back), then the batch's reads in up to 8 threads, each busy a fraction of that time; that chain,
not the workers, set the rate (docs/performance.md). Read ahead, two batches' reads are under way at once: on a
16-core host, 6 interleaved rounds, 8 workers read 11-12% more and 4 workers 7% more in epoch 2.
"""
from __future__ import annotations

import threading

import loaders.dataloader.vmread as vmread
from datapipe.device.handoff import threaded
from loaders.dataloader.deaths import PassLeft, watch
from loaders.dataloader.handback import IndexAfterCopy, holds
from loaders.dataloader.iterator import Failed
from loaders.dataloader.rawshm import RawCopies

__all__ = ["AHEAD", "ENABLED", "ShutdownAfterCopies", "pass_plan", "reads_ahead", "unpacked"]

AHEAD = 1  # batches the thread of unpacked(ahead=...) holds started beyond the one it starts next
ENABLED = True  # False: one batch at a time wherever (an A/B's switch)


def pass_plan(copies: RawCopies | None, workers: int, *, persistent: bool, iterable: bool):
    """``(hold, ahead)`` of a pass: ``hold`` (or None) takes each ``next()`` on torch's iterator
    (:func:`loaders.dataloader.iterator.tagged_batches`) and its ``send`` is called after each copy; ``ahead`` (the
    hold, or None): the pass copies its next batch out while the consumer takes this one (:func:`reads_ahead`)."""
    if holds(copies, workers, persistent):
        return IndexAfterCopy(), None
    if copies is not None and iterable and reads_ahead(workers):
        hold = ShutdownAfterCopies(copies)
        return hold, hold
    return None, None


def reads_ahead(workers: int) -> bool:
    """Whether a pass of an iterable dataset over ``workers`` workers copies its next batch out while the consumer
    takes this one: where the main process reads its workers' memory (:func:`vmread.wanted`: 12 cores or more)."""
    return ENABLED and workers > 0 and vmread.wanted()


class ShutdownAfterCopies:
    """torch shuts a pass's workers down inside the ``next()`` that finds the pass's end; read ahead, that call
    comes while the consumer may still be reading the last batches out of the workers' memory, which a worker keeps
    only until torch tells it to go. Such a ``next()`` here first waits for every copy started
    (:meth:`RawCopies.settle`)."""

    def __init__(self, copies: RawCopies):
        self.copies = copies
        self.leaving = threading.Event()  # set as the consumer leaves the pass: a wait for torch's next batch ends

    def next(self, torch_it):
        shutdown = getattr(type(torch_it), "_shutdown_workers", None)
        if shutdown is None:  # single-process: no workers
            return next(torch_it)
        watch(torch_it, self.leaving)
        copies = self.copies

        def after_copies(*args, **kwargs):
            copies.settle()
            return shutdown(torch_it, *args, **kwargs)

        torch_it._shutdown_workers = after_copies
        try:
            return next(torch_it)
        finally:
            del torch_it._shutdown_workers

    def send(self) -> None:
        """(Nothing to send: torch's indices go as torch sends them.)"""

    def leave(self) -> None:
        """The consumer left the pass: the thread's wait for torch's next batch, if any, ends (:class:`PassLeft`)."""
        self.leaving.set()


def _called(then) -> Exception | None:
    """``then()`` (None: nothing), or the error it raised."""
    if then is not None:
        try:
            then()
        except Exception as e:  # noqa: BLE001 - handed to the consumer in place of the batch
            return e
    return None


def unpacked(stream, copies: RawCopies, *, keep: bool = False, stock=None, then=None, ahead=None):
    """``(batch, meta)`` of ``stream`` with each :class:`Packed` batch copied out (:meth:`RawCopies.unpack`),
    ``then()`` called after each (:class:`loaders.dataloader.handback.IndexAfterCopy`'s ``send``); at the end
    the kept segments are dropped unless ``keep`` (persistent workers reuse them) or ``stock`` takes them for the
    next pass's workers (:class:`loaders.dataloader.stock.SegmentStock`: once its workers are gone).

    ``ahead`` (a :class:`ShutdownAfterCopies`, the hold through which the stream's ``next()`` on torch's iterator
    goes: :func:`pass_plan`): a thread of its own takes torch's next batch and starts its copies while this one's
    end (so the main process reads two batches at once: :data:`AHEAD`)."""
    items = _started(stream, copies)
    if ahead is not None:
        items = threaded(items, depth=AHEAD, name="datapipe-unpack")
    try:
        for item, meta in items:
            try:
                batch = copies.finish(item)
            finally:
                item = None
                failed = _called(then)
            if failed is not None:  # torch's sampler raised as torch sends the index: the batch is lost, as in torch
                batch, meta = None, Failed(failed)
            yield batch, meta
            batch = meta = failed = None
    finally:
        try:
            if ahead is not None:  # its thread stops first (closing the stream there); what it started waits
                ahead.leave()
                try:
                    items.close()
                finally:
                    ahead.leaving.clear()  # torch's iterator waits again (persistent workers: the next pass)
        finally:
            copies.release()
            if ahead is None:
                items.close()  # closes the stream
            if not keep and not (stock is not None and stock.fill(copies)):
                copies.clear()


def _started(stream, copies: RawCopies):
    """``(copies.start(batch), meta)`` of ``stream``'s items; closes ``stream`` as it ends (also where the pass
    was left while it waited on torch: :class:`~loaders.dataloader.deaths.PassLeft`)."""
    try:
        for batch, meta in stream:
            yield copies.start(batch), meta
    except PassLeft:
        return
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
