"""(Main process) a batch's raw leaves copied out of a worker's segment into fresh ``bytes``, in a few threads.

With workers, the main process copies every raw leaf into a ``bytes`` of its own, and that copy is most of its
work per sample (docs/performance.md): one thread copies ~5-7 GB/s, which caps what any number of workers
deliver. For a batch of large leaves on a machine with cores to spare, the ``bytes`` objects are made here
uninitialised (``PyBytes_FromStringAndSize(NULL, n)``, the way C code makes them, written before anyone sees
them) and filled with ``memmove`` in a few threads, which release the interpreter lock while they copy; the
calling thread meanwhile builds the batch around the leaves (:func:`copying_out`) and copies nothing itself, so
its work per sample is the batch's Python alone. Small batches, small leaves and small machines copy as before
(``bytes(view[a:b])``).

On a machine of :data:`READ_MIN_CORES` cores or more, a segment whose file descriptor torch keeps open (its
``file_descriptor`` strategy) is read instead: the leaves' ``bytes`` are filled by ``preadv`` from that file in
up to :data:`READ_MAX_THREADS` threads (:func:`datapipe.read.spans.start_spans`), one call per thread for all
its leaves, which lets go of the interpreter lock once, where ``memmove`` takes it back after every leaf. On a
16-core host, 256 leaves of 106 KB: 1.0-1.1 ms in 8 threads, 1.3-1.4 ms in 4, against 2.4-2.6 ms copied as
above in 4 (docs/performance.md); on the 2-core machine the kernel's copy loses (6.6 against 2.8 ms in one
thread), so it is not used there.
"""
from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from datapipe.read import rawbytes
from datapipe.read.heap import keep_freed_memory
from datapipe.read.pools import process_pool
from datapipe.read.spans import start_spans

MIN_BATCH_BYTES = 4 << 20  # a batch smaller than this is copied in the calling thread
MIN_LEAF = 16 << 10  # leaves smaller than this are copied as before (a bytes of their own, in one call)
CORES_PER_THREAD = 4  # one copying thread per this many usable cores, at most MAX_THREADS
MAX_THREADS = 4
READ_MIN_CORES = 12  # a segment is read from its file from this many usable cores on (below: copied as above)
READ_MAX_THREADS = 8  # half the usable cores read it, at most this many threads

_new_bytes = rawbytes.new_bytes
_memmove = ctypes.memmove  # a foreign function: it releases the interpreter lock while it copies



def copy_threads() -> int:
    """Pool threads a large batch is copied in here (1: the calling thread copies it alone)."""
    from datapipe.device.autotune import usable_cores

    return max(1, min(MAX_THREADS, usable_cores() // CORES_PER_THREAD))


def read_threads() -> int:
    """Threads a large batch is read from its segment's file in (0: it is copied from the mapping instead)."""
    from datapipe.device.autotune import usable_cores

    cores = usable_cores()
    return min(READ_MAX_THREADS, cores // 2) if cores >= READ_MIN_CORES else 0


def segment_fd(storage, first: bytes) -> int | None:
    """The file descriptor torch keeps open for the shared-memory ``storage`` (its ``file_descriptor``
    strategy), where the file's first bytes are ``first`` (the storage's own: its data starts the file); None
    otherwise. The storage owns it: it is never closed here."""
    try:
        fd = storage._get_shared_fd()  # raises where torch keeps none (``file_system``, private memory)
        return fd if fd >= 0 and os.pread(fd, len(first), 0) == first else None
    except (AttributeError, OSError, RuntimeError):
        return None


def _executor(workers: int) -> ThreadPoolExecutor:
    """This process's copying threads (datapipe.read.pools: made on first use; a forked child makes its own)."""
    return process_pool("datapipe-copy", workers)


def _copy(jobs: list[tuple[int, int, int]]) -> None:
    for dst, src, n in jobs:
        _memmove(dst, src, n)


def copied_out(view: memoryview, spans, *, threads: int | None = None) -> list[bytes]:
    """``bytes(view[offset:offset + n])`` for each ``(offset, n)`` pair in the flat ``spans``, in order."""
    out, copying = copying_out(view, spans, threads=threads)
    copying.wait()
    return out


class Copying:
    """The copies :func:`copying_out` started: ``wait()`` returns once every one is done (raising a thread's
    error); until then no leaf may be read, and the segment must stay as it is. ``keep``: the leaves and the
    segment's view, held until then (the threads have their addresses alone)."""

    def __init__(self, keep=None):
        self.pending: list = []
        self.keep = keep

    def __del__(self):
        if self.pending:  # dropped unwaited (a batch started ahead of a pass that ended): its leaves outlive the copies
            try:
                _wait_through(self.pending)
            except BaseException:  # noqa: BLE001 - nobody reads these leaves
                pass

    def wait(self) -> None:
        """Wait for every copy, even through an exception a signal raises meanwhile (Ctrl-C), which is raised
        once they have ended: a leaf freed while a thread still writes into it would corrupt memory."""
        pending = self.pending
        try:
            _wait_through(pending)
        finally:
            self.keep = None
            self.pending = []  # only now: settle() in another thread waits for them until they end
        for future in pending:
            future.result()

    def settle(self) -> None:
        """Wait until every copy has ended (whoever else waits for them too); raise nothing of theirs."""
        _wait_through(list(self.pending))


class _ReadOut(Copying):
    """The reads :func:`copying_out` started from a segment's file: ``wait()`` as :class:`Copying`'s; where a
    read failed or came back short, the leaves are then copied from the mapping instead, before anyone sees
    them."""

    def __init__(self, futures: list, out: list, view: memoryview, pairs: list):
        super().__init__(keep=(out, view, pairs))
        self.pending = list(futures)

    def wait(self) -> None:
        pending = self.pending
        out, view, pairs = self.keep
        try:
            _wait_through(pending)
            if not all(f.exception() is None and f.result() for f in pending):
                base = np.frombuffer(view, np.uint8).ctypes.data
                for leaf, (offset, n) in zip(out, pairs):
                    _memmove(rawbytes.data_address(leaf), base + offset, n)
        finally:
            self.keep = None
            self.pending = []


def _wait_through(pending) -> None:
    """Wait for every one of ``pending``, even through an exception a signal raises meanwhile (Ctrl-C), which is
    raised once they have ended: a leaf freed while a thread still writes into it would corrupt memory."""
    interrupted = None
    while True:
        try:
            wait(pending)
            break
        except BaseException as e:  # noqa: BLE001 - raised below, once no thread writes any more
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted


def _plain(view: memoryview, pairs) -> list[bytes]:
    """Each leaf copied in the calling thread, a ``bytes`` of its own."""
    return [bytes(view[offset:offset + n]) for offset, n in pairs]


def copying_out(view: memoryview, spans, *, threads: int | None = None, fd: int | None = None, fd_offset: int = 0,
                reads: int | None = None) -> tuple[list[bytes], Copying]:
    """The leaves :func:`copied_out` gives, and the copies into them still under way in the pool's threads
    (:class:`Copying`): the caller may do other work that never reads, hashes or hands out a leaf (unpickle a plain
    body around them) before it waits, but must wait, also on an error, before any leaf is read or the segment is
    handed back. ``fd``: the segment's file (:func:`segment_fd`), where ``view`` starts ``fd_offset`` bytes in:
    read in ``reads`` threads (None: :func:`read_threads`; under 2: copied from ``view``)."""
    it = iter(spans)
    pairs = list(zip(it, it))
    threads = copy_threads() if threads is None else threads
    reads = (read_threads() if reads is None else reads) if fd is not None else 0
    if max(threads, reads) < 2 or sum(n for _, n in pairs) < MIN_BATCH_BYTES:
        return _plain(view, pairs), Copying()
    size = len(view)
    if any(offset < 0 or n < 0 or offset + n > size for offset, n in pairs):
        raise ValueError(f"loaders.DataLoader: a leaf lies outside its {size}-byte segment (an internal error; "
                         "please report it)")
    if reads >= 2:
        reading = start_spans(fd, [(fd_offset + offset, n) for offset, n in pairs], threads=reads)
        if reading is not None:
            return reading.values, _ReadOut(reading.futures, reading.values, view, pairs)
        if threads < 2:
            return _plain(view, pairs), Copying()
    base = np.frombuffer(view, np.uint8).ctypes.data
    out: list[bytes] = []
    jobs: list[tuple[int, int, int]] = []
    for offset, n in pairs:
        if n < MIN_LEAF:
            out.append(bytes(view[offset:offset + n]))
        else:
            leaf = _new_bytes(None, n)
            out.append(leaf)
            jobs.append((rawbytes.data_address(leaf), base + offset, n))
    share = -(-sum(n for _, _, n in jobs) // threads)
    chunks, chunk, filled = [], [], 0
    for job in jobs:  # contiguous runs of about equal bytes, one a thread
        chunk.append(job)
        filled += job[2]
        if filled >= share:
            chunks.append(chunk)
            chunk, filled = [], 0
    if chunk:
        chunks.append(chunk)
    copying = Copying(keep=(out, view))
    try:
        pool = _executor(threads)
        for c in chunks:
            copying.pending.append(pool.submit(_copy, c))
    except BaseException:
        copying.wait()  # none may still write into a leaf once this raises (the leaves go with it)
        raise
    return out, copying


def keep_heap_for(dataset) -> None:
    """Raw leaves are copied out into new ``bytes`` each batch: keep the memory the last batches freed
    (:func:`datapipe.read.heap.keep_freed_memory`; 2-core machine, 2 workers: page faults 0.4-1.0 -> 0 a sample,
    3-5% faster), unless the dataset's (or its ``stream``'s) storage options keep the allocator as it is."""
    storage = getattr(dataset, "storage", None) or getattr(getattr(dataset, "stream", None), "storage", None)
    if getattr(storage, "keep_freed_memory", True):
        keep_freed_memory()
