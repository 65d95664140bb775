"""Device prefetch: nested batches -> reused pinned host buffers -> device, on a side CUDA stream.

``DevicePrefetcher(iterable, device="cuda")`` runs a background thread (a
:class:`datapipe.device.handoff.Producer`) that pulls batches from ``iterable``, copies every CPU
tensor leaf into a pinned buffer taken from a bounded pool keyed by
``(shape, dtype)`` (a tensor that is already pinned is copied directly), issues the host-to-device
copy with ``non_blocking=True`` on a dedicated side stream and records an event. The consumer's
current stream waits on that event and the device tensors made there are ``record_stream``-ed on
it, so the caching allocator never recycles them early; batches the consumer is done with are
freed in the producer thread (``handoff.Retirer``). A pinned buffer is reused only after the
event of the copy that read it has completed. On the CPU (``device="cpu"`` or ``None``) the same class is a
plain background-thread prefetch.
"""
from __future__ import annotations

import copy
import dataclasses
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from datapipe.device.handoff import CurrentStream, Producer, ProducerMeter, Retirer, wait_and_keep
from datapipe.device.pacing import PACE

__all__ = ["DevicePrefetcher", "map_tensors", "resolve_device"]

_POLL_S = 0.05


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor :func:`map_tensors` would visit in ``obj``, or None; nothing is rebuilt."""
    if isinstance(obj, torch.Tensor):
        return obj
    if obj is None or isinstance(obj, (bytes, bytearray, memoryview, str, int, float)):
        return None  # the leaves of raw samples: nothing to look into
    if isinstance(obj, Mapping):
        children = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = (getattr(obj, f.name) for f in dataclasses.fields(obj))
    else:
        return None
    for child in children:
        found = first_tensor(child)
        if found is not None:
            return found
    return None


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor inside dicts, lists, tuples, namedtuples and dataclasses.

    Containers are rebuilt with their own type; non-tensor leaves are returned unchanged.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = {k: map_tensors(fn, v) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(fn, v) for v in obj]
        try:
            return type(obj)(items)
        except TypeError:
            return items if isinstance(obj, list) else tuple(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, map_tensors(fn, getattr(obj, f.name)))
        return new
    return obj


def resolve_device(device: str | torch.device | int | None) -> torch.device:
    """Normalise ``device``; a CUDA device that does not exist raises ``ValueError``."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device; use e.g. 'cuda', 'cuda:0' or 'cpu'") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available here; use device='cpu' or None")
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= count:
            raise ValueError(
                f"device={device!r} does not exist: this machine has {count} CUDA device(s) "
                f"(cuda:0 .. cuda:{count - 1})"
            )
        dev = torch.device("cuda", index)
    return dev


class _PinnedPool:
    """Bounded pool of pinned host buffers keyed by (shape, dtype), one CUDA event per buffer.

    A buffer is handed out only when the event recorded after the last copy from it has completed.
    At most ``per_key`` buffers per key and, if set, ``max_bytes`` in total; idle buffers of other
    keys are evicted least-recently-used first. When nothing can be allocated the caller waits for
    the oldest copy of that key to finish.
    """

    def __init__(self, *, per_key: int, max_bytes: int | None, max_keys: int = 64):
        self.per_key = per_key
        self.max_bytes = max_bytes
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple, list[list]] = OrderedDict()  # key -> [[buf, event, held]]
        self.bytes = 0
        self.allocations = 0
        self.reuses = 0
        self.waits = 0

    @staticmethod
    def _nbytes(shape, dtype) -> int:
        n = 1
        for s in shape:
            n *= s
        return n * torch.empty((), dtype=dtype).element_size()

    def _fits(self, need: int) -> bool:
        within = self.max_bytes is None or self.bytes + need <= self.max_bytes
        return within and len(self._entries) <= self.max_keys

    def _evict_idle(self, need: int, keep: tuple) -> None:
        for key in list(self._entries):  # least recently used first
            if self._fits(need):
                return
            if key == keep:
                continue
            entries = self._entries[key]
            for e in list(entries):
                if not e[2] and e[1].query():
                    entries.remove(e)
                    self.bytes -= e[0].numel() * e[0].element_size()
            if not entries:
                del self._entries[key]

    def acquire(self, shape: torch.Size, dtype: torch.dtype) -> list:
        key = (tuple(shape), dtype)
        while True:
            with self._lock:
                entries = self._entries.setdefault(key, [])
                self._entries.move_to_end(key)
                oldest = None
                for e in entries:
                    if not e[2]:
                        if e[1].query():
                            e[2] = True
                            self.reuses += 1
                            return e
                        oldest = oldest or e
                nbytes = self._nbytes(shape, dtype)
                if len(entries) < self.per_key:
                    if not self._fits(nbytes):
                        self._evict_idle(nbytes, key)
                    if self._fits(nbytes) or not entries:
                        buf = torch.empty(shape, dtype=dtype, pin_memory=True)
                        e = [buf, torch.cuda.Event(), True]
                        entries.append(e)
                        self.bytes += nbytes
                        self.allocations += 1
                        return e
            if oldest is None:  # every buffer of this key is being filled by another producer
                threading.Event().wait(_POLL_S / 10)
                continue
            self.waits += 1
            oldest[1].synchronize()

    def release(self, entry: list, stream: torch.cuda.Stream) -> None:
        entry[1].record(stream)
        entry[2] = False

    def clear(self) -> None:
        with self._lock:
            for entries in self._entries.values():
                for e in entries:
                    e[1].synchronize()
            self._entries.clear()
            self.bytes = 0

    def stats(self) -> dict:
        with self._lock:
            n = sum(len(v) for v in self._entries.values())
            return {"buffers": n, "bytes": self.bytes, "keys": len(self._entries),
                    "allocations": self.allocations, "reuses": self.reuses, "waits": self.waits}


class _CudaTransfer:
    """Stage one batch through the pool and issue its copies on the side stream (producer thread)."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream, pool: _PinnedPool):
        self.device = device
        self.stream = stream
        self.pool = pool

    def _leaf(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu" or t.is_pinned():
            return t.to(self.device, non_blocking=True)
        entry = self.pool.acquire(t.shape, t.dtype)
        try:
            entry[0].copy_(t)
            return entry[0].to(self.device, non_blocking=True)
        finally:
            self.pool.release(entry, self.stream)

    def __call__(self, batch: Any) -> tuple[Any, torch.cuda.Event, list[torch.Tensor]]:
        """``(batch on the device, event after its copies, the device tensors made here)``."""
        made: list[torch.Tensor] = []

        def leaf(t: torch.Tensor) -> torch.Tensor:
            out = self._leaf(t)
            if out is not t:
                made.append(out)
            return out

        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            out = map_tensors(leaf, batch)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done, made


class _PrefetchIterator(Producer):
    """One epoch of a DevicePrefetcher: owns the producer thread; closing or dropping it stops it."""

    def __init__(self, owner: DevicePrefetcher):
        self._owner = owner  # keeps the pool alive while this epoch runs (``for b in DevicePrefetcher(...)``)
        device = owner.device
        consumer = None
        if device.type == "cuda":
            setup = lambda: torch.cuda.set_device(device)  # noqa: E731
            transform = _CudaTransfer(device, owner.stream, owner._pool)
            consumer = CurrentStream(device)
            handoff = _handoff(consumer)
        else:
            setup = handoff = None
            transform = lambda batch: map_tensors(lambda t: t.to(device), batch)  # noqa: E731
        super().__init__(owner.iterable, depth=owner.depth, name="datapipe-prefetch", setup=setup,
                         transform=transform, handoff=handoff, join_s=30.0, pace=PACE, meter=owner.meter,
                         note="(raised while producing a batch in the DevicePrefetcher thread)",
                         retire=Retirer(device, stream=consumer) if device.type == "cuda" else None)


def _handoff(consumer: CurrentStream) -> Callable[[tuple[Any, torch.cuda.Event]], Any]:
    def handoff(item):  # in the consumer's thread, before the slot is freed
        batch, done, made = item
        wait_and_keep(done, made, consumer())
        return batch

    return handoff


class DevicePrefetcher:
    """Yield the batches of ``iterable`` on ``device``, up to ``depth`` batches ahead.

    Batches may nest tensors in dicts, lists, tuples, namedtuples and dataclasses; other leaves
    pass through unchanged. Each ``iter()`` is one pass over ``iterable``. On CUDA, pinned staging
    buffers come from a pool bounded to ``depth + 2`` buffers per ``(shape, dtype)`` (and to
    ``max_pinned_bytes`` in total, if given) that lives across epochs and is freed by ``close()``.
    A source tensor that is already pinned is copied directly, so its owner must not overwrite it
    until the consumer's stream has used the batch. An exception raised by ``iterable`` is
    re-raised by ``next()`` in the consumer (same object, producer traceback kept). While a batch
    is still queued, the next one is made only half-way into the consumer's step
    (:data:`datapipe.device.pacing.PACE`), so the producer thread does not compete for the GIL
    with the training thread while it launches the step.
    On CUDA the last two batches handed out stay referenced and older ones are freed in the
    producer thread once the consumer's stream is past them (``handoff.Retirer``): up to two more
    batches on the device than the caller holds, and none of the freeing in the caller's ``next()``.
    """

    def __init__(self, iterable: Iterable, *, device: str | torch.device | int | None,
                 depth: int = 2, max_pinned_bytes: int | None = None):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth={depth!r}: pass an int >= 1 (batches prepared ahead of the consumer)")
        if max_pinned_bytes is not None and max_pinned_bytes <= 0:
            raise ValueError(f"max_pinned_bytes={max_pinned_bytes!r}: pass a positive byte count or None")
        self.iterable = iterable
        self.device = resolve_device(device)
        self.depth = depth
        self.meter = ProducerMeter()  # the producer threads' CPU time, over every epoch
        self.max_pinned_bytes = max_pinned_bytes
        self.stream = None
        self._pool = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)
            self._pool = _PinnedPool(per_key=depth + 2, max_bytes=max_pinned_bytes)
        self._iterators: weakref.WeakSet = weakref.WeakSet()
        self._closed = False

    def __iter__(self) -> _PrefetchIterator:
        if self._closed:
            raise ValueError("this DevicePrefetcher is closed; create a new one")
        if self._pool is not None:
            self._pool.per_key = self.depth + 2
        it = _PrefetchIterator(self)
        self._iterators.add(it)
        return it

    def __len__(self) -> int:
        return len(self.iterable)

    def producer_stats(self) -> dict:
        """The producer threads' CPU time (``cpu_s``, ``batches``, ``cpu_ms_per_batch``), all epochs."""
        return self.meter.stats()

    def pool_stats(self) -> dict:
        """Pinned pool counters: buffers, bytes, keys, allocations, reuses, waits (zeros on CPU)."""
        if self._pool is None:
            return {"buffers": 0, "bytes": 0, "keys": 0, "allocations": 0, "reuses": 0, "waits": 0}
        return self._pool.stats()

    def close(self) -> None:
        """Stop every producer thread of this prefetcher and free the pinned pool."""
        self._closed = True
        for it in list(self._iterators):
            it.close()
        if self._pool is not None:
            self._pool.clear()

    def __enter__(self) -> DevicePrefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
