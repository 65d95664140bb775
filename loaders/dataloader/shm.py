"""Recycled shared memory for the batches of ``loaders.DataLoader``'s worker processes.

A torch worker puts every batch in fresh shared memory: ``default_collate`` stacks into a new
shared-memory tensor, any other tensor is moved there when the batch is pickled. Creating and
first touching 19 MB of shared memory (a batch of 128 224x224 RGB images) takes ~10 ms on the
2-core CI machine, against ~1 ms to write into memory already mapped, and the main process maps
each batch anew and unmaps it after use (~2 ms that hold up its other threads: docs/internals.md, "Pinning
in the producer"). Here each worker keeps a small pool of shared-memory segments and writes its
batches' tensors into free ones; the main process keeps the segments mapped (torch's receiving
side finds a segment it still holds in its cache and does not map it again) and hands each
segment back as soon as the batch has been pinned. Used where that moment is known: where a thread of
the loader pins (:func:`loaders.dataloader.iterator.pinned`: the prefetch thread with ``device="cuda"``, a
pin thread in torch's place with ``pin_memory=True`` and ``device=None``) and torch's
``file_descriptor`` sharing strategy (Linux's default).

A segment starts with a 64-byte header: the loader's 8-byte mark and a state byte, ``BUSY`` from
when its worker writes into it until the main process sets it back to ``FREE``. A worker never
waits: with no free segment of the size and its pool full, a batch's tensor goes to fresh shared
memory as torch does. ``default_collate`` (alone or inside a custom collate) stacks straight into
a segment; other tensors of a batch are copied into one. Leaves moved: plain CPU tensors, dense
(contiguous or channels-last), not needing grad, inside dicts, lists, tuples and namedtuples; a
tensor sharing its storage with another leaf of the batch, and anything else, travels as torch
sends it. A batch holding anything but tensors, numbers, strings and those containers (a custom
batch type, a dataclass, a numpy view) may carry segments out of sight: its segments stay with it,
never reused, and its worker recycles no more (torch's fresh shared memory from then on).
"""
from __future__ import annotations

import collections
import copy
import ctypes
import functools
import multiprocessing.util
import numbers
import os
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable

import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

from loaders.dataloader.vmread import drain, torch_done_event


__all__ = ["HEADER", "FREE", "BUSY", "PooledCollate", "SegmentPool", "recycling_available"]

HEADER = 64  # bytes before a segment's data: mark (8), state (1), mapped (1), reads (1), padding (to 16), the
#              writer's pid (8), its token's address (8) and token (16), padding (keeps data 64-byte aligned)
FREE, BUSY = 0, 1
_STATE = 8
MAPPED = 9  # set by the main process once it keeps the segment mapped under its number (loaders.dataloader.rawshm)
READS = 10  # set by the main process where it may read its workers' memory (loaders.dataloader.vmread)
WRITER = 16  # the worker writing the segment: its pid, its token's address and token (32 bytes: rawshm.pack_raw)
_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


def recycling_available() -> bool:
    """Whether batches can travel in recycled segments: torch's ``file_descriptor`` sharing strategy
    (with ``file_system`` each send would add a reference the receiver never drops)."""
    return torch.multiprocessing.get_sharing_strategy() == "file_descriptor"


def _header(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (HEADER,), (1,))


def _format(t: torch.Tensor):
    """The memory format ``t`` is dense in (its strides can be rebuilt in a segment), or None."""
    for fmt in _FORMATS:
        try:
            if t.is_contiguous(memory_format=fmt):
                return fmt
        except RuntimeError:  # channels_last for a tensor of another rank
            continue
    return None


def _movable(t: Any) -> bool:
    return (type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided and t.numel() > 0
            and not t.requires_grad and not t.is_quantized and not t.is_nested and _format(t) is not None)


class SegmentPool:
    """(Worker process) shared-memory segments this worker writes its batches' tensors into.

    ``take(nbytes, room=False)``: the smallest free segment that holds ``nbytes``, marked ``BUSY``; a new
    one while the pool has fewer than ``cap`` (a free one too small is replaced), a quarter larger with
    ``room`` or where sizes grew; None when every segment is busy. ``fresh``: segments made so far.
    ``number(storage)``: a taken segment's token, unique over the loader's workers, and its header;
    ``retired``: the tokens of numbered segments the pool let go since the caller last emptied it.
    """

    def __init__(self, mark: bytes, cap: int):
        self.mark = mark
        self._mark = torch.tensor(list(mark), dtype=torch.uint8)
        self.cap = cap
        self.segments: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self.fresh = 0
        self.taken: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # since the last ``settle()``
        self.pass_seen: int | None = None
        self._key = (os.getpid(), int.from_bytes(os.urandom(8), "little"))
        self._numbers: dict[int, tuple] = {}  # data pointer -> token, of the segments numbered
        self._serial = 0
        self.retired: list[tuple] = []
        self._inherited: set[int] = set()  # data pointers of adopted segments not yet taken here (see adopt)
        self.held: dict[int, list] = {}  # data pointer -> leaves the main process reads from this worker's memory

    @property
    def reads(self) -> bool:
        """Whether the main process reads this worker's memory (it marked a segment so)."""
        return any(int(h[READS]) for _, h in self.segments)

    def held_busy(self) -> bool:
        """Whether a batch whose leaves the main process reads from this worker's memory is not read yet."""
        return any(int(h[_STATE]) == BUSY for s, h in self.segments if s.data_ptr() in self.held)

    def number(self, storage: torch.UntypedStorage) -> tuple[tuple, torch.Tensor]:
        """The token of segment ``storage`` (one of this pool's) and its header."""
        ptr = storage.data_ptr()
        header = next(h for s, h in self.segments if s.data_ptr() == ptr)
        token = self._numbers.get(ptr)
        if token is None:
            self._serial += 1
            token = self._numbers[ptr] = (*self._key, self._serial)
        return token, header

    def adopt(self, segments) -> None:
        """(A fresh worker) start with segments of a finished pass, each free and named by the token the main
        process keeps it under (``(token, storage)`` pairs: :mod:`loaders.dataloader.stock`)."""
        for token, storage in segments:
            header = _header(storage)
            header[:8] = self._mark
            header[_STATE] = FREE
            header[READS] = 0  # the main process finds out again whether it may read this worker
            self.segments.append((storage, header))
            self._numbers[storage.data_ptr()] = token
            self._inherited.add(storage.data_ptr())

    def new_pass(self, n: int) -> None:
        """The pass counter of this worker's set of persistent workers reads ``n``: when it moved on, every
        segment still ``BUSY`` is free again (workers that serve one pass have no counter: a segment goes
        back only as the main process gives that delivery back). A persistent worker's pool outlives a
        pass, and a new pass over those workers starts only once the last one's thread has stopped and the
        main process has given back every batch of it that it took; the batches still in flight as the
        last pass ended (left unfinished) torch drops unread when it starts the new one. A batch of the
        last pass this worker was still collating after the counter moved keeps its segment until the
        next move (the worker uses fresh shared memory meanwhile): it cannot be told from the new pass's."""
        if n != self.pass_seen:
            if self.pass_seen is not None:
                for _, header in self.segments:
                    header[_STATE] = FREE
            self.pass_seen = n

    def settle(self, sent: set[int] | None = None) -> None:
        """Start a new batch. The segments taken since the last call that the batch going out does not
        use (their data pointers are not in ``sent``; None: it failed, none goes out) are free again:
        a custom collate's intermediate results, say ``default_collate``'s uint8 stack before a cast."""
        for storage, header in self.taken:
            if sent is None or storage.data_ptr() not in sent:
                header[_STATE] = FREE
        self.taken = []

    def abandon(self) -> None:
        """Start a new batch, leaving the segments taken since the last call ``BUSY`` for good: a batch
        that may carry them out of sight went out in them."""
        self.taken = []

    def take(self, nbytes: int, *, room: bool = False) -> torch.UntypedStorage | None:
        need = HEADER + nbytes
        free = [s for s in self.segments if int(s[1][_STATE]) == FREE]
        fits = [s for s in free if s[0].nbytes() >= need]
        if fits:
            chosen = min(fits, key=lambda s: s[0].nbytes())
        elif len(self.segments) < self.cap or free:
            if len(self.segments) >= self.cap:  # full: the smallest free segment makes way
                victim = min(free, key=lambda s: s[0].nbytes())
                self.segments.remove(victim)
                self.held.pop(victim[0].data_ptr(), None)
                token = self._numbers.pop(victim[0].data_ptr(), None)
                if token is not None:
                    self.retired.append(token)
            try:  # a quarter more room (torch reserves it all at once) where sizes vary (``room``: raw batches) or
                # grew: a later, larger batch still fits, so a worker makes fewer segments and holds less in all
                # (2-core machine, raw batches of ~27 MB: 2 workers 171-234 MB -> 128-131 MB)
                storage = torch.UntypedStorage._new_shared(need + need // 4 if room or free else need)
            except RuntimeError:  # shared memory short (/dev/shm full): torch's own path, and its error
                return None
            _map_in(storage, need)  # its pages in one call: 27 MB made, mapped and written 13 ms, 17.5 faulting
            chosen = (storage, _header(storage))
            chosen[1][:8] = self._mark
            self.segments.append(chosen)
            self.fresh += 1
        else:
            return None
        chosen[1][_STATE] = BUSY
        self.held.pop(chosen[0].data_ptr(), None)  # free again: the main process has read the last batch's leaves
        if self._inherited and chosen[0].data_ptr() in self._inherited:  # its first use in this process
            self._inherited.discard(chosen[0].data_ptr())
            _map_in(chosen[0])
        self.taken.append(chosen)
        return chosen[0]

    def place(self, dtype: torch.dtype, shape, fmt=torch.contiguous_format) -> torch.Tensor | None:
        """An empty tensor of ``dtype`` and ``shape`` in a segment, laid out in memory format ``fmt``, or
        None when the pool has no segment for it."""
        size = torch.empty(0, dtype=dtype).element_size()
        storage = self.take(size * torch.Size(shape).numel())
        if storage is None:
            return None
        strides = torch.empty(shape, dtype=dtype, device="meta", memory_format=fmt).stride()
        return torch.empty(0, dtype=dtype).set_(storage, HEADER // size, tuple(shape), strides)


MADV_POPULATE_WRITE = 23  # Linux 5.14+: map a range's pages writable in one call


@functools.cache
def _madvise():
    """libc's ``madvise``, or None where there is none."""
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes, call.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return call


def _map_in(storage: torch.UntypedStorage, nbytes: int | None = None) -> None:
    """Map a segment's first ``nbytes`` (all) into this process in one call, not a fault a page: an inherited one
    (a fork does not copy a shared mapping's page tables: 27 MB written after a fork took 13-14 ms here, 3.6-4.8 ms
    mapped first) or a new one (its pages made too: 27 MB written 12 ms, mapped first 5.5 + 2.1 ms on the 2-core
    machine). Nothing where the kernel cannot (older than 5.14, not Linux): the writes fault the pages in as before."""
    madvise = _madvise()
    if madvise is not None:
        madvise(storage.data_ptr(), storage.nbytes() if nbytes is None else min(nbytes, storage.nbytes()),
                MADV_POPULATE_WRITE)


class PooledCollate:
    """collate_fn wrapper: in a worker, the batch's tensors land in the worker's :class:`SegmentPool`.

    Where torch's ``default_collate`` stacks tensors (as the collate, or called by a custom one) it
    writes straight into a segment; the result's other movable tensors are copied into segments. In
    the main process (no workers) it is the wrapped collate. ``mark``: the 8 bytes of the pass's workers;
    ``passes``: the pass counter of persistent workers (else None);
    ``batches``: how many batches one worker may have in flight (torch's prefetch factor + 2), so the
    pool's cap is that many times the tensors in a batch. ``tensors=False``: tensors travel as torch
    sends them. ``pack(batch, pool)``: applied to each collated batch first, with the pool (e.g.
    :func:`loaders.dataloader.rawshm.pack_raw`, the raw leaves copied into a segment).
    """

    def __init__(self, collate_fn: Callable, mark: bytes, batches: int, passes: torch.Tensor | None = None, *,
                 tensors: bool = True, pack: Callable | None = None, stock: list[list[tuple]] | None = None):
        self.collate = collate_fn
        self.mark = mark
        self.batches = batches
        self.passes = passes  # persistent workers' pass counter, in shared memory (see SegmentPool.new_pass)
        self.tensors = tensors
        self.pack = pack
        self.stock = stock  # per worker id: the segments its pool starts with (loaders.dataloader.stock), or None
        self._pool: SegmentPool | None = None
        self._pid: int | None = None
        self._leaves = 1
        self._off = False  # a batch of a type it cannot look into came: this worker recycles no more

    def __getstate__(self):
        return {**self.__dict__, "_pool": None, "_pid": None, "stock": None}  # inherited by fork alone

    @property
    def pool(self) -> SegmentPool:
        if self._pid != os.getpid():  # one pool per worker process
            self._pool, self._pid = SegmentPool(self.mark, self.batches * self._leaves), os.getpid()
            if self.pack is not None:  # its batches' leaves may be read from its memory: it exits once they are
                multiprocessing.util.Finalize(self._pool, drain, args=(self._pool,),
                                              kwargs={"done": torch_done_event()}, exitpriority=100)
            info = get_worker_info()
            if self.stock and info is not None and info.id < len(self.stock):
                self._pool.adopt(self.stock[info.id])
        return self._pool

    def __call__(self, samples):
        tensors = self.tensors and not self._off
        if get_worker_info() is None or not (tensors or self.pack):
            return self.collate(samples)
        pool = self.pool
        if self.passes is not None:
            pool.new_pass(int(self.passes[0]))
        # torch's default_collate, called here or from inside a custom collate, stacks straight into
        # segments while this worker (one thread) collates
        saved = default_collate_fn_map[torch.Tensor]
        if tensors:
            default_collate_fn_map[torch.Tensor] = self._stack
        pool.settle()
        try:
            batch = self.collate(samples)
            if self.pack is not None:  # raw leaves (bytes, arrays) copied into a segment of their own
                batch = self.pack(batch, pool)
            if tensors:
                if _opaque(batch):  # a custom batch type may hold segments out of sight: none is freed, and
                    pool.abandon()  # this worker sends torch's fresh shared memory from now on
                    self._off = True
                    return batch
                batch = _moved(batch, pool, _shared_storages(batch))  # the rest (a custom collate's, labels)
        except BaseException:  # no batch leaves: the segments it took are not lost to the pool
            pool.settle(sent=None)
            raise
        finally:
            default_collate_fn_map[torch.Tensor] = saved
        leaves = list(_tensors(batch))  # one walk: what goes out, and how many tensors a batch has
        pool.settle({t.untyped_storage().data_ptr() for t in leaves})
        if len(leaves) > self._leaves:
            self._leaves = len(leaves)
            pool.cap = self.batches * self._leaves
        return batch

    def _stack(self, batch, *, collate_fn_map=None):
        elem = batch[0]
        if not _movable(elem) or any(x.shape != elem.shape or x.dtype != elem.dtype for x in batch):
            return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)  # torch's result, or its error
        out = self.pool.place(elem.dtype, (len(batch), *elem.shape))
        if out is None:
            return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
        return torch.stack(batch, 0, out=out)


_NO_TENSORS = frozenset({bytes, bytearray, str, int, float, bool, type(None)})  # leaves known to hold no tensor
_NOT_OPAQUE = frozenset({bytes, str, int, float, bool, complex, type(None)})  # leaves _opaque passes at once


def _tensors(batch) -> list:
    """The tensor leaves of ``batch`` (dicts, lists, tuples, namedtuples), depth first."""
    out: list = []
    _collect_tensors(batch, out)
    return out


def _collect_tensors(batch, out: list) -> None:
    kind = type(batch)
    if kind is dict or kind is list or kind is tuple:  # the common containers and leaves without ABC checks
        for v in (batch.values() if kind is dict else batch):
            if type(v) not in _NO_TENSORS:
                _collect_tensors(v, out)
    elif kind in _NO_TENSORS:
        return
    elif isinstance(batch, torch.Tensor):
        out.append(batch)
    elif isinstance(batch, Mapping):
        for v in batch.values():
            _collect_tensors(v, out)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            _collect_tensors(v, out)


def _opaque(batch) -> bool:
    """Whether ``batch`` holds anything but tensors, numbers, strings, bytes, None and the containers
    :func:`_tensors` walks: a custom batch type, a dataclass or a numpy view may carry segments that
    neither this worker nor the main process can find."""
    kind = type(batch)
    if kind in _NOT_OPAQUE or kind is torch.Tensor:
        return False
    if kind is dict or kind is list or kind is tuple:
        return any(type(v) not in _NOT_OPAQUE and _opaque(v) for v in (batch.values() if kind is dict else batch))
    if isinstance(batch, (torch.Tensor, numbers.Number, str, bytes)) or batch is None:
        return False
    if isinstance(batch, Mapping):
        return any(_opaque(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return any(_opaque(v) for v in batch)
    return True


def _shared_storages(batch) -> set[int]:
    """Storages that more than one leaf of ``batch`` uses (those leaves stay as they are)."""
    seen = collections.Counter(t.untyped_storage().data_ptr() for t in _tensors(batch))
    return {ptr for ptr, n in seen.items() if n > 1}


def map_leaves(batch, leaf: Callable):
    """``batch`` with ``leaf(x)`` in place of each leaf (anything but a dict, list or tuple); a container none
    of whose leaves changed is returned as it is, others are rebuilt as torch's collate rebuilds them."""
    kind = type(batch)
    if kind is dict or kind is list:  # the common containers first: no abstract-class checks
        plain = kind is dict
    elif kind in _LEAVES:
        return leaf(batch)
    elif isinstance(batch, Mapping):
        plain = True
    elif isinstance(batch, (list, tuple)):
        plain = False
    else:
        return leaf(batch)
    if plain:
        items = {k: map_leaves(v, leaf) for k, v in batch.items()}
        if all(items[k] is v for k, v in batch.items()):
            return batch
        if kind is dict:
            return items
        if isinstance(batch, MutableMapping):  # a copy keeps the type and its other attributes
            clone = copy.copy(batch)
            clone.update(items)
            return clone
        return _rebuilt(batch, items)
    moved = [map_leaves(v, leaf) for v in batch]
    if all(a is b for a, b in zip(moved, batch)):
        return batch
    if kind is list:
        return moved
    if kind is tuple:
        return tuple(moved)
    if hasattr(batch, "_fields"):  # namedtuple
        return kind(*moved)
    return _rebuilt(batch, moved)


_LEAVES = frozenset({bytes, str, int, float, bool, type(None), torch.Tensor, bytearray})


def _moved(batch, pool: SegmentPool, keep: set[int]):
    """``batch`` with its movable tensors copied into segments of ``pool`` (see :func:`map_leaves`)."""

    def move(t):
        if (not isinstance(t, torch.Tensor) or not _movable(t) or t.untyped_storage().data_ptr() in keep
                or _segment_header(t, pool.mark) is not None):
            return t
        out = pool.place(t.dtype, t.shape, _format(t))
        return t if out is None else out.copy_(t)

    return map_leaves(batch, move)


def _rebuilt(batch, moved):
    try:
        return type(batch)(moved)
    except TypeError:  # a type that cannot be built from its items: a plain dict or list, as torch's collate does
        return moved


def _segment_header(t: torch.Tensor, mark: bytes) -> torch.Tensor | None:
    """The header of the segment of the loader marked ``mark`` that ``t`` lives in, or None."""
    storage = t.untyped_storage()
    if storage.nbytes() < HEADER or not storage.is_shared() or t.storage_offset() * t.element_size() < HEADER:
        return None
    head = _header(storage)
    return head if bytes(head[:8].tolist()) == mark else None
