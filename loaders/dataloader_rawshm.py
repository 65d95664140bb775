"""Raw samples of worker batches (``bytes``, numpy arrays) in recycled shared memory, copied out in the main process.

torch sends a worker's batch to the main process by pickling it through a pipe: a batch of 256 raw
samples of ~107 KB is ~27 MB written, read and rebuilt there, in the one main process, which caps
every worker count near 5k samples/s. Here the worker copies the batch's large ``bytes``,
``bytearray`` and numpy-array leaves (inside dicts, lists, tuples and namedtuples, at any depth) into
one segment of its :class:`loaders.dataloader_shm.SegmentPool`, and sends the batch with each such
leaf replaced by its slot number, plus the segment. The main process (:class:`RawCopies`) copies
every leaf out of the segment into an ordinary object of the same type (``bytes`` stay ``bytes``; an
array keeps its dtype, shape and C/Fortran order, writable) and hands the segment back to its worker
at once: what the loader hands out is the consumer's own memory, whatever it does with it and for
however long. The segment stays mapped in the main process for the worker's next batch.

Applies to worker processes with torch's ``file_descriptor`` sharing strategy. A batch with fewer
than :data:`MIN_BYTES` of such leaves, a leaf under :data:`MIN_LEAF` bytes, object or structured
arrays, numpy subclasses, and anything inside another type travel as torch sends them, and so does a
batch whose worker has no free segment for it (it never waits).
"""
from __future__ import annotations

import collections

import numpy as np
import torch

from loaders.dataloader_shm import _LEAVES, FREE, HEADER, SegmentPool, _STATE, _segment_header, map_leaves

__all__ = ["MIN_BYTES", "MIN_LEAF", "Packed", "RawCopies", "pack_raw", "unpacked"]

MIN_BYTES = 256 * 1024  # a batch with fewer raw bytes is pickled as torch does
MIN_LEAF = 512  # smaller leaves stay in the pickle (a slot costs about as much)
_ALIGN = 64


class _Slot(int):
    """A packed leaf's place in the batch sent: its number in the :class:`Packed` tables."""

    __slots__ = ()


class Packed(tuple):
    """A batch whose raw leaves travel in a segment: ``(body, data, spans, kinds, dtypes, shapes)``.

    ``body``: the batch with each packed leaf replaced by its :class:`_Slot`; ``data``: a uint8 tensor
    over the segment's data; ``spans``: offset, length per slot (flat); ``kinds``: one letter per slot
    (``b`` bytes, ``a`` bytearray, ``c``/``f`` a C/Fortran-ordered array); ``dtypes``, ``shapes``: the
    arrays', in slot order. A tuple of plain values, so that the segment code sees its tensors.
    """

    __slots__ = ()

    def __new__(cls, items):
        return super().__new__(cls, items)

    def __reduce__(self):
        return Packed, (tuple(self),)


def _kind(leaf) -> str | None:
    """The kind letter ``leaf`` packs as, or None (it stays in the pickle)."""
    t = type(leaf)
    if t is bytes or t is bytearray:
        return ("b" if t is bytes else "a") if len(leaf) >= MIN_LEAF else None
    if t is np.ndarray and leaf.nbytes >= MIN_LEAF and not leaf.dtype.hasobject and leaf.dtype.fields is None:
        return "f" if leaf.flags.f_contiguous and not leaf.flags.c_contiguous else "c"
    return None


def pack_raw(batch, pool: SegmentPool):
    """(Worker) ``batch`` as a :class:`Packed` whose raw leaves lie in a segment taken from ``pool``, or
    ``batch`` itself when it has too few raw bytes or the pool no free segment."""
    leaves: list = []
    spans: list[int] = []
    kinds: list[str] = []
    end = 0

    def note(x):
        nonlocal end
        kind = _kind(x)
        if kind is None:
            return x
        n = len(x) if kind in "ba" else x.nbytes
        spans.extend((end, n))
        kinds.append(kind)
        leaves.append(x)
        end += -(-n // _ALIGN) * _ALIGN
        return _Slot(len(leaves) - 1)

    body = map_leaves(batch, note)
    if end < MIN_BYTES:
        return batch
    storage = pool.take(end)
    if storage is None:
        return batch
    data = torch.empty(0, dtype=torch.uint8).set_(storage, HEADER, (end,), (1,))
    buf = data.numpy()
    dtypes, shapes = [], []
    for i, x in enumerate(leaves):
        offset, n = spans[2 * i], spans[2 * i + 1]
        if kinds[i] in "ba":
            buf[offset:offset + n] = np.frombuffer(x, np.uint8)
        else:
            dtypes.append(x.dtype.str)
            shapes.append(x.shape)
            _array_at(buf, offset, x.dtype, x.shape, kinds[i])[...] = x
    return Packed((body, data, spans, "".join(kinds), dtypes, shapes))


def _array_at(buf: np.ndarray, offset: int, dtype, shape, kind: str) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    flat = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if kind == "f" else "C")


def _unpack(packed: Packed):
    """The batch ``packed`` carries, every packed leaf copied out of its segment."""
    body, data, spans, kinds, dtypes, shapes = packed
    buf = data.numpy()
    view = memoryview(buf)
    out: list = []
    arrays = 0
    for i, kind in enumerate(kinds):
        offset, n = spans[2 * i], spans[2 * i + 1]
        if kind == "b":
            out.append(bytes(view[offset:offset + n]))
        elif kind == "a":
            out.append(bytearray(view[offset:offset + n]))
        else:
            src = _array_at(buf, offset, np.dtype(dtypes[arrays]), shapes[arrays], kind)
            out.append(src.copy(order="K"))
            arrays += 1
    return _filled(body, out)


def _filled(x, out: list):
    """``x`` with ``out[slot]`` in place of each slot. The dicts and lists holding slots are the batch's own
    (rebuilt by :func:`pack_raw`, then by unpickling): they change in place; other containers are rebuilt."""
    kind = type(x)
    if kind is _Slot:
        return out[x]
    if kind is dict:
        for k, v in x.items():
            if type(v) not in _LEAVES:
                x[k] = _filled(v, out)  # the same keys: the dict's size never changes
        return x
    if kind is list:
        for i, v in enumerate(x):
            if type(v) not in _LEAVES:
                x[i] = _filled(v, out)
        return x
    return map_leaves(x, lambda y: out[y] if type(y) is _Slot else y)


class RawCopies:
    """(Main process) copies the raw leaves of :class:`Packed` batches out and hands their segments back.

    ``unpack(batch)``: ``batch`` (a :class:`Packed` of the loader marked ``mark``) with its leaves copied
    into ordinary objects; its segment set ``FREE`` for its worker and kept mapped. At most twice the
    segments the workers can hold are kept (``workers`` x ``batches`` in flight), the least recently
    used dropped first. ``clear()`` drops them all. ``copied``: batches unpacked so far.
    """

    def __init__(self, mark: bytes, *, workers: int, batches: int):
        self.mark = mark
        self.workers = workers
        self.batches = batches
        self.kept: collections.OrderedDict[int, torch.UntypedStorage] = collections.OrderedDict()
        self.copied = 0

    def unpack(self, batch):
        if type(batch) is not Packed:
            return batch
        data = batch[1]
        try:
            return _unpack(batch)
        finally:
            head = _segment_header(data, self.mark)
            if head is not None:
                head[_STATE] = FREE
                storage = data.untyped_storage()
                self.kept[storage.data_ptr()] = storage
                self.kept.move_to_end(storage.data_ptr())
                over = len(self.kept) - 2 * max(1, self.workers) * self.batches
                for ptr in list(self.kept)[:max(0, over)]:
                    del self.kept[ptr]
            self.copied += 1

    def clear(self) -> None:
        self.kept.clear()


def unpacked(stream, copies: RawCopies, *, keep: bool = False):
    """``(batch, meta)`` of ``stream`` with each :class:`Packed` batch copied out (:meth:`RawCopies.unpack`);
    at the end the kept segments are dropped unless ``keep`` (persistent workers reuse them)."""
    try:
        for batch, meta in stream:
            yield copies.unpack(batch), meta
            batch = meta = None
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
        if not keep:
            copies.clear()
