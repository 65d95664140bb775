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
however long. The segment stays mapped in the main process for the worker's next batches, which name it
by a token (:class:`SegmentRef`: its file descriptor crosses once, not once a batch). A body of plain
values (a ``ShardStream`` batch: dicts, lists, strings, numbers, small bytes) travels pickled in the
segment after the data, each packed leaf a persistent id, so the main process copies the leaves out in
one pass and unpickles the body around them. On 12 or more cores, once the main process has found that it may
read a worker's memory (:mod:`loaders.dataloader.vmread`), that worker's batches of raw ``bytes`` alone name each
leaf by its address there instead (kind ``r``): the segment carries the body, and the worker keeps the leaves
until the segment is ``FREE`` again.

With ``tensors=True`` (where the loader does not recycle the batch's tensors itself: no pin thread of
its own) the batch's CPU tensors travel together too, in one block of fresh shared memory per batch,
and come out over it with their dtype, shape and strides, not copied. torch sends each tensor
in shared memory of its own, and the main process fetches every one's file descriptor from the
worker over a socket (an authenticated connection each, answered by a thread of the worker that
needs the worker's interpreter lock, held while it decodes): a batch of 256 decoded images as a
list (variable sizes, or a collate that keeps samples apart) is 256 such round trips in the one main
process. Packed, it is one. Each tensor comes out on a storage of its own, a slice of the block's (so it
saves, pickles and travels as its own bytes, as torch's do, not as the whole block); the block is freed
when the last of the batch's tensors is, as a stacked batch is (one tensor kept keeps the block). Tensors
already in shared memory (``default_collate``'s stacks, made there) and tensors sharing a storage with another
leaf keep torch's way, as do tensors it cannot rebuild densely (see :func:`_movable`).

Applies to worker processes with torch's ``file_descriptor`` sharing strategy. A batch with fewer
than :data:`MIN_BYTES` of such leaves (and fewer than :data:`MIN_TENSORS` tensors to pack), a
``bytes`` or array leaf under :data:`MIN_LEAF` bytes, object or structured arrays, numpy subclasses,
and anything inside another type travel as torch sends them, and so does a batch whose worker has no
free segment for it (it never waits).
"""
from __future__ import annotations

import os
import weakref

import numpy as np
import torch

import loaders.dataloader.vmread as vmread
from datapipe.read.rawbytes import data_address
from loaders.dataloader.bodies import Slot, batch_of, filled, plain_pickle
from loaders.dataloader.copyout import Copying, copy_threads, copying_out, read_threads, segment_fd
from loaders.dataloader.shm import (FREE, HEADER, MAPPED, READS, WRITER, SegmentPool, _STATE, _header, _movable,
                                    _shared_storages, map_leaves)

__all__ = ["MIN_BYTES", "MIN_LEAF", "MIN_TENSORS", "Packed", "RawCopies", "SegmentRef", "Started", "pack_raw"]

MIN_BYTES = 256 * 1024  # a batch with fewer raw bytes is pickled as torch does
MIN_LEAF = 512  # smaller bytes / array leaves stay in the pickle (a slot costs about as much)
MIN_TENSORS = 2  # a batch with this many tensors to pack is packed whatever its size (torch: a socket round
#                  trip per tensor; packed: one for the batch's block)
_ALIGN = 64


class SegmentRef(tuple):
    """A worker's segment as a batch names it: ``(mark, token, retired, send, data)``.

    ``token``: the segment's number, unique over the loader's workers; ``data``: a uint8 tensor over the
    segment's data (after the header). It crosses to the main process as its token alone once the main
    process has it mapped (the header's ``MAPPED`` byte, set there): torch sends a tensor's shared memory
    over an authenticated socket answered by a thread of the worker, a round trip a batch that waits for
    the worker's interpreter lock. ``send``: the tensor goes too (the main process has not mapped it yet).
    ``retired``: tokens of segments the worker's pool let go since its last message, which the main process
    unmaps. Unpickled (:func:`_received`) in the main process, whichever batch carries it, read or not. A
    tuple of plain values and a tensor, so that the segment code sees its segment.
    """

    __slots__ = ()

    def __new__(cls, items):
        return super().__new__(cls, items)

    def __reduce__(self):
        mark, token, retired, send, data = self
        return _received, (mark, token, retired, data if send else None)


class Packed(tuple):
    """A batch whose raw leaves travel in a segment: ``(body, segment, spans, kinds, dtypes, shapes, tensors,
    pickled)``.

    ``body``: the batch with each packed leaf replaced by its :class:`Slot`, or None when ``pickled`` holds
    it; ``segment``: the :class:`SegmentRef` (None: no bytes or arrays packed); ``spans``: offset, length per
    slot (flat; a tensor's into ``tensors``); ``kinds``: one letter per slot (``b`` bytes, ``a`` bytearray,
    ``c``/``f`` a C/Fortran-ordered array, ``t`` a tensor); ``dtypes``, ``shapes``: the arrays' and
    tensors', in slot order (a tensor's shape entry is ``(shape, strides)``); ``tensors``: a uint8 tensor over
    the fresh shared memory holding the packed tensors, or None; ``pickled``: the body pickled with each slot
    a persistent id (a body of plain values: dicts, lists, tuples, strings, numbers, small bytes), as
    ``(offset, length)`` in the segment after the data, or as bytes (no segment), or None (``body``). A
    tuple of plain values, so that the segment code sees its tensors.
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
        return Slot(len(leaves) - 1)

    body = map_leaves(batch, note)
    if end < MIN_BYTES and kinds.count("t") < MIN_TENSORS:
        return batch
    pickled = plain_pickle(body)
    segment = block = None
    read = pool.reads and kinds.count("b") == len(kinds)  # the main process reads them from this worker's memory
    if read:  # each leaf named by its address (kept alive until the segment is free again), none copied
        kinds = ["r"] * len(kinds)
        spans = [x for leaf, n in zip(leaves, spans[1::2]) for x in (data_address(leaf), n)]
        end = 0
    if end or read:
        size = end + (len(pickled) if pickled is not None else 0)
        storage = pool.take(max(size, 1), room=not read)  # raw batches vary in size
        if storage is None:
            return batch
        token, header = pool.number(storage)
        header[WRITER:WRITER + 32] = _writer()
        if read:
            pool.held[storage.data_ptr()] = leaves
        retired, pool.retired = tuple(pool.retired), []
        data = torch.empty(0, dtype=torch.uint8).set_(storage, HEADER, (size,), (1,))
        segment = SegmentRef((pool.mark, token, retired, int(header[MAPPED]) == 0, data))
    if tend:
        try:  # fresh, as torch's: handed out as views, it lives as long as the consumer keeps a tensor of it
            block = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(tend), 0, (tend,), (1,))
        except RuntimeError:  # shared memory short (/dev/shm full): torch's own path, and its error
            if segment is not None:  # the segment goes back to the pool with the batch (PooledCollate.settle)
                pool.retired = list(segment[2]) + pool.retired
            return batch
    buf = segment[4].numpy() if segment is not None else None
    view = memoryview(buf) if buf is not None else None
    dtypes, shapes = [], []
    for i, x in enumerate(leaves):
        offset, n = spans[2 * i], spans[2 * i + 1]
        kind = kinds[i]
        if kind == "r":  # read from this worker's memory by the main process
            continue
        if kind in "ba":
            view[offset:offset + n] = x
        elif kind == "t":
            dtypes.append(x.dtype)
            shapes.append((tuple(x.shape), x.stride()))
            _tensor_at(block, offset, x.dtype, x.shape, x.stride()).copy_(x)
        else:
            dtypes.append(x.dtype.str)
            shapes.append(x.shape)
            _array_at(buf, offset, x.dtype, x.shape, kind)[...] = x
    if pickled is not None:
        if segment is not None:
            view[end:end + len(pickled)] = pickled
            pickled, body = (end, len(pickled)), None
        else:
            body = None
    return Packed((body, segment, spans, "".join(kinds), dtypes, shapes, block, pickled))


_WRITER = (None, None)  # (pid, its header bytes): this worker's pid, token address and token as WRITER holds them


def _writer() -> torch.Tensor:
    """The header's WRITER bytes for this process: :func:`vmread.writer`'s pid, token address and token."""
    global _WRITER
    if _WRITER[0] != os.getpid():
        pid, address, token = vmread.writer()
        raw = np.array([pid, address], np.int64).view(np.uint8).tobytes() + token
        _WRITER = (pid, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return _WRITER[1]


def writer_of(header: torch.Tensor) -> tuple[int, int, bytes]:
    """(Main process) the pid, token address and token a segment's header names."""
    raw = header[WRITER:WRITER + 32].numpy().tobytes()
    pid, address = np.frombuffer(raw[:16], np.int64).tolist()
    return pid, address, raw[16:]


def _tensor_at(data: torch.Tensor, offset: int, dtype: torch.dtype, shape, stride) -> torch.Tensor:
    """A tensor of ``dtype``, ``shape`` and ``stride`` over ``data``'s storage, ``offset`` bytes into ``data``."""
    size = torch.empty(0, dtype=dtype).element_size()
    start = data.storage_offset() + offset  # both multiples of _ALIGN: a whole number of elements
    return torch.empty(0, dtype=dtype).set_(data.untyped_storage(), start // size, tuple(shape), tuple(stride))


# A storage's slice: a storage of its own over those bytes of the block, which keeps the block alive but saves,
# pickles and shares as those bytes alone (views of the one block would each carry the whole block, and
# ``torch.save`` refuses tensors of different dtypes over one storage). torch's own, without its Python wrapper.
_slice = torch._C.StorageBase.__getitem__


def _array_at(buf: np.ndarray, offset: int, dtype, shape, kind: str) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    flat = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if kind == "f" else "C")


def _unpack(packed: Packed, view: memoryview | None, fd: int | None = None, writer: tuple | None = None):
    """``(batch, copying)``: the batch ``packed`` carries, every packed leaf copied out of its segment's data
    ``view`` (tensors: over their block, each on a storage of its own), once ``copying.wait()`` returned (raw
    bytes alone are copied in threads); ``fd``: the segment's file, ``view`` starting ``HEADER`` in; ``writer``:
    the pid, token address and token of the worker whose memory holds the leaves named by address (kind ``r``)."""
    body, _, spans, kinds, dtypes, shapes, block, pickled = packed
    remote = kinds[:1] == "r"  # raw bytes named by their addresses in the worker's memory (all or none)
    if remote or kinds.count("b") == len(kinds):  # raw bytes alone (a ShardStream's samples)
        if remote:
            it = iter(spans)
            pid, address, token = writer
            out, copying = vmread.reading(pid, (address, token), list(zip(it, it)),
                                          threads=read_threads() or copy_threads())
        else:  # one pass, in threads if large
            out, copying = copying_out(view, spans, fd=fd, fd_offset=HEADER)
        if pickled is None:  # a body of other types is rebuilt by their own code, which may read or hash a leaf
            copying.wait()
            return filled(body, out), copying
        try:  # a plain body (built-in types alone, no leaf a key) is unpickled while the threads copy
            return batch_of(body, out, pickled, view), copying
        except BaseException:
            copying.wait()
            raise
    buf = np.frombuffer(view, np.uint8) if view is not None else None
    if block is not None:
        storage, base = block.untyped_storage(), block.storage_offset()
    out = []
    arrays = 0
    for i, kind in enumerate(kinds):
        offset, n = spans[2 * i], spans[2 * i + 1]
        if kind == "b":
            out.append(bytes(view[offset:offset + n]))
        elif kind == "a":
            out.append(bytearray(view[offset:offset + n]))
        elif kind == "t":
            dtype, (shape, stride) = dtypes[arrays], shapes[arrays]
            start = base + offset
            out.append(torch.empty(0, dtype=dtype).set_(_slice(storage, slice(start, start + n)), 0, shape,
                                                        stride))
            arrays += 1
        else:
            src = _array_at(buf, offset, np.dtype(dtypes[arrays]), shapes[arrays], kind)
            out.append(src.copy(order="K"))
            arrays += 1
    return batch_of(body, out, pickled, view), Copying()


class _Mapped:
    """(Main process) a worker's segment kept mapped: its storage, header, data (a memoryview) and file
    descriptor (None where torch keeps none)."""

    __slots__ = ("storage", "header", "view", "fd")

    def __init__(self, data: torch.Tensor):
        self.storage = data.untyped_storage()
        self.header = _header(self.storage)
        self.fd = segment_fd(self.storage, bytes(self.header[:8].tolist()))  # its mark
        self.view = memoryview(torch.empty(0, dtype=torch.uint8).set_(
            self.storage, HEADER, (self.storage.nbytes() - HEADER,), (1,)).numpy())


class Started(tuple):
    """``(batch, copying, segment)``: a batch whose raw leaves are still being copied (:meth:`RawCopies.start`);
    none may be read before ``copying.wait()``, and ``segment`` (a :class:`_Mapped`, or None) is its worker's
    until then."""

    __slots__ = ()


# mark -> the RawCopies of that loader's pass, where a SegmentRef unpickled in this process finds its segment
_RECEIVERS: weakref.WeakValueDictionary[bytes, RawCopies] = weakref.WeakValueDictionary()


def _received(mark: bytes, token, retired, data):
    """(Main process, unpickling) the :class:`_Mapped` segment a batch names; ``data``: the segment's tensor
    when its worker sent it (mapped and kept from now on), else None (kept already)."""
    copies = _RECEIVERS.get(mark)
    if copies is None:  # no pass of that mark here any more: the batch is never unpacked
        return None
    return copies.received(token, retired, data)


class RawCopies:
    """(Main process) copies the raw leaves of :class:`Packed` batches out and hands their segments back.

    ``unpack(batch)``: ``batch`` (a :class:`Packed` of the loader marked ``mark``) with its leaves copied
    into ordinary objects; its segment set ``FREE`` for its worker. Every segment a worker sent stays mapped
    (``kept``: token -> segment) until the worker's pool lets it go (its token comes back ``retired``) or
    ``clear()`` (the workers are gone), as the workers name them by token alone once mapped. ``copied``:
    batches unpacked so far. ``workers`` and ``batches``: how many segments the workers hold in flight.
    """

    def __init__(self, mark: bytes, *, workers: int, batches: int):
        self.mark = mark
        self.workers = workers
        self.batches = batches
        self.kept: dict = {}
        self.copied = 0
        self.inflight: set = set()  # the Copying of each batch started and not finished yet
        self.processes: list | None = None  # the workers that write into its segments, where they may be stocked
        _RECEIVERS[mark] = self

    def received(self, token, retired, data) -> _Mapped:
        """The segment ``token`` (``data``: sent with it, else kept already); the ``retired`` ones unmapped."""
        for old in retired:
            self._drop(old)
        if data is not None:
            entry = _Mapped(data)
            if bytes(entry.header[:8].tolist()) != self.mark:
                raise RuntimeError("loaders.DataLoader: a worker's segment carries another loader's mark "
                                   "(an internal error; please report it)")
            entry.header[MAPPED] = 1  # its worker names it by token alone from its next batch on
            self.kept[token] = entry
            return entry
        entry = self.kept.get(token)
        if entry is None:
            raise RuntimeError(f"loaders.DataLoader: a worker named shared-memory segment {token} that this process "
                               "never received (an internal error; please report it)")
        return entry

    def unpack(self, batch):
        return self.finish(self.start(batch))

    def start(self, batch):
        """``batch`` (a :class:`Packed`) as a :class:`Started`, its leaves' copies under way (:meth:`finish` ends
        them); any other batch as it is."""
        if type(batch) is not Packed:
            return batch
        segment = batch[1]
        if type(segment) is SegmentRef:  # packed in this process (never pickled)
            _, token, retired, _, data = segment
            segment = self.received(token, retired, data)
        try:
            if segment is None:
                started = Started((*_unpack(batch, None), None))
            else:
                remote = batch[3][:1] == "r"
                if not remote and not int(segment.header[READS]) and vmread.wanted() \
                        and vmread.allowed(*writer_of(segment.header)):
                    segment.header[READS] = 1  # its worker names its next batches' raw leaves by their addresses
                writer = writer_of(segment.header) if remote else None
                started = Started((*_unpack(batch, segment.view, segment.fd, writer), segment))
        except BaseException:
            self._done(segment)
            raise
        self.inflight.add(started[1])
        return started

    def finish(self, item):
        """The batch of ``item`` (a :class:`Started`: once its copies are done, its segment handed back)."""
        if type(item) is not Started:
            return item
        batch, copying, segment = item
        try:
            copying.wait()
            return batch
        finally:
            self.inflight.discard(copying)
            self._done(segment)

    def settle(self) -> None:
        """Wait until the copies of every batch started are done (not handing their segments back)."""
        for copying in list(self.inflight):
            copying.settle()

    def _done(self, segment) -> None:
        if segment is not None:
            segment.header[_STATE] = FREE
        self.copied += 1

    def release(self) -> None:
        """(The pass ends) every kept segment ``FREE``: its batch, if any, is read or never will be; a worker that
        waits to exit until the batches it holds leaves of are read (:func:`vmread.drain`) goes now."""
        self.settle()  # batches started ahead and never finished: their copies end first
        self.inflight.clear()
        for entry in self.kept.values():
            entry.header[_STATE] = FREE

    def _drop(self, token) -> None:
        entry = self.kept.pop(token, None)
        if entry is not None:
            entry.header[MAPPED] = 0

    def clear(self) -> None:
        for token in list(self.kept):
            self._drop(token)
