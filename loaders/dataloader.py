"""``torch.utils.data.DataLoader`` subclass with device prefetch, exact mid-epoch resume, stats, autotune.

``DataLoader`` *is* a torch DataLoader (same signature, attributes, assign-after-init rules and
iterators: torch's own ``_get_iterator`` runs the sampler and the workers), with layers on top:
``device=`` feeds batches through :class:`datapipe.DevicePrefetcher`; ``state_dict()`` /
``load_state_dict()``; ``stats()``; ``num_workers="auto"``. With ``device=None`` it returns exactly
the batches torch returns for the same arguments and the same RNG state.

Seeding: like torch, without ``generator=`` the shuffle order and the workers' base seed come from
torch's global RNG (so ``torch.manual_seed`` changes them and every pass differs). ``seed=s``
instead re-seeds a private generator with ``s + epoch`` at every pass.

Resume (``state_dict()`` / ``load_state_dict()``):

- map-style: the global RNG states that torch drew the pass's seeds from (or the generator's
  state) are recorded, so the resumed pass regenerates the same sampler order; the consumed
  batches are skipped in the index sampler, never loaded. ``sampler.epoch`` (e.g. a
  ``DistributedSampler``'s) is recorded and restored. Per-sample randomness inside workers is not
  replayed: after a resume batch ``n`` runs on worker 0, not on worker ``n % num_workers``.
- iterable datasets with the worker-state protocol (``state_dict()`` / ``load_state_dict()`` on
  the dataset): each batch carries ``(worker_id, dataset.state_dict())`` out of the worker; the
  loader merges them into ``{"epoch", "num_workers", "workers": {...}, "first_worker": k}``, which
  the dataset receives through ``load_state_dict`` before the resumed epoch; it maps physical
  worker ``p`` to logical worker ``(p + k) % num_workers``. Exact with any worker count, including
  exhausted workers, because torch's round-robin over active workers depends only on each
  worker's stream. Not exact with ``in_order=False``.
- other iterable datasets: the consumed batches are produced again and dropped (exact only for a
  dataset that replays the same stream for the same epoch and worker count).

Epochs: a finished pass advances the loader's epoch; a dataset with ``set_epoch`` (``ShardStream``)
is told the new epoch before the next pass unless someone else changed its ``epoch`` meanwhile.
Samplers are left alone, as torch does (call ``sampler.set_epoch`` yourself, or ``dl.set_epoch``).
"""
from __future__ import annotations

import gc
import math
import statistics
import time
import weakref
from typing import Any, TypeVar

import torch
import torch.utils.data as tud
from torch.utils.data import IterableDataset, get_worker_info

from datapipe.device import autotune
from datapipe.order import elastic
from datapipe.device.prefetch import DevicePrefetcher, map_tensors, resolve_device
from datapipe.state import check_state

__all__ = ["DataLoader"]

KIND = "DataLoader"  # the "kind" of its states (datapipe.state)

_END = object()
_T_co = TypeVar("_T_co", covariant=True)


class _WorkerMeta:
    """What travels with a batch out of a worker: physical worker id and the dataset's state."""

    __slots__ = ("worker_id", "state")

    def __init__(self, worker_id: int, state: dict):
        self.worker_id = worker_id
        self.state = state


class _Failed:
    """A batch whose production raised: travels in place of the batch, re-raised by ``next()``."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class _StatefulCollate:
    """collate_fn wrapper: returns ``(batch, _WorkerMeta(worker_id, dataset.state_dict()))``."""

    def __init__(self, collate, dataset):
        self.collate = collate
        self._dataset = dataset  # used only in the main process (num_workers=0)

    def __getstate__(self):
        return {"collate": self.collate, "_dataset": None}

    def __call__(self, samples):
        batch = self.collate(samples)
        info = get_worker_info()
        if info is None:
            return batch, _WorkerMeta(0, self._dataset.state_dict())
        return batch, _WorkerMeta(info.id, info.dataset.state_dict())


class _Plan:
    """How the next ``iter()`` of the index sampler runs: batches to skip, RNG state to replay."""

    __slots__ = ("skip", "replay", "progress")

    def __init__(self, skip=0, replay=None, progress=None):
        self.skip, self.replay, self.progress = skip, replay, progress


class _IndexSampler:
    """The loader's ``_index_sampler``: torch's, skipping consumed batches and recording/replaying
    the global RNG state of its first draw (where ``RandomSampler`` draws its seed)."""

    def __init__(self, loader: DataLoader, inner):
        self._loader = weakref.ref(loader)
        self.inner = inner

    def __iter__(self):
        loader = self._loader()  # torch may call iter() twice while making one iterator
        plan = loader._plan if loader is not None else _Plan()
        return self._run(iter(self.inner), plan)

    @staticmethod
    def _run(it, plan: _Plan):
        if plan.replay is not None:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(plan.replay)
                first = next(it, _END)
        else:
            if plan.progress is not None:
                plan.progress.sampler_rng = torch.get_rng_state()
            first = next(it, _END)
        if first is _END:
            return
        if plan.skip == 0:
            yield first
        for _ in range(plan.skip - 1):
            if next(it, _END) is _END:
                return
        yield from it

    def __len__(self) -> int:
        return len(self.inner)


class _Progress:
    """Position and timing of one pass (mutated by the consumer-side iterator)."""

    def __init__(self, epoch: int, batches: int, num_workers: int):
        self.epoch = epoch
        self.batches = batches  # position in the epoch, skipped ones included
        self.num_workers = num_workers
        self.yielded = 0
        self.samples = 0
        self.batch_bytes = 0
        self.workers: dict = {}
        self.first_worker = 0  # logical worker of physical worker 0 in this run
        self.next_worker = 0
        self.ds_epoch = None
        self.ds_num_workers = max(1, num_workers)
        self.ds_last: dict | None = None  # the last worker state seen (rank, shape, seed, plan basis...)
        self.resumed_from: dict | None = None  # a global state loaded, until this pass's first batch
        self.started: float | None = None
        self.ended: float | None = None
        self.wait_s = 0.0
        self.consume_s = 0.0
        self.consume_n = 0
        self.finished = False
        self.generator_state = None
        self.rng_state = None  # global RNG before the torch iterator was made (base seed)
        self.sampler_rng = None  # global RNG before the sampler's first draw
        self.sampler_epoch = None
        self.base_seed = None


class _EpochSource:
    """The iterable a loader's DevicePrefetcher re-iterates: the epoch stream set by the loader."""

    def __init__(self):
        self.stream = None

    def __iter__(self):
        stream, self.stream = self.stream, None
        if stream is None:
            raise RuntimeError("loaders.DataLoader: epoch stream consumed twice")
        return stream


def _shutdown(torch_iter) -> None:
    stop = getattr(torch_iter, "_shutdown_workers", None)
    if stop is not None:
        stop()


class _LoaderIterator:
    """What ``iter(loader)`` returns: times the consumer, strips worker state, counts progress."""

    def __init__(self, loader: DataLoader, it, progress: _Progress):
        self._loader = loader
        self._it = it
        self._p = progress
        self._last: float | None = None

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        p = self._p
        if p.finished:
            raise StopIteration
        t0 = time.perf_counter()
        if p.started is None:
            p.started = t0
        if self._last is not None:
            p.consume_s += t0 - self._last
            p.consume_n += 1
        try:
            batch, meta = next(self._it)
        except StopIteration:
            p.wait_s += time.perf_counter() - t0
            p.ended = time.perf_counter()
            p.finished = True
            self._loader._finish_epoch(p)
            raise
        except BaseException:  # the stream itself broke (not one batch): the pass is over
            p.wait_s += time.perf_counter() - t0
            p.ended = time.perf_counter()
            p.finished = True
            self.close()
            raise
        p.wait_s += time.perf_counter() - t0
        p.batches += 1
        self._last = time.perf_counter()
        if isinstance(meta, _Failed):  # like torch: this batch raises, the pass goes on
            # unlink: the prefetch thread may still hold this _Failed, and the exception's traceback
            # holds the consumer's frames (a cycle through a live thread is never collected)
            exc, meta.exc, meta = meta.exc, None, None
            try:
                raise exc
            finally:
                exc = None  # no frame <-> traceback cycle: dropping the exception frees the iterator
        p.yielded += 1
        p.samples += self._loader._count(batch)
        if p.yielded == 1:
            p.batch_bytes = autotune.batch_nbytes(batch)
        if meta is not None:
            state = meta.state
            n = max(1, int(state.get("num_workers", p.ds_num_workers)))
            p.ds_num_workers = n
            p.ds_epoch = state.get("epoch", p.ds_epoch)
            p.ds_last = state
            p.workers.update(state.get("workers", {}))
            logical = (meta.worker_id + p.first_worker) % n
            p.next_worker = (logical + 1) % n
        return batch

    def close(self) -> None:
        """Stop prefetching and shut the (non-persistent) workers of this iteration down."""
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    def __len__(self) -> int:
        return len(self._loader)


class DataLoader(tud.DataLoader[_T_co]):
    """``torch.utils.data.DataLoader`` plus ``device=`` prefetch, resumable state, stats, autotune.

    Positional and keyword arguments are torch's; ours are keyword-only: ``device``,
    ``prefetch_depth``, ``seed`` (``None``: torch's seeding) and ``max_workers``.
    ``num_workers="auto"`` and ``prefetch_depth="auto"`` are chosen from measured rates (see
    :mod:`datapipe.device.autotune`): a map-style dataset serves its first batches from the main process
    while timing production and the consumer, then continues (same order) with the chosen worker
    count; an iterable dataset starts at the CPU/memory bound. Both grow at epoch boundaries
    while the consumer keeps waiting. ``max_workers`` caps the choice. ``num_workers`` holds the
    worker count in use.
    """

    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int | str = 0, collate_fn=None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn=None, multiprocessing_context=None,
                 generator=None, *, prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True,
                 device: str | torch.device | int | None = None, prefetch_depth: int | str = 2,
                 seed: int | None = None, max_workers: int | None = None):
        auto = num_workers == "auto"
        if not auto and (not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0):
            raise ValueError(f"num_workers={num_workers!r}: pass an int >= 0 or 'auto'")
        if prefetch_depth != "auto" and (not isinstance(prefetch_depth, int)
                                         or isinstance(prefetch_depth, bool) or prefetch_depth < 1):
            raise ValueError(f"prefetch_depth={prefetch_depth!r}: pass an int >= 1 or 'auto'")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed={seed!r}: pass an int or None (torch's global RNG)")
        if max_workers is not None and (not isinstance(max_workers, int) or max_workers < 1):
            raise ValueError(f"max_workers={max_workers!r}: pass an int >= 1 or None")
        dev = None if device is None else resolve_device(device)
        if dev is not None and dev.type == "cuda":
            # torch's pin-memory thread pins (from its caching host allocator, like torch's own
            # loader); the prefetcher then copies the pinned tensors on its side stream
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
        self.prefetch_depth = prefetch_depth
        self.seed = seed
        self.max_workers = max_workers
        self._auto_workers_mode = auto
        self._iterable = isinstance(dataset, IterableDataset)
        self._protocol = self._iterable and callable(getattr(dataset, "state_dict", None)) \
            and callable(getattr(dataset, "load_state_dict", None))
        self._plan = _Plan()
        self._index_wrapper: _IndexSampler | None = None
        self._epoch = 0
        self._tell_dataset = False  # the epoch moved on: tell the dataset before the next pass
        self._ds_epoch_seen = None
        self._pending: dict | None = None
        self._progress: _Progress | None = None
        self._active = None  # weakref to the latest _LoaderIterator
        self._prefetcher: DevicePrefetcher | None = None
        self._source = _EpochSource()
        self._auto: dict = {"num_workers": None, "prefetch_depth": None, "history": []}
        self._auto_workers: int | None = None if auto else num_workers
        self.num_workers = self._auto_workers or 0
        self._depth = 2 if prefetch_depth == "auto" else prefetch_depth
        self._depth_hi = 8

    # ---- torch hooks -------------------------------------------------------------------------
    @property
    def _index_sampler(self):
        inner = super()._index_sampler
        if self._iterable:
            return inner
        w = self._index_wrapper
        if w is None or w.inner is not inner:
            w = self._index_wrapper = _IndexSampler(self, inner)
        return w

    def _torch_iter(self, workers: int, p: _Progress, *, skip: int = 0, replay: bool = False):
        """One of torch's iterators (``super().__iter__``: persistent workers reused as torch does)."""
        if workers and torch.cuda.is_available() and torch.cuda.is_initialized():
            # free cyclic garbage holding CUDA objects now: a forked worker that collected it
            # would call into CUDA, which aborts a forked child
            gc.collect()
        self.num_workers = workers
        self._plan = _Plan(skip, p.sampler_rng if replay else None, p)
        if p.generator_state is not None and self.generator is not None:
            self.generator.set_state(p.generator_state)
        collate = self.collate_fn
        if self._protocol:
            self.collate_fn = _StatefulCollate(collate, self.dataset)
        try:
            if replay and p.rng_state is not None:
                with torch.random.fork_rng(devices=[]):
                    torch.set_rng_state(p.rng_state)
                    it = super().__iter__()
            else:
                p.rng_state = torch.get_rng_state()
                it = super().__iter__()
        finally:
            self.collate_fn = collate
            self._plan = _Plan()
        p.base_seed = getattr(it, "_base_seed", None)
        return it

    def _drop_persistent(self) -> None:
        if self._iterator is not None:
            _shutdown(self._iterator)
            self._iterator = None

    # ---- the epoch stream (runs in the prefetch thread when device is set) --------------------
    def _batches(self, torch_it):
        """Torch's batches as ``(batch, meta)``; a batch that raises becomes ``(None, _Failed)``."""
        box: list = []  # no local keeps the exception: its traceback holds this frame (a cycle)
        while True:
            try:
                item = next(torch_it)
            except StopIteration:
                return
            except Exception as e:  # noqa: BLE001 - re-raised by the consumer, the pass goes on
                box.append(e)
            if box:
                yield None, _Failed(box.pop())
                continue
            yield item if self._protocol else (item, None)
            item = None

    def _epoch_stream(self, p: _Progress, first, start: int):
        """The pass's batches from position ``start``. ``first``: the torch iterator, made in the main
        thread (see __iter__)."""
        torch_it, completed = first, False
        try:
            if not self._iterable and self._auto_workers is None:
                times, stream = [], self._batches(torch_it)
                for _ in range(max(4, self._depth + 3) if self.device is not None else 4):
                    t0 = time.perf_counter()
                    item = next(stream, _END)
                    if item is _END:
                        completed = True
                        return
                    times.append(time.perf_counter() - t0)
                    yield item
                skip = start + len(times)
                torch_it = None
                self._decide_workers(times, p)
                p.num_workers = self._auto_workers
                torch_it = self._torch_iter(p.num_workers, p, skip=skip, replay=True)
            elif self._iterable and not self._protocol:
                for _ in range(start):  # replay: no way to skip without producing
                    if next(torch_it, _END) is _END:
                        break
            yield from self._batches(torch_it)
            completed = True
        finally:
            if not completed and torch_it is not None and torch_it is not self._iterator:
                _shutdown(torch_it)

    def _decide_workers(self, times: list[float], p: _Progress) -> None:
        produce = statistics.median(times[1:]) if len(times) > 1 else (times[0] if times else 0.0)
        consume = p.consume_s / p.consume_n if p.consume_n else None
        d = autotune.choose_num_workers(
            produce_s=produce, consume_s=consume, batch_bytes=p.batch_bytes,
            prefetch_factor=self.prefetch_factor or 2, max_workers=self.max_workers)
        self._auto_workers = d["value"]
        self._auto["num_workers"] = d

    # ---- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> _LoaderIterator:
        resume, self._pending = self._pending, None
        epoch = self._epoch
        if self._auto_workers is None and self._iterable:
            d = autotune.choose_num_workers(produce_s=0.0, consume_s=None, batch_bytes=0,
                                            max_workers=self.max_workers)
            d["reason"] = "iterable dataset, consumer rate unknown before training: " + d["reason"]
            self._auto_workers = d["value"]
            self._auto["num_workers"] = d
        workers = self._auto_workers if self._auto_workers is not None else 0
        p = _Progress(epoch, resume["batches"] if resume else 0, workers)
        if self.seed is not None:
            self.generator.manual_seed(self.seed + epoch)
        self._sync_dataset_epoch()
        if resume is not None:
            p.generator_state = resume.get("generator_state")
            p.rng_state = resume.get("rng_state")
            p.sampler_rng = resume.get("sampler_rng_state")
            if resume.get("sampler_epoch") is not None and callable(getattr(self.sampler, "set_epoch", None)):
                self.sampler.set_epoch(resume["sampler_epoch"])
        elif self.generator is not None:
            p.generator_state = self.generator.get_state()
        p.sampler_epoch = getattr(self.sampler, "epoch", None)
        if self._protocol and resume is not None and resume.get("dataset") is not None:
            ds = resume["dataset"]
            if elastic.is_global(ds):  # replanned over this shape: the workers start their new runs
                p.resumed_from = resume.get("global") or resume
            else:
                p.workers = dict(ds.get("workers", {}))
                p.first_worker = p.next_worker = int(ds.get("first_worker", 0))
                p.ds_num_workers = max(1, int(ds.get("num_workers", 1)))
                p.ds_last = {k: v for k, v in ds.items() if k not in ("workers", "first_worker")}
            p.ds_epoch = ds.get("epoch")
            self._drop_persistent()  # persistent workers hold a stale dataset copy
            self.dataset.load_state_dict(ds)
        self._progress = p
        # torch's iterator is made here, in the main thread (workers forked from the prefetch
        # thread of a CUDA process can abort on CUDA objects they inherit)
        skip = p.batches if not self._iterable else 0
        first = self._torch_iter(workers, p, skip=skip, replay=resume is not None)
        stream = self._epoch_stream(p, first, p.batches)
        if self.device is not None:
            if self._prefetcher is None:
                self._prefetcher = DevicePrefetcher(self._source, device=self.device, depth=self._depth)
            self._prefetcher.depth = self._depth
            self._source.stream = stream
            stream = iter(self._prefetcher)
        it = _LoaderIterator(self, stream, p)
        self._active = weakref.ref(it)
        return it

    def _sync_dataset_epoch(self) -> None:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if not callable(set_epoch):
            return
        current = getattr(self.dataset, "epoch", None)
        if self._tell_dataset and (current is None or current == self._ds_epoch_seen):
            set_epoch(self._epoch)
        self._tell_dataset = False
        self._ds_epoch_seen = getattr(self.dataset, "epoch", None)

    def _finish_epoch(self, p: _Progress) -> None:
        if p is not self._progress:
            return
        self._epoch = p.epoch + 1
        self._tell_dataset = True
        if not self._auto_workers_mode and self.prefetch_depth != "auto":
            return
        elapsed = (p.ended or time.perf_counter()) - (p.started or 0.0)
        if self.prefetch_depth == "auto" and self.device is not None and p.batch_bytes:
            d = autotune.choose_depth(batch_bytes=p.batch_bytes, start=self._depth)
            self._depth_hi = d["bounds"][1]
            self._depth = d["value"]
            self._auto["prefetch_depth"] = d
        hi = self._auto["num_workers"]["bounds"][1] if self._auto.get("num_workers") else 1
        res = autotune.adapt(
            num_workers=self._auto_workers if self._auto_workers_mode else None, workers_hi=hi,
            depth=self._depth if (self.prefetch_depth == "auto" and self.device is not None) else None,
            depth_hi=self._depth_hi, batches=p.yielded, elapsed_s=elapsed, wait_s=p.wait_s)
        if self._auto_workers_mode and res["num_workers"] is not None:
            if res["num_workers"] != self._auto_workers:
                self._drop_persistent()
            self._auto_workers = res["num_workers"]
        if res["prefetch_depth"] is not None:
            self._depth = res["prefetch_depth"]
        self._auto["history"].append({"epoch": p.epoch, **res})

    def _count(self, batch) -> int:
        if not self._auto_collation:
            return 1
        found = []

        def first(t):
            if not found:
                found.append(t)
            return t

        map_tensors(first, batch)
        if found and found[0].dim() > 0:
            return int(found[0].shape[0])
        if isinstance(batch, (list, tuple)) and batch and not found:
            return len(batch)
        return self.batch_size or 1

    # ---- epochs and state ----------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next pass, and of the sampler and dataset if they have ``set_epoch``
        (with ``seed=``: the order of ``seed + epoch``). A pending resume of that epoch is kept."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch={epoch!r}: pass an int >= 0")
        if self._pending is not None and self._pending["epoch"] != epoch:
            self._pending = None
        self._epoch = epoch
        for obj in (self.sampler, self.dataset):
            set_epoch = getattr(obj, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
        self._tell_dataset = False
        self._ds_epoch_seen = getattr(self.dataset, "epoch", None)

    def state_dict(self) -> dict:
        """Position for exact resume (:mod:`datapipe.state`): ``{"kind", "epoch", "batches", "num_workers", "generator_state",
        "rng_state", "sampler_rng_state", "sampler_epoch", "base_seed", "dataset"}``."""
        if self._pending is not None:
            return dict(self._pending.get("global") or self._pending)
        p = self._progress
        if p is None or p.epoch != self._epoch or p.finished:
            return {"kind": KIND, "epoch": self._epoch, "batches": 0, "num_workers": self._workers_now(),
                    "generator_state": None, "rng_state": None, "sampler_rng_state": None,
                    "sampler_epoch": None, "base_seed": None, "dataset": None}
        if p.resumed_from is not None and p.ds_last is None:  # a global state loaded, no batch since
            return dict(p.resumed_from)
        ds = None
        if self._protocol:
            # every key of the last worker state (rank, world_size, seed, shuffle_buffer, total,
            # generation, base: what an elastic resume needs), the merged worker positions on top
            ds = {**(p.ds_last or {}), "epoch": p.ds_epoch if p.ds_epoch is not None else p.epoch,
                  "num_workers": p.ds_num_workers, "workers": dict(p.workers),
                  "first_worker": p.next_worker}
        return {"kind": KIND, "epoch": p.epoch, "batches": p.batches, "num_workers": p.num_workers,
                "generator_state": p.generator_state, "rng_state": p.rng_state,
                "sampler_rng_state": p.sampler_rng, "sampler_epoch": p.sampler_epoch,
                "base_seed": p.base_seed, "dataset": ds}

    def _workers_now(self) -> int:
        return self._auto_workers if self._auto_workers is not None else 0

    def global_state_dict(self) -> dict:
        """The state of the whole job: every rank's ``state_dict()``, gathered (``datapipe.order.elastic``).

        A collective under torch.distributed (every rank must call it at the same step; every rank
        gets the global state); without it, this process must be the whole job. ``load_state_dict``
        resumes it on any ``world_size`` and ``num_workers`` (iterable datasets with the worker-state
        protocol whose states name their rank: ``ShardStream``, ``mix``).
        """
        state = self.state_dict()
        if not elastic.is_global(state) and state.get("dataset") is None:
            rank, world = self._rank_world()  # nothing handed out this epoch: a fresh start of it
            state = {**state, "rank": rank, "world_size": world}
        return elastic.gather_state(state)

    def _rank_world(self) -> tuple[int, int]:
        own = getattr(self.dataset, "_rank_world", None) or getattr(getattr(self.dataset, "stream", None),
                                                                    "_rank_world", None)
        if callable(own):
            return own()
        from datapipe.stream import default_rank_world

        return default_rank_world()

    def _load_global(self, state: dict) -> None:
        """Resume a global state (``global_state_dict``): own rank's state on the same shape, else replan."""
        if not self._protocol:
            raise ValueError("a global state resumes only an iterable dataset with the worker-state protocol "
                             "(ShardStream, mix): this loader's dataset has no state_dict/load_state_dict")
        ranks = state["ranks"]
        rank, world = self._rank_world()
        saved_w = {max(1, int(r["num_workers"])) for r in ranks}
        if world == state["world_size"] and (self._auto_workers_mode or saved_w == {max(1, self.num_workers)}):
            own = {k: v for k, v in ranks[rank].items() if k not in ("rank", "world_size")} \
                if ranks[rank].get("dataset") is None else ranks[rank]
            self.load_state_dict(own)  # the same shape: bit-exact
            return
        datasets = [r.get("dataset") for r in ranks]
        if all(d is None for d in datasets):  # nobody had handed anything out: the epoch from its start
            self.load_state_dict({"epoch": int(state["epoch"]), "batches": 0, "num_workers": self._workers_now()})
            return
        if any(d is None for d in datasets):
            raise ValueError("the rank states of this global state disagree: some ranks had finished or not started "
                             "the epoch; take the global state at a step every rank has reached")
        ds = elastic.merge_states(datasets)
        self.load_state_dict({"epoch": int(state["epoch"]), "batches": 0, "num_workers": self._workers_now(),
                              "generator_state": None, "rng_state": None, "sampler_rng_state": None,
                              "sampler_epoch": None, "base_seed": None, "dataset": ds})
        self._pending["global"] = state

    def load_state_dict(self, state: dict | list[dict]) -> None:
        """Make the next ``iter()`` yield exactly the rest of the saved epoch.

        ``state``: this rank's ``state_dict()`` (same ``num_workers``), or a global state
        (``global_state_dict()``, or the list of every rank's ``state_dict()``) of an iterable
        dataset with the worker-state protocol: on the same shape each rank takes its own state
        back (bit-exact); on another ``world_size`` / ``num_workers`` the dataset plans the epoch's
        undelivered samples over the new shape (see ``datapipe.order.elastic``).
        """
        if isinstance(state, (list, tuple)):
            state = elastic.merge_states(list(state))
        ds = state.get("dataset") if isinstance(state, dict) else None
        if not elastic.is_global(state) and self._protocol and isinstance(ds, dict) and not elastic.is_global(ds) \
                and ds.get("world_size") == 1 and ds.get("rank") == 0 and not self._auto_workers_mode \
                and max(1, int(state.get("num_workers", 0))) != max(1, self.num_workers):
            state = elastic.merge_states([state])  # one rank was the whole job: resume it on this worker count
        if elastic.is_global(state):
            self._load_global(state)
            return
        check_state(state, KIND)
        missing = {"epoch", "batches", "num_workers"} - set(state)
        if missing:
            raise ValueError(f"not a loaders.DataLoader state (missing {sorted(missing)}); pass what state_dict() returned")
        saved_w = int(state["num_workers"])
        if not self._auto_workers_mode and self._iterable and state["batches"] > 0 \
                and max(1, saved_w) != max(1, self.num_workers) and not elastic.is_global(ds):
            raise ValueError(
                f"state was saved with num_workers={saved_w}, this loader has num_workers={self.num_workers}: "
                "an iterable dataset's per-worker streams only resume with the same worker count; "
                "global states (global_state_dict(), or the list of every rank's state_dict()) resume on any")
        if self._auto_workers_mode and state["batches"] > 0 and not elastic.is_global(ds):
            if self._auto_workers != saved_w:
                self._drop_persistent()
            self._auto_workers = saved_w
        active = self._active() if self._active is not None else None
        if active is not None and not active._p.finished:
            active.close()
        self._progress = None
        self._epoch = int(state["epoch"])
        self._tell_dataset = True
        self._ds_epoch_seen = getattr(self.dataset, "epoch", None)
        self._pending = dict(state) if (state["batches"] > 0 or state.get("dataset")) else None

    def stats(self) -> dict:
        """Throughput and data-wait of the current (or last) pass plus the autotune choices."""
        p = self._progress
        out = {"epoch": self._epoch, "samples": 0, "batches": 0, "elapsed_s": 0.0, "samples_per_s": 0.0,
               "batches_per_s": 0.0, "wait_s": 0.0, "wait_fraction": 0.0, "batch_bytes": 0,
               "num_workers": self._workers_now(), "prefetch_depth": self._depth if self.device else None,
               "autotune": {k: v for k, v in self._auto.items()}}
        if p is None or p.started is None:
            return out
        elapsed = (p.ended if p.ended is not None else time.perf_counter()) - p.started
        out.update(epoch=p.epoch, samples=p.samples, batches=p.yielded, elapsed_s=elapsed,
                   wait_s=p.wait_s, batch_bytes=p.batch_bytes, num_workers=p.num_workers,
                   samples_per_s=p.samples / elapsed if elapsed > 0 else 0.0,
                   batches_per_s=p.yielded / elapsed if elapsed > 0 else 0.0,
                   wait_fraction=min(1.0, p.wait_s / elapsed) if elapsed > 0 else 0.0)
        if self._prefetcher is not None:
            out["pinned_pool"] = self._prefetcher.pool_stats()
        if not math.isfinite(out["samples_per_s"]):
            out["samples_per_s"] = 0.0
        return out

    def close(self) -> None:
        """Stop prefetching, shut every worker down (persistent ones too) and free the pinned pool."""
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._drop_persistent()
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
