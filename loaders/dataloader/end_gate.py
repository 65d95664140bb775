"""A pass's pulls from torch's index sampler draw from the sampler's generator what torch's DataLoader draws by the
same ``next()``, however far ahead of the consumer a thread of the loader (``device=``, or its pin thread) runs
torch's iterator.

torch's iterator pulls its index sampler on the consumer's schedule: with workers, ``P = prefetch_factor *
num_workers`` pulls as it is made, then one in each ``next()`` (pull ``j`` in the consumer's ``next()`` number
``j - P``); without workers, pull ``j`` in ``next()`` number ``j``. A thread that runs it ``prefetch_depth`` batches
ahead makes each pull earlier. Most pulls draw nothing, but torch 2.13's ``RandomSampler`` draws a second
``randperm`` from its generator in the pull that runs it out (``RandomSampler.__iter__``, the
``[: num_samples % n]`` tail): the pull after the last batch, or the last batch's own where that batch is short
(``BatchSampler`` looks past the end to fill it). Made early and the pass then left (``for b in loader: ... break``),
that draw is one torch never made, and the next pass's order with ``generator=`` differs from torch's.

:class:`EndGate` holds that pull (the *end pull*, :func:`end_pull`) until the consumer has asked for the batch in
whose ``next()`` torch makes it; a pass left before then lets its thread go without the pull. Only that one pull
waits, and one batch a pass at most is made while the consumer waits for it: with workers the batch in whose
delivery torch makes the pull (it is copied to the device then), without workers the short last batch (loaded and
copied then), or none where the pull is the one after the last batch. A sampler longer than its ``len`` loses
nothing: the gate only delays.

Pulls that draw as the pass goes (``RandomSampler(replacement=True)`` every 32 samples, or ``num_samples`` past the
dataset's size) are not held: those the thread made ahead of torch's schedule have their generator state before
them recorded, and a pass left before torch would have made them puts the generator back (once its thread is done,
and only if nothing else drew from it since). So does the first pull of a pass without workers, which is made as
the pass is (:func:`loaders.dataloader.iterator.fast_fetch`), where the pass is left before its first ``next()``.
"""
from __future__ import annotations

import threading
from collections import deque

import torch
from torch.utils.data import (BatchSampler, DistributedSampler, RandomSampler, SequentialSampler, SubsetRandomSampler,
                              WeightedRandomSampler)

__all__ = ["EndGate", "GatedPulls", "end_pull", "pass_gate"]

_POLL_S = 0.1
# torch's samplers whose last pull draws nothing (the random ones draw once, at their first pull)
_QUIET = (SequentialSampler, SubsetRandomSampler, WeightedRandomSampler, DistributedSampler)


def end_pull(index_sampler) -> tuple[int | None, object]:
    """``(pull, sampler)``: the number of the pull (from 1) that runs torch's index sampler ``index_sampler`` out,
    None where it has no ``len``; ``sampler``: the sampler of indices under it, None where unknown (a custom batch
    sampler)."""
    try:
        n = len(index_sampler)
    except TypeError:
        return None, None
    if not (isinstance(index_sampler, BatchSampler) and type(index_sampler).__iter__ is BatchSampler.__iter__):
        sampler = None if hasattr(index_sampler, "batch_size") else index_sampler  # batch_size=None: the sampler
        return n + 1, sampler
    sampler = index_sampler.sampler
    try:
        short = not index_sampler.drop_last and len(sampler) % index_sampler.batch_size != 0
    except TypeError:
        return n + 1, sampler
    return (n if short else n + 1), sampler


def torch_lead(workers: int, prefetch_factor: int | None) -> int:
    """The index pulls torch's iterator makes ahead of its consumer: ``prefetch_factor`` a worker, none without."""
    return workers * (prefetch_factor or 2) if workers else 0


def _generator(sampler) -> torch.Generator | None:
    g = getattr(sampler, "generator", None)
    return g if isinstance(g, torch.Generator) else None


def _draws_as_it_goes(sampler) -> bool:
    """Whether ``sampler`` draws from its generator between its first and its last pull."""
    if type(sampler) is not RandomSampler:
        return False
    try:
        return sampler.replacement or sampler.num_samples > len(sampler.data_source)
    except TypeError:
        return False


def pass_gate(loader, start: int) -> EndGate | None:
    """The gate of a pass of ``loader`` (a map-style ``loaders.DataLoader`` whose torch iterator a thread runs
    ahead) that starts at batch ``start`` (a resumed pass: after the batches it skips); None where no pull of the
    pass needs one."""
    if loader._iterable:
        return None
    pull, sampler = end_pull(loader._index_sampler.inner)
    generator = _generator(sampler)
    if generator is not None and generator is loader.generator and loader.seed is not None:
        return None  # seed=: every pass re-seeds it first, whatever was drawn before
    if type(sampler) in _QUIET or (type(sampler) is RandomSampler and generator is None):
        pull = None  # its last pull draws nothing that anything else draws from
    if pull is None and generator is None:
        return None
    return EndGate(start=start, end=pull, generator=generator, as_it_goes=_draws_as_it_goes(sampler))


class EndGate:
    """One pass's schedule of torch's pulls. The consumer calls :meth:`ask` as each ``next()`` begins and
    :meth:`release` once the pass is left (closed or dropped); the producer thread pulls through :meth:`pulls`
    and calls :meth:`thread_done` after its last pull (:meth:`watched`).

    ``start``: the batches before the pass's first (a resumed pass skips them); ``end``: the end pull's number
    counted from the epoch's first batch (None: no pull waits); ``generator``: the sampler's, put back where a
    left pass drew ahead of torch (``as_it_goes``: the sampler draws between its first and last pull)."""

    def __init__(self, *, start: int, end: int | None, generator: torch.Generator | None = None,
                 as_it_goes: bool = False):
        self.end = end
        self.asked = start  # batches the consumer has asked for, counted from the epoch's first
        self.held = 0  # pulls that waited for the consumer (the end pull's alone: at most one)
        self._cond = threading.Condition()
        self._released = self._done = self._settled = False
        self._latest: GatedPulls | None = None
        self._generator = generator
        self._as_it_goes = as_it_goes
        self._taken: deque | None = deque()  # (pull, lead, generator state before it) of pulls made ahead
        self._after: bytes | None = None  # the generator's state after the latest pull recorded

    # ---- the consumer -------------------------------------------------------------------------
    def ask(self) -> None:
        """(Consumer) a ``next()`` begins."""
        with self._cond:
            self.asked += 1
            self._cond.notify_all()

    def release(self) -> None:
        """The pass is left: a pull waiting here ends the sampler for it, unmade; draws made ahead go back."""
        with self._cond:
            self._released = True
            self._cond.notify_all()
        self._settle()

    # ---- torch's iterator ---------------------------------------------------------------------
    def pulls(self, it, *, first: int, workers: int, prefetch_factor: int | None) -> GatedPulls:
        """``it`` (the index sampler's iterator, its first item batch ``first`` of the epoch) pulled through this
        gate by a torch iterator with ``workers`` workers. Its pulls never wait until :meth:`arm`."""
        lead = torch_lead(workers, prefetch_factor)
        with self._cond:
            if self._taken is not None:
                self._taken.clear()
            self._after = None
            self._latest = GatedPulls(self, it, first, lead)
        return self._latest

    def arm(self, torch_it):
        """(After torch's iterator ``torch_it`` is made, its first pulls with it) its later pulls follow the gate."""
        if self._latest is not None:
            self._latest.armed = True
            self._latest = None
        return torch_it

    def ends_within(self, skip: int, workers: int, prefetch_factor: int | None) -> bool:
        """Whether a torch iterator of ``workers`` workers made now, from batch ``skip + 1``, would make the end
        pull as it is made (where nothing may hold it)."""
        made = torch_lead(workers, prefetch_factor) or 1  # without workers: the first pull, made with the pass
        return self.end is not None and self.end <= skip + made

    def watched(self, stream):
        """``stream`` as the producer thread runs it: closing it (the thread's end) marks the thread done."""
        return _Watched(stream, self)

    def thread_done(self) -> None:
        """(Producer thread) it pulls no more."""
        with self._cond:
            self._done = True
        self._settle()

    # ---- inside -------------------------------------------------------------------------------
    def _allowed(self, pull: int, lead: int) -> bool:
        return self.asked >= pull - lead

    def _wait(self, pull: int, lead: int) -> bool:
        """Wait until torch would make pull ``pull``; False: the pass was left first (no pull)."""
        with self._cond:
            self.held += not self._allowed(pull, lead)
            while not self._allowed(pull, lead):
                if self._released:
                    return False
                self._cond.wait(_POLL_S)
        return True

    def _state(self) -> bytes:
        return self._generator.get_state().numpy().tobytes()

    def _records(self, pull: int, lead: int, armed: bool) -> bool:
        """Whether pull ``pull`` is made ahead of torch and may draw: its generator state is recorded."""
        return (self._generator is not None and self._taken is not None and (self._as_it_goes or not armed)
                and not self._allowed(pull, lead))

    def _recorded(self, it, pull: int, lead: int):
        before = self._state()
        with self._cond:
            taken = self._taken
            while taken and self._allowed(taken[0][0], taken[0][1]):
                taken.popleft()  # torch has made these by now (and so every pull of ours since)
            if taken and before != self._after:  # something else drew since our last: no way back
                self._taken = None
        try:
            return next(it)
        finally:
            after = self._state()
            with self._cond:
                if self._taken is not None:
                    if after != before:
                        self._taken.append((pull, lead, before))
                    self._after = after

    def _settle(self) -> None:
        """Once the pass is left and its thread done: the draws of pulls torch had not made go back."""
        with self._cond:
            if not (self._released and self._done) or self._settled:
                return
            self._settled = True
            ahead = [before for pull, lead, before in self._taken or () if not self._allowed(pull, lead)]
            if ahead and self._state() == self._after:
                self._generator.set_state(torch.frombuffer(bytearray(ahead[0]), dtype=torch.uint8))
            self._taken = None


class GatedPulls:
    """The index sampler's iterator in a torch iterator, pulled through an :class:`EndGate` (``lead``: the pulls
    torch's iterator makes ahead of its consumer)."""

    def __init__(self, gate: EndGate, it, first: int, lead: int):
        self._gate, self._it, self._next, self.lead = gate, it, first, lead
        self._first = first  # a resumed pass's first pull skips the batches before it first (torch made those)
        self.armed = False

    def __iter__(self):
        return self

    def __next__(self):
        gate, pull = self._gate, self._next
        self._next = pull + 1
        if self.armed and pull == gate.end and not gate._wait(pull, self.lead):
            raise StopIteration  # the pass was left first: torch would not have made this pull
        if pull == self._first:
            for _ in range(pull - 1):
                next(self._it)
        # before arm(), only a pass's very first pull may be one torch makes later (without workers)
        if (self.armed or pull == self._first) and gate._records(pull, self.lead, self.armed):
            return gate._recorded(self._it, pull, self.lead)
        return next(self._it)


class _Watched:
    """A stream whose ``close()`` (in the producer thread, as it ends: called even where the stream was never
    started) tells its gate the thread pulls no more."""

    def __init__(self, stream, gate: EndGate):
        self._stream, self._gate = stream, gate

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._stream)

    def close(self) -> None:
        try:
            close = getattr(self._stream, "close", None)
            if close is not None:
                close()
        finally:
            self._gate.thread_done()
