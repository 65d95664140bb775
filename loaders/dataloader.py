"""Drop-in ``torch.utils.data.DataLoader`` with device prefetch, exact mid-epoch resume, stats, autotune.

``DataLoader(dataset, batch_size, shuffle=..., num_workers=..., device="cuda")`` builds a torch
DataLoader per epoch (cached while the worker count is unchanged) and, with ``device=``, feeds its
batches through :class:`datapipe.DevicePrefetcher`. With ``device=None`` and no autotune it returns
exactly the batches torch returns for the same arguments and
``generator=torch.Generator().manual_seed(seed + epoch)``.

Resume (``state_dict()`` / ``load_state_dict()``):

- map-style: the epoch's sampler order is regenerated (same seed, or the saved generator state when
  you pass ``generator=``) and the consumed batches are skipped in the batch sampler, never loaded.
  A sampler that draws from torch's global RNG (e.g. ``RandomSampler(ds)`` without a generator)
  cannot be regenerated. Per-sample randomness inside workers is not replayed: after a resume
  batch ``n`` runs on worker 0, not on worker ``n % num_workers``.
- iterable datasets with the worker-state protocol (``state_dict()`` / ``load_state_dict()`` on
  the dataset): each batch carries ``(worker_id, dataset.state_dict())`` out of the worker; the
  loader merges them into ``{"epoch", "num_workers", "workers": {...}, "first_worker": k}``, which
  the dataset receives through ``load_state_dict`` before the resumed epoch; it maps physical
  worker ``p`` to logical worker ``(p + k) % num_workers``. Exact with any worker count, including
  exhausted workers, because torch's round-robin over active workers depends only on each
  worker's stream. Not exact with ``in_order=False``.
- other iterable datasets: the consumed batches are produced again and dropped (exact only for a
  dataset that replays the same stream for the same epoch and worker count).
"""
from __future__ import annotations

import math
import gc
import statistics
import time
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from datapipe import autotune
from datapipe.prefetch import DevicePrefetcher, map_tensors, resolve_device

__all__ = ["DataLoader"]

_MP_ONLY = ("prefetch_factor", "persistent_workers", "multiprocessing_context")


class _SkipBatchSampler:
    """Batch sampler wrapper that drops the first ``skip`` index lists without loading them."""

    def __init__(self, inner):
        self.inner = inner
        self.skip = 0

    def __iter__(self):
        it = iter(self.inner)
        for _ in range(self.skip):
            if next(it, None) is None:
                return
        yield from it

    def __len__(self) -> int:
        return len(self.inner)


class _WorkerMeta:
    """What travels with a batch out of a worker: physical worker id and the dataset's state."""

    __slots__ = ("worker_id", "state")

    def __init__(self, worker_id: int, state: dict):
        self.worker_id = worker_id
        self.state = state


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


class _Progress:
    """Position and timing of one epoch's iteration (mutated by the consumer-side iterator)."""

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
        self.started: float | None = None
        self.ended: float | None = None
        self.wait_s = 0.0
        self.consume_s = 0.0
        self.consume_n = 0
        self.finished = False
        self.generator_state = None


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
        except BaseException:
            p.wait_s += time.perf_counter() - t0
            p.ended = time.perf_counter()
            p.finished = True
            self.close()
            raise
        p.wait_s += time.perf_counter() - t0
        p.batches += 1
        p.yielded += 1
        p.samples += self._loader._count(batch)
        if p.yielded == 1:
            p.batch_bytes = autotune.batch_nbytes(batch)
        if meta is not None:
            state = meta.state
            n = max(1, int(state.get("num_workers", p.ds_num_workers)))
            p.ds_num_workers = n
            p.ds_epoch = state.get("epoch", p.ds_epoch)
            p.workers.update(state.get("workers", {}))
            logical = (meta.worker_id + p.first_worker) % n
            p.next_worker = (logical + 1) % n
        self._last = time.perf_counter()
        return batch

    def close(self) -> None:
        """Stop prefetching and shut the workers of this iteration down."""
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    def __len__(self) -> int:
        return len(self._loader)


class DataLoader:
    """``torch.utils.data.DataLoader`` plus ``device=`` prefetch, resumable state, stats, autotune.

    ``num_workers="auto"`` and ``prefetch_depth="auto"`` are chosen from measured rates (see
    :mod:`datapipe.autotune`): a map-style dataset serves its first batches from the main process
    while timing production and the consumer, then continues (same order) with the chosen worker
    count; an iterable dataset starts at the CPU/memory bound. Both grow at epoch boundaries
    while the consumer keeps waiting. ``max_workers`` caps the choice. Every other keyword goes
    to torch's DataLoader unchanged.
    """

    def __init__(self, dataset, batch_size: int | None = 1, *, shuffle: bool | None = False,
                 num_workers: int | str = 0, collate_fn=None, drop_last: bool = False,
                 device: str | torch.device | int | None = None, prefetch_depth: int | str = 2,
                 seed: int = 0, max_workers: int | None = None, **torch_kwargs):
        if num_workers != "auto" and (not isinstance(num_workers, int) or isinstance(num_workers, bool)
                                      or num_workers < 0):
            raise ValueError(f"num_workers={num_workers!r}: pass an int >= 0 or 'auto'")
        if prefetch_depth != "auto" and (not isinstance(prefetch_depth, int)
                                         or isinstance(prefetch_depth, bool) or prefetch_depth < 1):
            raise ValueError(f"prefetch_depth={prefetch_depth!r}: pass an int >= 1 or 'auto'")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed={seed!r}: pass an int")
        if max_workers is not None and (not isinstance(max_workers, int) or max_workers < 1):
            raise ValueError(f"max_workers={max_workers!r}: pass an int >= 1 or None")
        self.device = None if device is None else resolve_device(device)
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.prefetch_depth = prefetch_depth
        self.seed = seed
        self.max_workers = max_workers
        self.drop_last = drop_last
        self._user_generator = torch_kwargs.pop("generator", None)
        self._generator = self._user_generator if self._user_generator is not None else torch.Generator()
        self._kwargs = dict(torch_kwargs)
        if self.device is not None and self.device.type == "cuda":
            # torch's pin-memory thread pins (from its caching host allocator, like torch's own
            # loader); the prefetcher then copies the pinned tensors on its side stream
            self._kwargs["pin_memory"] = True
        check_workers = 1 if num_workers == "auto" else num_workers
        # torch validates the arguments and resolves sampler / batch sampler / collate for us.
        self._plain = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, shuffle=shuffle, num_workers=check_workers,
            collate_fn=collate_fn, drop_last=drop_last, generator=self._generator, **torch_kwargs)
        self.sampler = self._plain.sampler
        self.batch_sampler = self._plain.batch_sampler
        self.collate_fn = self._plain.collate_fn
        self._iterable = isinstance(dataset, IterableDataset)
        self._protocol = self._iterable and callable(getattr(dataset, "state_dict", None)) \
            and callable(getattr(dataset, "load_state_dict", None))
        self._auto_collation = self._plain._auto_collation
        self._skipper = None
        if not self._iterable:
            self._skipper = _SkipBatchSampler(self.batch_sampler if self._auto_collation else self.sampler)
        self._torch_loaders: dict[int, torch.utils.data.DataLoader] = {}
        self._epoch = 0
        self._pending: dict | None = None
        self._progress: _Progress | None = None
        self._active: _LoaderIterator | None = None
        self._prefetcher: DevicePrefetcher | None = None
        self._source = _EpochSource()
        self._auto: dict = {"num_workers": None, "prefetch_depth": None, "history": []}
        self._auto_workers: int | None = None if num_workers == "auto" else num_workers
        self._depth = 2 if prefetch_depth == "auto" else prefetch_depth
        self._depth_hi = 8

    # ---- torch loaders ---------------------------------------------------------------------
    def _torch_loader(self, workers: int) -> torch.utils.data.DataLoader:
        tl = self._torch_loaders.get(workers)
        if tl is not None:
            return tl
        kw = dict(self._kwargs)
        if workers == 0:
            for k in _MP_ONLY:
                kw.pop(k, None)
        kw.pop("sampler", None)
        kw.pop("batch_sampler", None)
        if self._iterable:
            collate = _StatefulCollate(self.collate_fn, self.dataset) if self._protocol else self.collate_fn
            tl = torch.utils.data.DataLoader(
                self.dataset, batch_size=self.batch_size, num_workers=workers, collate_fn=collate,
                drop_last=self.drop_last, generator=self._generator, **kw)
        elif self._auto_collation:
            tl = torch.utils.data.DataLoader(
                self.dataset, batch_sampler=self._skipper, num_workers=workers,
                collate_fn=self.collate_fn, generator=self._generator, **kw)
        else:
            tl = torch.utils.data.DataLoader(
                self.dataset, batch_size=None, sampler=self._skipper, num_workers=workers,
                collate_fn=self.collate_fn, generator=self._generator, **kw)
        self._torch_loaders[workers] = tl
        return tl

    def _drop_torch_loader(self, workers: int) -> None:
        tl = self._torch_loaders.pop(workers, None)
        if tl is not None and getattr(tl, "_iterator", None) is not None:
            _shutdown(tl._iterator)
            tl._iterator = None

    def _iter_torch(self, workers: int, skip: int, gen_state):
        if workers and torch.cuda.is_available() and torch.cuda.is_initialized():
            # free cyclic garbage holding CUDA objects now: a forked worker that collected it
            # would call into CUDA, which aborts a forked child
            gc.collect()
        if self._skipper is not None:
            self._skipper.skip = skip
        self._generator.set_state(gen_state)
        return iter(self._torch_loader(workers))

    # ---- the epoch stream (runs in the prefetch thread when device is set) --------------------
    def _epoch_stream(self, p: _Progress, gen_state, first=None):
        """The epoch's batches. ``first``: the torch iterator, made in the main thread (see __iter__)."""
        torch_it, workers, completed = None, p.num_workers, False
        try:
            if not self._iterable:
                skip = p.batches
                if first is not None:
                    torch_it = first
                    for batch in torch_it:
                        yield batch, None
                elif self._auto_workers is None:
                    torch_it = self._iter_torch(0, skip, gen_state)
                    times = []
                    for _ in range(max(4, self._depth + 3) if self.device is not None else 4):
                        t0 = time.perf_counter()
                        try:
                            batch = next(torch_it)
                        except StopIteration:
                            completed = True
                            return
                        times.append(time.perf_counter() - t0)
                        skip += 1
                        yield batch, None
                    torch_it = None
                    self._decide_workers(times, p)
                    workers = p.num_workers = self._auto_workers
                if first is None:
                    torch_it = self._iter_torch(workers, skip, gen_state)
                    for batch in torch_it:
                        yield batch, None
            else:
                torch_it = first if first is not None else self._iter_torch(workers, 0, gen_state)
                if not self._protocol:
                    for _ in range(p.batches):  # replay: no way to skip without producing
                        if next(torch_it, None) is None:
                            break
                for item in torch_it:
                    if self._protocol:
                        yield item[0], item[1]
                    else:
                        yield item, None
            completed = True
        finally:
            if not completed and torch_it is not None:
                _shutdown(torch_it)
                self._drop_torch_loader(workers)

    def _decide_workers(self, times: list[float], p: _Progress) -> None:
        produce = statistics.median(times[1:]) if len(times) > 1 else (times[0] if times else 0.0)
        consume = p.consume_s / p.consume_n if p.consume_n else None
        d = autotune.choose_num_workers(
            produce_s=produce, consume_s=consume, batch_bytes=p.batch_bytes,
            prefetch_factor=self._kwargs.get("prefetch_factor") or 2, max_workers=self.max_workers)
        self._auto_workers = d["value"]
        self._auto["num_workers"] = d

    # ---- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> _LoaderIterator:
        if self._active is not None and not self._active._p.finished:
            self._active.close()
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
        # generator: the epoch's shuffle order comes from seed + epoch, or the user's generator
        if self._user_generator is None:
            self._generator.manual_seed(self.seed + epoch)
        elif resume is not None and resume.get("generator_state") is not None:
            self._generator.set_state(resume["generator_state"])
        gen_state = self._generator.get_state()
        p.generator_state = gen_state if self._user_generator is not None else None
        for obj in (self.sampler, self.dataset):
            set_epoch = getattr(obj, "set_epoch", None)
            if callable(set_epoch) and not isinstance(obj, torch.utils.data.RandomSampler):
                set_epoch(epoch)
        if self._protocol and resume is not None and resume.get("dataset") is not None:
            ds = resume["dataset"]
            p.workers = dict(ds.get("workers", {}))
            p.first_worker = p.next_worker = int(ds.get("first_worker", 0))
            p.ds_num_workers = max(1, int(ds.get("num_workers", 1)))
            p.ds_epoch = ds.get("epoch")
            self._drop_torch_loader(workers)  # persistent workers hold a stale dataset copy
            self.dataset.load_state_dict(ds)
        self._progress = p
        first = None
        if self.device is not None and self.device.type == "cuda" and (self._iterable or self._auto_workers is not None):
            # fork the workers here, in the main thread: forking from the prefetch thread of a process
            # that uses CUDA leaves workers that can abort on CUDA objects they inherit
            first = self._iter_torch(p.num_workers, 0 if self._iterable else p.batches, gen_state)
        stream = self._epoch_stream(p, gen_state, first)
        if self.device is not None:
            if self._prefetcher is None:
                self._prefetcher = DevicePrefetcher(self._source, device=self.device, depth=self._depth)
            self._prefetcher.depth = self._depth
            self._source.stream = stream
            stream = iter(self._prefetcher)
        self._active = _LoaderIterator(self, stream, p)
        return self._active

    def _finish_epoch(self, p: _Progress) -> None:
        if p is not self._progress:
            return
        self._epoch = p.epoch + 1
        if self.num_workers != "auto" and self.prefetch_depth != "auto":
            return
        elapsed = (p.ended or time.perf_counter()) - (p.started or 0.0)
        if self.prefetch_depth == "auto" and self.device is not None and p.batch_bytes:
            d = autotune.choose_depth(batch_bytes=p.batch_bytes, start=self._depth)
            self._depth_hi = d["bounds"][1]
            self._depth = d["value"]
            self._auto["prefetch_depth"] = d
        hi = self._auto["num_workers"]["bounds"][1] if self._auto.get("num_workers") else 1
        res = autotune.adapt(
            num_workers=self._auto_workers if self.num_workers == "auto" else None, workers_hi=hi,
            depth=self._depth if (self.prefetch_depth == "auto" and self.device is not None) else None,
            depth_hi=self._depth_hi, batches=p.yielded, elapsed_s=elapsed, wait_s=p.wait_s)
        if self.num_workers == "auto" and res["num_workers"] is not None:
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

    def __len__(self) -> int:
        return len(self._plain)

    # ---- epochs and state ----------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Use ``seed + epoch`` for the next iteration (a pending resume of that epoch is kept)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch={epoch!r}: pass an int >= 0")
        if self._pending is not None and self._pending["epoch"] != epoch:
            self._pending = None
        self._epoch = epoch

    def state_dict(self) -> dict:
        """Position for exact resume: ``{"epoch", "batches", "num_workers", "generator_state", "dataset"}``."""
        if self._pending is not None:
            return dict(self._pending)
        p = self._progress
        if p is None or p.epoch != self._epoch or p.finished:
            return {"epoch": self._epoch, "batches": 0, "num_workers": self._workers_now(),
                    "generator_state": None, "dataset": None}
        ds = None
        if self._protocol:
            ds = {"epoch": p.ds_epoch if p.ds_epoch is not None else p.epoch,
                  "num_workers": p.ds_num_workers, "workers": dict(p.workers),
                  "first_worker": p.next_worker}
        return {"epoch": p.epoch, "batches": p.batches, "num_workers": p.num_workers,
                "generator_state": p.generator_state, "dataset": ds}

    def _workers_now(self) -> int:
        return self._auto_workers if self._auto_workers is not None else 0

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``iter()`` yield exactly the rest of the saved epoch."""
        missing = {"epoch", "batches", "num_workers"} - set(state)
        if missing:
            raise ValueError(f"not a loaders.DataLoader state (missing {sorted(missing)}); pass what state_dict() returned")
        saved_w = int(state["num_workers"])
        if self.num_workers != "auto" and self._iterable and state["batches"] > 0 \
                and max(1, saved_w) != max(1, self.num_workers):
            raise ValueError(
                f"state was saved with num_workers={saved_w}, this loader has num_workers={self.num_workers}: "
                "an iterable dataset's per-worker streams only resume with the same worker count")
        if self.num_workers == "auto" and state["batches"] > 0:
            self._auto_workers = saved_w
        if self._active is not None and not self._active._p.finished:
            self._active.close()
        self._progress = None
        self._epoch = int(state["epoch"])
        self._pending = dict(state) if (state["batches"] > 0 or state.get("dataset")) else None

    def stats(self) -> dict:
        """Throughput and data-wait of the current (or last) iteration plus the autotune choices."""
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
        """Stop prefetching, shut every worker down and free the pinned pool."""
        if self._active is not None:
            self._active.close()
        for w in list(self._torch_loaders):
            self._drop_torch_loader(w)
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
