"""Epochs and checkpoints of ``loaders.DataLoader``: ``set_epoch``, ``state_dict``, ``load_state_dict``,
``global_state_dict``, and how a pass takes a pending resume back.

A mixin of :class:`loaders.dataloader.DataLoader` (it reads and sets the loader's attributes); the
state's shape, its checks and the map-style replay are in :mod:`loaders.dataloader.resume`.
"""
from __future__ import annotations

from datapipe.order import elastic
from loaders.dataloader.progress import Progress
from loaders.dataloader.resume import (as_loadable, check_local, epoch_start, fresh_state, from_global, pass_state,
                                       rank_world, record_order)

__all__ = ["LoaderState"]


class LoaderState:
    """The epoch and state methods of :class:`loaders.dataloader.DataLoader`."""

    _resume_loaded = False  # the last pass loaded a resume into the dataset (spent as the next pass begins)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of this loader's next pass, and of the sampler and dataset if they have ``set_epoch``
        (with ``seed=``: the order of ``seed + epoch``); the passes after it count on from it. A pending resume
        of that epoch is kept; a pass under way or left unfinished is not: the next pass is the whole epoch, and
        ``state_dict()`` says so (its start) from now on."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch={epoch!r}: pass an int >= 0")
        if self._pending is not None and self._pending["epoch"] != epoch:
            self._pending = None
        self._choose_epoch(epoch)
        for obj in (self.sampler, self.dataset):
            set_epoch = getattr(obj, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
        self._tell_dataset = False
        self._ds_epoch_seen = getattr(self.dataset, "epoch", None)

    def _choose_epoch(self, epoch: int) -> None:
        """``epoch`` is the next pass's, whatever ends before it begins: a pass under way that runs to its end after
        this does not move it on (``_finish_epoch``), as ``sampler.set_epoch`` holds in torch."""
        self._epoch, self._epoch_forced = epoch, True

    def _next_epoch(self) -> int:
        """The epoch the next pass runs at. A dataset that counts the passes over it (``begin_pass``:
        ``ShardStream``, ``mix``; :mod:`datapipe.order.shared_epoch`) has the say unless this loader's epoch was
        set (``set_epoch``, ``load_state_dict``): the one it was set to, else the one after the last pass any
        loader began over it. Other datasets: this loader's own count."""
        if self._epoch_forced or not callable(getattr(self.dataset, "begin_pass", None)):
            return self._epoch
        return self.dataset.next_pass_epoch()

    def _pass_epoch(self) -> int:
        """(A pass begins.) Its epoch; a dataset without ``begin_pass`` is told a new one, as before."""
        if callable(getattr(self.dataset, "begin_pass", None)):
            return self._next_epoch()  # told in _begin_dataset_pass, after a resume's dataset state is loaded
        self._sync_dataset_epoch()
        return self._epoch

    def _begin_dataset_pass(self, epoch: int) -> None:
        """The pass at ``epoch`` begins: the dataset moves there and counts it (``begin_pass``)."""
        self._epoch, self._epoch_forced = epoch, False
        begin = getattr(self.dataset, "begin_pass", None)
        if callable(begin):
            begin(epoch)

    def _sync_dataset_epoch(self) -> None:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if not callable(set_epoch):
            return
        current = getattr(self.dataset, "epoch", None)
        if self._tell_dataset and (current is None or current == self._ds_epoch_seen):
            set_epoch(self._epoch)
        self._tell_dataset = False
        self._ds_epoch_seen = getattr(self.dataset, "epoch", None)

    def _restore(self, p: Progress, resume: dict | None) -> None:
        """Record this pass's generator and sampler epoch, or put a pending resume's back (its RNG
        states, sampler epoch and the dataset's state); else note the dataset's state at the epoch's start."""
        self._forget_spent_resume()
        record_order(p.rng, resume, sampler=self.sampler, generator=self.generator)
        if self._protocol and resume is not None and resume.get("dataset") is not None:
            ds = p.workers.resume(resume)
            self._drop_persistent()  # persistent workers hold a stale dataset copy
            self.dataset.load_state_dict(ds)
            self._resume_loaded = True
        elif self._protocol:  # a state before the first batch names the rank and shape (datapipe.order.elastic)
            p.workers.start = epoch_start(self.dataset, p.epoch)

    def _forget_spent_resume(self) -> None:
        """(A pass begins.) A resume the last pass loaded into the dataset was that pass's, read or not: the dataset
        forgets what it may keep of it (a dataset that takes it only as it is read would keep it after a pass never
        read), and persistent workers, whose copies started with it, make way for new ones. So the pass
        after a resumed one is the same with any worker count (``forget_resume``: ``ShardStream``, ``mix``)."""
        if not self._resume_loaded:
            return
        self._resume_loaded = False
        forget = getattr(self.dataset, "forget_resume", None)
        if callable(forget):
            forget()
        self._drop_persistent()

    def state_dict(self) -> dict:
        """Position for exact resume (:mod:`datapipe.state`; the shape: :mod:`loaders.dataloader.resume`):
        ``{"kind", "epoch", "batches", "num_workers", "generator_state", "rng_state",
        "sampler_rng_state", "sampler_generator_state", "sampler_epoch", "base_seed", "dataset"}``.

        What the next pass will do: during a pass with no ``set_epoch`` since it began (read or left unfinished, e.g.
        ``for b in loader: break``), its position after the batches handed out; after ``set_epoch`` (also while the
        unfinished pass's iterator is still read), after a pass ran to its end, or before any pass, the start of the
        next pass's epoch (``batches`` 0, the generator as that pass will find it); after ``load_state_dict``, the
        state loaded, until a pass begins."""
        if self._pending is not None:
            return dict(self._pending.get("global") or self._pending)
        p = self._progress
        # set_epoch since the pass began (_epoch_forced, cleared as a pass begins): the next pass is that epoch's
        # whole, so the state is its start, also while the unfinished pass's iterator is still read
        if p is None or p.epoch != self._epoch or p.finished or self._epoch_forced:
            sampler_epoch = getattr(self.sampler, "epoch", None)  # e.g. a DistributedSampler's, as set_epoch left it
            return fresh_state(self._next_epoch(), self._workers_now(), *self._next_generator_states(),
                               sampler_epoch=sampler_epoch if isinstance(sampler_epoch, int) else None)
        return pass_state(p, protocol=self._protocol)

    def _next_generator_states(self) -> tuple:
        """``(generator_state, sampler_generator_state)`` for the next pass's start: the user's generator as it
        is now (``seed=`` re-seeds its own each pass: none), and also as the sampler finds it where that pass
        reuses persistent workers (no base seed drawn first)."""
        if self.generator is None or self.seed is not None:
            return None, None
        self._threads.wait()  # a pass left unfinished: its thread's draws are settled first (dataloader.end_gate)
        state = self.generator.get_state()
        return state, (state if self.persistent_workers and self._iterator is not None else None)

    def _workers_now(self) -> int:
        return self._auto_workers if self._auto_workers is not None else 0

    def _fixed_workers(self) -> int | None:
        """The worker count a resumed state must match; None under ``num_workers="auto"``."""
        return None if self._auto_workers_mode else self.num_workers

    def global_state_dict(self) -> dict:
        """The state of the whole job: every rank's ``state_dict()``, gathered (``datapipe.order.elastic``).

        A collective under torch.distributed (every rank must call it at the same step; every rank
        gets the global state); without it, this process must be the whole job. ``load_state_dict``
        resumes it on any ``world_size`` and ``num_workers`` (iterable datasets with the worker-state
        protocol whose states name their rank: ``ShardStream``, ``mix``).
        """
        state = self.state_dict()
        if not elastic.is_global(state) and state.get("dataset") is None:
            rank, world = rank_world(self.dataset)  # nothing handed out this epoch: a fresh start of it
            state = {**state, "rank": rank, "world_size": world}
        return elastic.gather_state(state)

    def _load_global(self, state: dict) -> None:
        """Resume a global state (``global_state_dict``): own rank's state on the same shape, else replan."""
        if not self._protocol:
            raise ValueError("a global state resumes only an iterable dataset with the worker-state protocol "
                             "(ShardStream, mix): this loader's dataset has no state_dict/load_state_dict")
        rank, world = rank_world(self.dataset)
        own, replanned = from_global(state, rank=rank, world_size=world, fixed_workers=self._fixed_workers(),
                                     workers_now=self._workers_now())
        self.load_state_dict(own)
        if replanned:
            self._pending["global"] = state

    def load_state_dict(self, state: dict | list[dict]) -> None:
        """Make the next ``iter()`` yield exactly the rest of the saved epoch.

        ``state``: this rank's ``state_dict()`` (same ``num_workers``), or a global state
        (``global_state_dict()``, or the list of every rank's ``state_dict()``) of an iterable
        dataset with the worker-state protocol: on the same shape each rank takes its own state
        back (bit-exact); on another ``world_size`` / ``num_workers`` the dataset plans the epoch's
        undelivered samples over the new shape (see ``datapipe.order.elastic``). A state taken over other
        shards or with another ``seed`` / ``shuffle`` / ``shuffle_buffer`` (a mix: ``weights``) is refused here,
        with a ValueError naming each setting and both values.
        """
        state = as_loadable(state, protocol=self._protocol, fixed_workers=self._fixed_workers())
        check = getattr(self.dataset, "check_loadable", None)
        if self._protocol and callable(check) and isinstance(state, dict) and state.get("dataset") is not None:
            check(state["dataset"])  # refused now, naming what differs, not when the resumed epoch starts
        if elastic.is_global(state):
            self._load_global(state)
            return
        check_local(state, iterable=self._iterable, fixed_workers=self._fixed_workers())
        saved_w = int(state["num_workers"])
        ds = state.get("dataset") if isinstance(state, dict) else None
        if self._auto_workers_mode and state["batches"] > 0 and not elastic.is_global(ds):
            if self._auto_workers != saved_w:
                self._drop_persistent()
            self._auto_workers = saved_w
        self._close_active()
        self._progress = None
        self._choose_epoch(int(state["epoch"]))
        self._tell_dataset = True
        self._ds_epoch_seen = getattr(self.dataset, "epoch", None)
        keep = state["batches"] > 0 or state.get("dataset") or state.get("generator_state") is not None \
            or state.get("sampler_epoch") is not None  # a start of an epoch kept: its sampler's epoch goes back
        self._pending = dict(state) if keep else None
