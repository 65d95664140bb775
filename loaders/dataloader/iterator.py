"""The stream of one ``loaders.DataLoader`` pass: torch's batches tagged ``(batch, meta)`` on the producer
side (the prefetch thread when ``device=`` is set), and the iterator ``iter(loader)`` returns on the
consumer side, which times the consumer, strips the worker state and counts the pass's progress."""
from __future__ import annotations

import collections
import itertools
import weakref
from typing import Any

import torch
from torch.utils.data import BatchSampler
from torch.utils.data._utils.fetch import _IterableDatasetFetcher
from torch.utils.data.dataloader import _InfiniteConstantSampler

from loaders.dataloader.deaths import death, fatal, watch
from loaders.dataloader.progress import Progress, count_samples

__all__ = ["ConstantBatches", "Failed", "EpochSource", "LoaderIterator", "constant_batches", "fast_fetch", "pinned",
           "pins_for_cuda", "tagged_batches", "shutdown"]


class _IterableBatchFetcher(_IterableDatasetFetcher):
    """torch's fetcher of an iterable dataset (same batches, same ``drop_last`` and end), with a batch taken
    from the dataset's iterator in one ``islice`` instead of a Python ``next()`` per sample."""

    def fetch(self, possibly_batched_index):
        if self.ended:
            raise StopIteration
        if not self.auto_collation:
            return self.collate_fn(next(self.dataset_iter))
        n = len(possibly_batched_index)
        data = list(itertools.islice(self.dataset_iter, n))
        if len(data) < n:
            self.ended = True
            if not data or self.drop_last:
                raise StopIteration
        return self.collate_fn(data)


class ConstantBatches:
    """torch's batch sampler of an iterable dataset (``BatchSampler`` over ``_InfiniteConstantSampler``: an
    endless run of ``batch_size`` Nones per batch, which the fetchers only count), one list a batch instead of
    a Python step a sample in the main process."""

    def __init__(self, inner):
        self.inner = inner
        self.batch_size = inner.batch_size
        self.drop_last = inner.drop_last

    def __iter__(self):
        n = self.batch_size
        while True:
            yield [None] * n


def constant_batches(inner):
    """``inner`` (a loader's batch sampler) as :class:`ConstantBatches` where it is torch's own for an iterable
    dataset, else ``inner``."""
    if type(inner) is BatchSampler and type(inner.sampler) is _InfiniteConstantSampler:
        return ConstantBatches(inner)
    return inner


def fast_fetch(it, *, draw_now: bool = False) -> None:
    """Give torch's single-process iterator ``it`` the batch fetcher above (where it holds torch's own
    fetcher of an iterable dataset). ``draw_now`` (a prefetch thread will run ``it``): its sampler's first
    index is drawn here, in the thread that made ``it``, right after its base seed, as torch's iterator
    with workers does; in the thread it would race the draws of a pass made after it from the same
    generator. An error of that draw is raised by the first ``next()``, as torch's would be."""
    fetcher = getattr(it, "_dataset_fetcher", None)
    if type(fetcher) is _IterableDatasetFetcher:
        fetcher.__class__ = _IterableBatchFetcher
    elif draw_now and getattr(it, "_sampler_iter", None) is not None:
        rest = it._sampler_iter
        try:
            first = next(rest)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - raised where torch raises it
            it._sampler_iter = _raising(e)
            return
        it._sampler_iter = itertools.chain((first,), rest)


def _raising(e: Exception):
    raise e
    yield  # a generator: raises at its first next()


class Failed:
    """A batch whose production raised: travels in place of the batch, re-raised by ``next()``."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


def tagged_batches(torch_it, *, protocol: bool, hold=None):
    """Torch's batches as ``(batch, meta)`` (``meta``: the worker state with the worker-state
    protocol, else None); a batch that raises becomes ``(None, Failed)``. A worker that died ends the
    stream with torch's error (:mod:`loaders.dataloader.deaths`). ``hold``: an
    :func:`~loaders.dataloader.unpacking.pass_plan` hold that takes each ``next()``."""
    watch(torch_it)
    box: list = []  # no local keeps the exception: its traceback holds this frame (a cycle)
    while True:
        try:
            item = next(torch_it) if hold is None else hold.next(torch_it)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer, the pass goes on
            box.append(e)
        if box:
            exc = box.pop()
            died = exc if fatal(exc) else death(torch_it, exc)
            if died is not None:  # torch would go on without the dead worker's batches: the pass ends
                try:
                    if died is exc:
                        raise exc
                    raise died from exc
                finally:
                    exc = died = None
            yield None, Failed(exc)
            exc = None
            continue
        yield item if protocol else (item, None)
        item = None


def pins_for_cuda(pin_memory_device: str) -> bool:
    """Whether ``pin_memory=True`` pins for a CUDA device here (torch pins for its current accelerator,
    or for ``pin_memory_device``)."""
    if not torch.cuda.is_available():
        return False
    try:
        return not pin_memory_device or torch.device(pin_memory_device).type == "cuda"
    except RuntimeError:  # a device string torch does not know: torch's pin thread decides
        return False


def pinned(stream, device: str | None = None, *, returns=None, keep: bool = False, copy_stream=None):
    """(Producer thread) ``(batch, meta)`` of ``stream`` with each batch pinned as torch's pin-memory thread
    pins it (``torch.utils.data._utils.pin_memory.pin_memory``: tensors, containers, ``.pin_memory()``
    methods), in this thread.

    A batch from worker processes lives in shared memory, and unmapping it holds up the process's other
    Python threads for ~2 ms (19 MB; docs/internals.md). In torch's pin thread that lands
    whenever a worker's batch arrives, at times right as the training loop wakes from its step's sync.
    Here the unpinned batch is kept until the producer asks for the next one, so it is dropped at the
    producer's paced point, mid-step, whatever the pinning took. A batch whose pinning raises becomes a
    ``Failed`` (as in torch's pin thread: that batch raises, the pass goes on). ``returns`` (a
    :class:`loaders.dataloader.returns.SegmentReturns`): each batch's recycled shared-memory segments go back
    to their workers once it is pinned (or failed), and are dropped at the pass's end unless ``keep``
    (persistent workers reuse them). With ``returns.register``, segments registered for CUDA are not
    copied: the batch goes out in them, and they go back once the copy the consumer (the
    ``DevicePrefetcher``) enqueued on ``copy_stream`` before its next pull has finished.
    """
    from torch.utils.data._utils.pin_memory import pin_memory

    torch.set_num_threads(1)  # as torch's pin thread: the copies use this thread only (per-thread setting)
    box: list = []  # as in tagged_batches: no local keeps the exception
    copying: collections.deque = collections.deque()  # (event, batch) read in place by a copy in flight
    try:
        for batch, meta in stream:
            _give_back_copied(copying, returns, copy_stream)
            raw = batch  # the unpinned batch, alive until the next pull
            direct = False
            if not isinstance(meta, Failed):
                direct = returns is not None and returns.adopt(raw)
                try:
                    batch = pin_memory(batch, device)
                except Exception as e:  # noqa: BLE001 - re-raised by the consumer for this batch
                    box.append(e)
                finally:
                    if returns is not None and (box or not direct):  # copied out (or failed): free again
                        returns.release(raw, adopted=direct)
                if box:
                    batch, meta, direct = None, Failed(box.pop()), False
            if direct:
                copying.append([None, raw])  # its event once the consumer has enqueued the copy
            yield batch, meta
            if direct:  # here, at the consumer's next pull, this batch's copy is enqueued
                copying[-1][0] = copy_stream.record_event()
            raw = batch = meta = None  # here, at the producer's next pull: the shared memory goes now
    finally:
        raw = batch = meta = None
        close = getattr(stream, "close", None)
        if close is not None:
            close()
        _give_back_copied(copying, returns, copy_stream, wait=True)
        if returns is not None and not keep:  # the pass's workers are gone: unmap their segments
            returns.clear()


def _give_back_copied(copying: collections.deque, returns, copy_stream=None, *, wait: bool = False) -> None:
    """Release the batches whose copies have finished, oldest first (``wait``: all, once finished)."""
    while copying:
        done, raw = copying[0]
        if done is None:  # handed out as the pass closed: its copy may have been enqueued
            if not wait:
                break
            copy_stream.synchronize()
        elif wait:
            done.synchronize()
        elif not done.query():
            break
        copying.popleft()
        returns.release(raw, adopted=True)


def shutdown(torch_iter) -> None:
    """Shut the workers of one of torch's iterators down."""
    stop = getattr(torch_iter, "_shutdown_workers", None)
    if stop is not None:
        stop()


class EpochSource:
    """The iterable a loader's DevicePrefetcher re-iterates: the epoch stream set by the loader."""

    def __init__(self):
        self.stream = None

    def __iter__(self):
        stream, self.stream = self.stream, None
        if stream is None:
            raise RuntimeError("loaders.DataLoader: epoch stream consumed twice")
        return stream


class LoaderIterator:
    """What ``iter(loader)`` returns: times the consumer, strips worker state, counts progress."""

    def __init__(self, loader, it, progress: Progress):
        self._loader = loader
        self._it = it
        self._p = progress
        if progress.gate is not None:  # the pass is left once this iterator goes (dataloader.end_gate)
            weakref.finalize(self, progress.gate.release)

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        p = self._p
        if p.finished:
            raise StopIteration
        if p.gate is not None:
            p.gate.ask()
        t0 = p.stats.asked()
        try:
            batch, meta = next(self._it)
        except StopIteration:
            p.stats.over(t0)
            p.finished = True
            self._loader._finish_epoch(p)
            raise
        except BaseException:  # the stream itself broke (not one batch): the pass is over
            p.stats.over(t0)
            p.finished = True
            self.close()
            raise
        p.stats.got(t0)
        p.batches += 1
        if isinstance(meta, Failed):  # like torch: this batch raises, the pass goes on
            # unlink: the prefetch thread may still hold this Failed, and the exception's traceback
            # holds the consumer's frames (a cycle through a live thread is never collected)
            exc, meta.exc, meta = meta.exc, None, None
            try:
                raise exc
            finally:
                exc = None  # no frame <-> traceback cycle: dropping the exception frees the iterator
        loader = self._loader
        p.stats.delivered(batch, count_samples(batch, auto_collation=loader._auto_collation,
                                               batch_size=loader.batch_size))
        if meta is not None:
            p.workers.note(meta)
        return batch

    def close(self) -> None:
        """Stop prefetching and shut the (non-persistent) workers of this iteration down."""
        if self._p.gate is not None:
            self._p.gate.release()
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    def __len__(self) -> int:
        return len(self._loader)
