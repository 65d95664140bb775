"""``torch.utils.data.DataLoader`` subclass with device prefetch, exact mid-epoch resume, stats, autotune.

``DataLoader`` *is* a torch DataLoader (same signature, attributes, assign-after-init rules and
iterators: torch's own ``_get_iterator`` runs the sampler and the workers), with layers on top:
``device=`` feeds batches through :class:`datapipe.DevicePrefetcher`; ``state_dict()`` /
``load_state_dict()``; ``stats()``; ``num_workers="auto"``. With ``device=None`` it returns exactly
the batches torch returns for the same arguments and the same RNG state.

Seeding: like torch, without ``generator=`` the shuffle order and the workers' base seed come from
torch's global RNG (so ``torch.manual_seed`` changes them and every pass differs). ``seed=s``
instead re-seeds a private generator with ``s + epoch`` at every pass.

Resume (``state_dict()`` / ``load_state_dict()``): exact mid-epoch. Map-style datasets replay the
pass's sampler order and skip the consumed batches; iterable datasets with the worker-state
protocol take their merged worker states back; other iterable datasets produce the consumed
batches again and drop them. The state's shape and the map-style replay:
:mod:`loaders.dataloader.resume`; the worker-state protocol: :mod:`loaders.dataloader.workers`.

Epochs: every pass over a ``ShardStream`` or ``mix`` is a fresh epoch, the one after the last pass any loader
began over that object, unless an epoch was set (this loader's ``set_epoch`` / ``load_state_dict``, or the
dataset's ``set_epoch``): then the pass runs at it (:mod:`datapipe.order.shared_epoch`). Another dataset with
``set_epoch`` is told this loader's next epoch after a finished pass, unless someone else changed its ``epoch``.
Samplers are left alone, as torch does (call ``sampler.set_epoch`` yourself, or ``dl.set_epoch``).

The parts: this module is the loader (torch's hooks, the pass, its end, ``close()``);
:mod:`loaders.dataloader.state` the epoch and state methods; :mod:`loaders.dataloader.stats` ``stats()``;
:mod:`loaders.dataloader.iterator` the pass's stream and the consumer-side iterator;
:mod:`loaders.dataloader.progress` a pass's position and timing;
:mod:`loaders.dataloader.tuning` the "auto" choices; where the loader pins
(``device="cuda"``, or ``pin_memory=True`` with a GPU and workers: in a thread of its own, in place of
torch's pin thread), :mod:`loaders.dataloader.shm` the workers' recycled shared memory; with workers,
:mod:`loaders.dataloader.rawshm` their raw samples in it.
"""
from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from typing import TypeVar

import torch
import torch.utils.data as tud
from torch.utils.data import IterableDataset

from datapipe.device import forks
from datapipe.device.handoff import PassThreads, close_last, threaded
from datapipe.device.prefetch import DevicePrefetcher, resolve_device
from loaders.dataloader.copyout import keep_heap_for
from loaders.dataloader.deaths import dead, fatal
from loaders.dataloader.end_gate import pass_gate
from loaders.dataloader.iterator import (EpochSource, LoaderIterator, constant_batches, fast_fetch, pinned,
                                         pins_for_cuda, shutdown, tagged_batches)
from loaders.dataloader.progress import Progress
from loaders.dataloader.rawshm import RawCopies, pack_raw
from loaders.dataloader.unpacking import pass_plan, unpacked
from loaders.dataloader.returns import SegmentReturns
from loaders.dataloader.shm import PooledCollate, recycling_available
from loaders.dataloader.resume import IndexSampler, Plan, skip_base_seed
from loaders.dataloader.state import LoaderState
from loaders.dataloader.stats import LoaderStats
from loaders.dataloader.stock import SegmentStock, note_workers, stock_for_pass
from loaders.dataloader.tuning import (check_options, check_workers, retune, workers_for_iterable,
                                       workers_from_first_batches)
from loaders.dataloader.workers import StatefulCollate, has_protocol

__all__ = ["DataLoader"]

_END = object()
_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(LoaderState, LoaderStats, tud.DataLoader[_T_co]):
    """``torch.utils.data.DataLoader`` plus ``device=`` prefetch, resumable state, stats, autotune.

    Positional and keyword arguments are torch's; ours are keyword-only: ``device``,
    ``prefetch_depth``, ``seed`` (``None``: torch's seeding) and ``max_workers``.
    ``num_workers="auto"`` and ``prefetch_depth="auto"`` are chosen from measured rates (see
    :mod:`datapipe.device.autotune`): a map-style dataset serves its first batches from the main process
    while timing production and the consumer, then continues (same order) with the chosen worker
    count; an iterable dataset starts at the CPU/memory bound. Both grow at epoch boundaries
    while the consumer keeps waiting. ``max_workers`` caps the choice. ``num_workers`` holds the
    worker count in use.

    Pinning: with ``device="cuda"`` the prefetch thread pins and copies; with ``pin_memory=True``, no
    ``device`` and worker processes (torch's idiom, a GPU present) a thread of this loader pins in place
    of torch's pin-memory thread, ``prefetch_depth`` batches ahead. Either way the workers' batches
    travel in recycled shared memory (:mod:`loaders.dataloader.shm`), with ``device="cuda"`` copied to
    the GPU in place. With any ``device``, workers' raw samples (``bytes``, numpy arrays, in dicts, lists and
    tuples) travel in recycled shared memory and are copied out as they arrive
    (:mod:`loaders.dataloader.rawshm`), not pickled through a pipe, into memory this process keeps once freed
    (:func:`datapipe.read.heap.keep_freed_memory`, as a ``ShardStream`` does where it reads; not where its
    ``StorageOptions(keep_freed_memory=False)`` says no); where no thread of this loader pins,
    a batch's tensors travel in one block of shared memory and come out each on a storage of its own in it
    (a list of decoded images: one socket round trip a batch instead of one a tensor; a batch saves and
    pickles at its own size). Every pass that starts workers has its own shared memory (its own mark,
    pools and segments: :meth:`_transport`), so passes of non-persistent workers run side by side, with any
    ``device``, as torch's do. Persistent workers serve one pass at a time, as torch's one iterator of them
    does: ``iter()`` stops the last pass's iterator first (its ``next()`` ends). A worker that dies ends the
    pass with torch's error (:mod:`loaders.dataloader.deaths`).
    """

    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int | str = 0, collate_fn=None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn=None, multiprocessing_context=None,
                 generator=None, *, prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True,
                 device: str | torch.device | int | None = None, prefetch_depth: int | str = 2,
                 seed: int | None = None, max_workers: int | None = None):
        check_options(num_workers=num_workers, prefetch_depth=prefetch_depth, max_workers=max_workers)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed={seed!r}: pass an int or None (torch's global RNG)")
        auto = num_workers == "auto"
        dev = None if device is None else resolve_device(device)
        if dev is not None and dev.type == "cuda":
            # batches are pinned as torch pins them, but in the prefetch thread (dataloader_iter.pinned),
            # not in torch's pin-memory thread; the prefetcher then copies them on its side stream
            pin_memory = True
        if seed is not None and generator is None:
            generator = torch.Generator().manual_seed(seed)
        # "auto": torch validates the multiprocessing options against one worker; the count in use
        # is set below (0 while a map-style dataset is being timed)
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, 1 if auto else num_workers,
                         collate_fn, pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context,
                         generator, prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order)
        self.device = dev
        self._pass_pins = False  # whether a thread of ours pins this pass's batches (_pins_here)
        # workers write batches into recycled shared memory, given back once pinned (shm), with device="cuda" registered
        # and copied to the GPU in place; None: fresh shared memory. Each set of workers has its own (_transport)
        self._returns: SegmentReturns | None = SegmentReturns(
            os.urandom(8), workers=0, batches=(prefetch_factor or 2) + 2,
            register=dev is not None and dev.type == "cuda")
        # workers' raw samples (bytes, arrays) in recycled shared memory, copied out (rawshm); None: torch's pipe
        self._raw: RawCopies | None = RawCopies(self._returns.mark, workers=0, batches=self._returns.batches)
        self._transport_used = False  # whether a pass got the current _returns / _raw (then a new pass makes new)
        self._stock = SegmentStock()  # finished passes' raw segments, for the next pass's fresh workers
        self.prefetch_depth = prefetch_depth
        self.seed = seed
        self.max_workers = max_workers
        self._auto_workers_mode = auto
        self._iterable = isinstance(dataset, IterableDataset)
        self._protocol = has_protocol(dataset)  # the worker-state protocol (loaders.dataloader.workers)
        self._plan = Plan()
        self._index_wrapper = None  # IndexSampler (map-style), ConstantBatches (iterable) or torch's own
        self._epoch = 0
        self._epoch_forced = False  # set_epoch / load_state_dict chose the next pass's epoch
        self._tell_dataset = False  # the epoch moved on: tell the dataset before the next pass
        self._ds_epoch_seen = None
        self._pending: dict | None = None
        self._progress: Progress | None = None
        self._losses_before: dict = {}  # the dataset's loss totals when the current pass began
        self._active, self._threads = None, PassThreads()  # weakref to the latest LoaderIterator; the passes' threads
        self._live: weakref.WeakSet = weakref.WeakSet()  # every LoaderIterator not yet collected (close())
        # torch's iterators are made one at a time: _torch_iter swaps the loader's collate_fn, num_workers and
        # plan around it, and a pass's thread may make one (num_workers="auto") while another pass starts
        self._making = threading.RLock()
        self._prefetcher: DevicePrefetcher | None = None
        self._auto: dict = {"num_workers": None, "prefetch_depth": None, "history": []}
        self._auto_workers: int | None = None if auto else num_workers
        self.num_workers = self._workers_said = self._auto_workers or 0  # said: the last value the loader set
        self._depth = 2 if prefetch_depth == "auto" else prefetch_depth
        self._depth_hi = 8

    # ---- torch hooks -------------------------------------------------------------------------
    @property
    def _index_sampler(self):
        inner = super()._index_sampler
        if self._iterable:
            w = self._index_wrapper
            if w is None or getattr(w, "inner", None) is not inner:
                w = self._index_wrapper = constant_batches(inner)
            return w
        w = self._index_wrapper
        if w is None or w.inner is not inner:
            w = self._index_wrapper = IndexSampler(self, inner)
        return w

    def _transport(self):
        """The recycled shared memory of a new pass (``SegmentReturns``, ``RawCopies``, either may be None).

        Ownership is per set of workers: a pass that starts new workers gets a mark of its own, and its
        workers' pools, whose segments only its own stream sets ``FREE`` (once that exact delivery is copied
        out, pinned or copied to the GPU); passes alive at the same time share nothing. Persistent workers
        keep theirs across passes: one pass runs at a time there, and the new pass frees what torch dropped
        unread from the last (``SegmentReturns.next_pass``)."""
        old_r, old_c = self._returns, self._raw
        again = self.persistent_workers and self._iterator is not None
        if again or not self._transport_used:  # the persistent workers' own, or the first pass's
            if again and old_r is not None:
                old_r.next_pass()
            self._transport_used = True
            return old_r, old_c
        mark = os.urandom(8)
        r = c = None
        if old_r is not None:
            r = SegmentReturns(mark, workers=0, batches=old_r.batches, register=old_r.register)
            r.released = old_r.released  # stats() counts over the loader's life
        if old_c is not None:
            c = RawCopies(mark, workers=0, batches=old_c.batches)
            c.copied = old_c.copied
        self._returns, self._raw = r, c
        return r, c

    def _torch_iter(self, workers: int, p: Progress, transport, *, skip: int = 0, replay: bool = False):
        """One of torch's iterators (``super().__iter__``: persistent workers reused as torch does), its
        workers writing into ``transport`` (this pass's ``(SegmentReturns, RawCopies)``)."""
        with self._making:
            return self._make_torch_iter(workers, p, transport, skip=skip, replay=replay)

    def _make_torch_iter(self, workers: int, p: Progress, transport, *, skip: int, replay: bool):
        self.num_workers = self._workers_said = workers
        rng = p.rng
        replay_rng, replay_generator = (rng.sampler_rng, rng.sampler_generator) if replay else (None, None)
        self._plan = Plan(skip, replay_rng, rng, replay_generator, p.gate)
        if rng.generator_state is not None and self.generator is not None:
            self.generator.set_state(rng.generator_state)
        if (self.seed is not None or replay) and self.persistent_workers and self._iterator is not None:
            skip_base_seed(self.generator)  # a reset torch iterator draws none: as a new one, whatever the history
        collate, pin = self.collate_fn, self.pin_memory
        inner = collate
        returns, copies = transport
        tensors, raw = self._recycles(workers, returns), self._packs(workers, returns, copies)
        if tensors or raw:
            if tensors:
                returns.workers = workers
            if raw:
                copies.workers = workers
                keep_heap_for(self.dataset)
            # persistent workers outlive a pass: a pass counter of their own frees what torch dropped unread
            passes = returns.pass_counter() if self.persistent_workers else None
            # the batch's tensors travel in the raw segment unless recycled on their own (a thread of ours pins)
            inner = PooledCollate(collate, returns.mark, returns.batches, passes, tensors=tensors,
                                  pack=functools.partial(pack_raw, tensors=not tensors) if raw else None,
                                  stock=stock_for_pass(self, copies, workers, raw=raw, tensors=tensors))
        if self._protocol:
            inner = StatefulCollate(inner, self.dataset)
        self.collate_fn = inner
        if self._pass_pins:
            self.pin_memory = False  # no pin thread in torch's iterator: dataloader_iter.pinned pins
        open_ledger, again = self._dataset_hook("open_ledger"), self.persistent_workers and self._iterator is not None
        if workers > 0 and callable(open_ledger):  # each pass: the workers' losses reach its stats (read.ledger)
            open_ledger(workers, again=again, context=self.multiprocessing_context)
        share_epoch = self._dataset_hook("share_epoch")
        if workers > 0 and self.persistent_workers and callable(share_epoch):
            share_epoch()  # before the workers start: their copies follow each pass's epoch (order.shared_epoch)
        forks.install()  # workers fork here; none collects the parent's cyclic garbage (datapipe.device.forks)
        try:
            if replay and rng.rng_state is not None:
                with torch.random.fork_rng(devices=[]):
                    torch.set_rng_state(rng.rng_state)
                    it = super().__iter__()
            else:
                rng.rng_state = torch.get_rng_state()
                it = super().__iter__()
        finally:
            self.collate_fn, self.pin_memory = collate, pin
            self._plan = Plan()
        note_workers(copies, it)
        rng.base_seed = getattr(it, "_base_seed", None)
        if workers == 0:
            fast_fetch(it, draw_now=self.device is not None)
        return it if p.gate is None else p.gate.arm(it)  # its first pulls made: the later ones wait where torch's would

    def _pins_here(self, workers: int) -> bool:
        """Whether a thread of ours pins a pass's batches (``iterator.pinned``), not torch: the prefetch thread with
        ``device="cuda"``; with ``device=None``, ``pin_memory=True`` (for CUDA) and workers, a pin thread in torch's
        place. Without workers torch pins in the training thread, the dataset running there too, and so it stays."""
        if self.device is not None:
            return self.device.type == "cuda"
        return (bool(self.pin_memory) and pins_for_cuda(self.pin_memory_device)
                and (workers > 0 or self._auto_workers_mode))

    def _recycles(self, workers: int, returns) -> bool:
        """Whether this pass's workers write batches into recycled shared memory (``shm``): a thread of ours pins."""
        return returns is not None and workers > 0 and recycling_available() and self._pass_pins

    def _packs(self, workers: int, returns, copies) -> bool:
        """Whether this pass's workers send raw samples in recycled shared memory (``rawshm``), copied out."""
        return copies is not None and returns is not None and workers > 0 and recycling_available()

    def _dataset_hook(self, name: str):
        """The dataset's method ``name`` for the loader (``open_ledger``, ``share_epoch``), or its ``stream``'s."""
        return getattr(self.dataset, name, None) or getattr(getattr(self.dataset, "stream", None), name, None)

    def _drop_persistent(self) -> None:
        if self._iterator is not None:
            shutdown(self._iterator)
            self._iterator = None

    # ---- the epoch stream (runs in the prefetch thread when device is set) --------------------
    def _epoch_stream(self, p: Progress, first, start: int, transport, hold=None):
        """The pass's batches from position ``start``, as ``(batch, meta)``. ``first``: the torch
        iterator, made in the main thread (see __iter__); ``transport``: the pass's shared memory; ``hold``:
        the pass's :func:`~loaders.dataloader.unpacking.pass_plan` hold, or None."""
        torch_it, completed = first, False
        try:
            if not self._iterable and self._auto_workers is None:
                times, stream = [], tagged_batches(torch_it, protocol=self._protocol, hold=hold)
                for _ in range(max(4, self._depth + 3) if self.device is not None else 4):
                    t0 = time.perf_counter()
                    item = next(stream, _END)
                    if item is _END:
                        completed = True
                        return
                    times.append(time.perf_counter() - t0)
                    yield item
                skip = start + len(times)
                self._decide_workers(times, p)
                if p.gate is None or not p.gate.ends_within(skip, self._auto_workers, self.prefetch_factor):
                    torch_it = None  # (else this iterator ends the pass: a new one would pull its end as it is made)
                    p.num_workers = self._auto_workers
                    torch_it = self._torch_iter(p.num_workers, p, transport, skip=skip, replay=True)
            elif self._iterable and not self._protocol:
                for _ in range(start):  # replay: no way to skip without producing
                    if next(torch_it, _END) is _END:
                        break
            yield from tagged_batches(torch_it, protocol=self._protocol, hold=hold)
            completed = True
        except RuntimeError as e:
            if fatal(e) and torch_it is not None and torch_it is self._iterator:  # persistent workers, one dead:
                self._iterator = None  # all go (below), the next pass starts new ones
            raise
        finally:
            if not completed and torch_it is not None and torch_it is not self._iterator:
                shutdown(torch_it)

    def _decide_workers(self, times: list[float], p: Progress) -> None:
        """num_workers="auto", map-style: the worker count from the first batches' production times."""
        d = workers_from_first_batches(times, p.stats, prefetch_factor=self.prefetch_factor or 2,
                                       max_workers=self.max_workers)
        self._auto_workers = d["value"]
        self._auto["num_workers"] = d

    # ---- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> LoaderIterator:
        # the last pass's thread stops first over persistent workers: it would go on pulling from their one torch
        # iterator (torch: a new iter() resets it). Other passes run side by side (each with its own workers and
        # shared memory, _transport), but the threads of those dropped unfinished end before this one starts
        self._close_active() if self.persistent_workers else self._threads.wait()
        resume, self._pending = self._pending, None
        if self.num_workers != self._workers_said and self._iterator is None:  # set by the user, as torch allows
            self._auto_workers = self._workers_said = check_workers(self.num_workers)
            self.prefetch_factor = self.prefetch_factor or (2 if self._auto_workers else None)  # torch's own fails
        if self._auto_workers is None and self._iterable:  # num_workers="auto": start at the CPU/memory bound
            self._auto["num_workers"] = d = workers_for_iterable(self.max_workers)
            self._auto_workers = d["value"]
        workers = self._auto_workers if self._auto_workers is not None else 0
        epoch = self._pass_epoch()  # loaders.dataloader.state: this loader's, or the dataset's next fresh one
        if self.seed is not None:
            self.generator.manual_seed(self.seed + epoch)
        p = Progress(epoch, resume["batches"] if resume else 0, workers)
        self._losses_before = self._dataset_losses()
        self._restore(p, resume)
        self._begin_dataset_pass(epoch)
        self._progress = p
        # torch's iterator is made here, in the main thread (workers forked from the prefetch
        # thread of a CUDA process can abort on CUDA objects they inherit)
        skip = p.batches if not self._iterable else 0
        pins_here = self._pass_pins = self._pins_here(workers)
        p.gate = pass_gate(self, p.batches) if self.device is not None or pins_here else None  # a thread runs ahead
        if self.persistent_workers and self._iterator is not None and dead(self._iterator):  # one died: all go,
            self._drop_persistent()  # new ones start
        transport = self._transport()
        returns, copies = transport
        first = self._torch_iter(workers, p, transport, skip=skip, replay=resume is not None)
        if resume is not None and workers and callable(getattr(self.dataset, "forget_resume", None)):
            self.dataset.forget_resume()  # the workers took it: a later pass over this dataset is a whole epoch
        hold, ahead = pass_plan(copies, workers, persistent=self.persistent_workers, iterable=self._iterable)
        stream = self._epoch_stream(p, first, p.batches, transport, hold)
        if copies is not None:
            stream = unpacked(stream, copies, keep=self.persistent_workers, stock=self._stock,
                              then=hold.send if hold is not None else None,
                              ahead=ahead)
        if self.device is not None and self._prefetcher is None:
            self._prefetcher = DevicePrefetcher(EpochSource(), device=self.device, depth=self._depth)
        if pins_here:
            stream = pinned(stream, self.pin_memory_device or None, returns=returns,
                            keep=self.persistent_workers, copy_stream=getattr(self._prefetcher, "stream", None))
        stream = stream if p.gate is None else p.gate.watched(stream)  # closed as the thread ends
        if self.device is not None:
            self._prefetcher.depth = self._depth
            source = EpochSource()  # this pass's own: its producer thread takes it (passes may overlap)
            source.stream = stream
            self._prefetcher.iterable = source
            stream = iter(self._prefetcher)
        elif pins_here:  # in torch's place: a thread that pins, ``prefetch_depth`` batches ahead
            stream = threaded(stream, depth=self._depth, name="datapipe-pin-memory")
        it = LoaderIterator(self, stream, p)
        if self.device is not None:
            self._threads.add(it, stream.stopper())
        self._active = weakref.ref(it)
        self._live.add(it)
        return it

    def _finish_epoch(self, p: Progress) -> None:
        """The pass ``p`` ran to its end: the next epoch follows; "auto" choices adapt."""
        if p is not self._progress:
            return
        if not self._epoch_forced:  # set_epoch / load_state_dict chose the next pass's epoch since: it holds
            self._epoch, self._tell_dataset = p.epoch + 1, True
        if self._auto_workers_mode or self.prefetch_depth == "auto":
            self._retune(p)

    def _retune(self, p: Progress) -> None:
        """num_workers / prefetch_depth "auto": grow while the consumer kept waiting in pass ``p``."""
        hi = self._auto["num_workers"]["bounds"][1] if self._auto.get("num_workers") else 1
        choice, res = retune(p.stats, workers=self._auto_workers if self._auto_workers_mode else None, workers_hi=hi,
                             depth=self._depth, depth_hi=self._depth_hi,
                             tune_depth=self.prefetch_depth == "auto" and self.device is not None)
        if choice is not None:
            self._depth, self._depth_hi = choice["value"], choice["bounds"][1]
            self._auto["prefetch_depth"] = choice
        if self._auto_workers_mode and res["num_workers"] is not None:
            if res["num_workers"] != self._auto_workers:
                self._drop_persistent()
            self._auto_workers = res["num_workers"]
        if res["prefetch_depth"] is not None:
            self._depth = res["prefetch_depth"]
        self._auto["history"].append({"epoch": p.epoch, **res})

    def close(self) -> None:
        """Stop prefetching, shut every worker down (persistent ones too), free the pinned pool and unmap
        the workers' recycled shared memory."""
        self._close_active()
        self._drop_persistent()
        for it in list(self._live):  # other passes still running side by side (first: a thread may wait on one)
            it.close()
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        if self._returns is not None:  # the prefetch thread has stopped: the workers' segments go
            self._returns.clear()
        if self._raw is not None:
            self._raw.clear()
        self._stock.clear()

    def _close_active(self) -> None:
        """Stop the latest pass (its threads; workers unless persistent), and wait for the threads of those dropped."""
        close_last(self._active)
        self._threads.wait()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
