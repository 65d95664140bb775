"""Raw samples of worker batches (``bytes``, numpy arrays) in recycled shared memory, copied out in the main process.

torch sends a worker's batch to the main process by pickling it through a pipe: a batch of 256 raw
samples of ~107 KB is ~27 MB written, read and rebuilt there, in the one main process, which caps
every worker count near 5k samples/s. Here the worker copies the batch's large ``bytes``,
``bytearray`` and numpy-array leaves (inside dicts, lists, tuples and namedtuples, at any depth) into
one segment of its :class:`loaders.dataloader.shm.SegmentPool`, and sends the batch with each such
leaf replaced by its slot number, plus the segment. The main process (:class:`RawCopies`) copies
every leaf out of the segment into an ordinary object of the same type (``bytes`` stay ``bytes``; an
array keeps its dtype, shape and C/Fortran order, writable) and hands the segment back to its worker
at once: what the loader hands out is the consumer's own memory, whatever it does with it and for
however long. The segment stays mapped in the main process for the worker's next batch.

With ``tensors=True`` (where the loader does not recycle the batch's tensors itself: no pin thread of
its own) the batch's CPU tensors travel together too, in one block of fresh shared memory per batch,
and come out over it with their dtype, shape and strides, not copied. torch sends each tensor
in shared memory of its own, and the main process fetches every one's file descriptor from the
worker over a socket (an authenticated connection each, answered by a thread of the worker that
needs the worker's interpreter lock, held while it decodes): a batch of 256 decoded images as a
list (variable sizes, or a collate that keeps samples apart) is 256 such round trips in the one main
process. Packed, it is one. Each tensor comes out on a storage of its own, a slice of the block's (so it
saves, pickles and travels as its own bytes, as torch's do, not as the whole block); the block is freed
when the last of the batch's tensors is, as a stacked batch is (one tensor kept keeps the block). Tensors already in shared memory (``default_collate``'s
stacks, made there) and tensors sharing a storage with another leaf keep torch's way, as do tensors
it cannot rebuild densely (see :func:`_movable`).

Applies to worker processes with torch's ``file_descriptor`` sharing strategy. A batch with fewer
than :data:`MIN_BYTES` of such leaves (and fewer than :data:`MIN_TENSORS` tensors to pack), a
``bytes`` or array leaf under :data:`MIN_LEAF` bytes, object or structured arrays, numpy subclasses,
and anything inside another type travel as torch sends them, and so does a batch whose worker has no
free segment for it (it never waits).
"""
from __future__ import annotations

import collections

import numpy as np
import torch

from loaders.dataloader.shm import (_LEAVES, FREE, HEADER, SegmentPool, _STATE, _movable, _segment_header,
                                    _shared_storages, map_leaves)

__all__ = ["MIN_BYTES", "MIN_LEAF", "MIN_TENSORS", "Packed", "RawCopies", "pack_raw", "unpacked"]

MIN_BYTES = 256 * 1024  # a batch with fewer raw bytes is pickled as torch does
MIN_LEAF = 512  # smaller bytes / array leaves stay in the pickle (a slot costs about as much)
MIN_TENSORS = 2  # a batch with this many tensors to pack is packed whatever its size (torch: a socket round
#                  trip per tensor; packed: one for the batch's block)
_ALIGN = 64


class _Slot(int):
    """A packed leaf's place in the batch sent: its number in the :class:`Packed` tables."""

    __slots__ = ()


class Packed(tuple):
    """A batch whose raw leaves travel in a segment: ``(body, data, spans, kinds, dtypes, shapes, tensors)``.

    ``body``: the batch with each packed leaf replaced by its :class:`_Slot`; ``data``: a uint8 tensor
    over the segment's data (None: no bytes or arrays packed); ``spans``: offset, length per slot (flat;
    a tensor's into ``tensors``); ``kinds``: one letter per slot (``b`` bytes, ``a`` bytearray, ``c``/``f``
    a C/Fortran-ordered array, ``t`` a tensor); ``dtypes``, ``shapes``: the arrays' and tensors', in slot
    order (a tensor's shape entry is ``(shape, strides)``); ``tensors``: a uint8 tensor over the fresh
    shared memory holding the packed tensors, or None. A tuple of plain values, so that the segment code
    sees its tensors.
    """

    __slots__ = ()

    def __new__(cls, items):
        return super().__new__(cls, items)

    def __reduce__(self):
        return Packed, (tuple(self),)


def _kind(leaf) -> str | None:
    """The kind letter a ``bytes``, ``bytearray`` or numpy ``leaf`` packs as, or None (it stays in the pickle)."""
    t = type(leaf)
    if t is bytes or t is bytearray:
        return ("b" if t is bytes else "a") if len(leaf) >= MIN_LEAF else None
    if t is np.ndarray and leaf.nbytes >= MIN_LEAF and not leaf.dtype.hasobject and leaf.dtype.fields is None:
        return "f" if leaf.flags.f_contiguous and not leaf.flags.c_contiguous else "c"
    return None


def _packable_tensor(t, aliased: set[int]) -> bool:
    """Whether tensor ``t`` travels in the segment: a plain dense CPU tensor (:func:`_movable`), not in shared
    memory already (torch sends that without a copy) and alone on its storage in the batch (aliasing kept)."""
    if not _movable(t):
        return False
    storage = t.untyped_storage()
    return not storage.is_shared() and storage.data_ptr() not in aliased


def pack_raw(batch, pool: SegmentPool, *, tensors: bool = False):
    """(Worker) ``batch`` as a :class:`Packed` whose raw leaves lie in a segment taken from ``pool``, or
    ``batch`` itself when it has too few raw bytes (and tensors) or the pool no free segment.

    ``tensors``: the batch's CPU tensors go in the segment too (see the module's notes)."""
    leaves: list = []
    spans: list[int] = []
    kinds: list[str] = []
    end = tend = 0  # bytes of the segment (bytes, arrays) and of the tensors' block
    aliased = _shared_storages(batch) if tensors else set()

    def note(x):
        nonlocal end, tend
        if type(x) is torch.Tensor:
            if not tensors or not _packable_tensor(x, aliased):
                return x
            kind, n, offset = "t", x.numel() * x.element_size(), tend
            tend += -(-n // _ALIGN) * _ALIGN
        else:
            kind = _kind(x)
            if kind is None:
                return x
            n, offset = (len(x) if kind in "ba" else x.nbytes), end
            end += -(-n // _ALIGN) * _ALIGN
        spans.extend((offset, n))
        kinds.append(kind)
        leaves.append(x)
        return _Slot(len(leaves) - 1)

    body = map_leaves(batch, note)
    if end < MIN_BYTES and kinds.count("t") < MIN_TENSORS:
        return batch
    data = block = None
    if end:
        storage = pool.take(end)
        if storage is None:
            return batch
        data = torch.empty(0, dtype=torch.uint8).set_(storage, HEADER, (end,), (1,))
    if tend:
        try:  # fresh, as torch's: handed out as views, it lives as long as the consumer keeps a tensor of it
            block = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(tend), 0, (tend,), (1,))
        except RuntimeError:  # shared memory short (/dev/shm full): torch's own path, and its error
            return batch
    buf = data.numpy() if data is not None else None
    dtypes, shapes = [], []
    for i, x in enumerate(leaves):
        offset, n = spans[2 * i], spans[2 * i + 1]
        kind = kinds[i]
        if kind in "ba":
            buf[offset:offset + n] = np.frombuffer(x, np.uint8)
        elif kind == "t":
            dtypes.append(x.dtype)
            shapes.append((tuple(x.shape), x.stride()))
            _tensor_at(block, offset, x.dtype, x.shape, x.stride()).copy_(x)
        else:
            dtypes.append(x.dtype.str)
            shapes.append(x.shape)
            _array_at(buf, offset, x.dtype, x.shape, kind)[...] = x
    return Packed((body, data, spans, "".join(kinds), dtypes, shapes, block))


def _tensor_at(data: torch.Tensor, offset: int, dtype: torch.dtype, shape, stride) -> torch.Tensor:
    """A tensor of ``dtype``, ``shape`` and ``stride`` over ``data``'s storage, ``offset`` bytes into ``data``."""
    size = torch.empty(0, dtype=dtype).element_size()
    start = data.storage_offset() + offset  # both multiples of _ALIGN: a whole number of elements
    return torch.empty(0, dtype=dtype).set_(data.untyped_storage(), start // size, tuple(shape), tuple(stride))


def _own_view(block: torch.Tensor, offset: int, n: int, dtype: torch.dtype, shape, stride) -> torch.Tensor:
    """A tensor over bytes ``offset`` to ``offset + n`` of ``block``, on a storage of its own: a slice of the
    block's storage, which keeps the block alive but saves, pickles and shares as those ``n`` bytes alone
    (views of the one block would each carry the whole block, and ``torch.save`` refuses tensors of
    different dtypes over one storage)."""
    storage = block.untyped_storage()
    start = block.storage_offset() + offset
    return torch.empty(0, dtype=dtype).set_(storage[start:start + n], 0, tuple(shape), tuple(stride))


def _array_at(buf: np.ndarray, offset: int, dtype, shape, kind: str) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    flat = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if kind == "f" else "C")


def _unpack(packed: Packed):
    """The batch ``packed`` carries, every packed leaf copied out of its segment (tensors: over their block, each
    on a storage of its own)."""
    body, data, spans, kinds, dtypes, shapes, block = packed
    buf = data.numpy() if data is not None else None
    view = memoryview(buf) if buf is not None else None
    out: list = []
    arrays = 0
    for i, kind in enumerate(kinds):
        offset, n = spans[2 * i], spans[2 * i + 1]
        if kind == "b":
            out.append(bytes(view[offset:offset + n]))
        elif kind == "a":
            out.append(bytearray(view[offset:offset + n]))
        elif kind == "t":
            dtype, (shape, stride) = dtypes[arrays], shapes[arrays]
            out.append(_own_view(block, offset, n, dtype, shape, stride))
            arrays += 1
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
            head = _segment_header(data, self.mark) if data is not None else None
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
