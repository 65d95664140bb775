"""(Main process) a batch's raw leaves copied out of a worker's segment into fresh ``bytes``, in a few threads.

With workers, the main process copies every raw leaf into a ``bytes`` of its own, and that copy is most of its
work per sample (docs/performance.md): one thread copies ~5-7 GB/s, which caps what any number of workers
deliver. For a batch of large leaves on a machine with cores to spare, the ``bytes`` objects are made here
uninitialised (``PyBytes_FromStringAndSize(NULL, n)``, the way C code makes them, written before anyone sees
them) and filled with ``memmove`` in a few threads, which release the interpreter lock while they copy.
Small batches, small leaves and small machines copy as before (``bytes(view[a:b])``).
"""
from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from datapipe.read.pools import process_pool

MIN_BATCH_BYTES = 4 << 20  # a batch smaller than this is copied in the calling thread
MIN_LEAF = 16 << 10  # leaves smaller than this are copied as before (a bytes of their own, in one call)
CORES_PER_THREAD = 4  # one copying thread per this many usable cores, at most MAX_THREADS
MAX_THREADS = 4

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.restype, _bytes_address.argtypes = ctypes.c_void_p, (ctypes.py_object,)
_memmove = ctypes.memmove  # a foreign function: it releases the interpreter lock while it copies



def copy_threads() -> int:
    """Threads a large batch is copied in here (1: the calling thread alone)."""
    from datapipe.device.autotune import usable_cores

    return max(1, min(MAX_THREADS, usable_cores() // CORES_PER_THREAD))


def _executor(workers: int) -> ThreadPoolExecutor:
    """This process's copying threads (datapipe.read.pools: made on first use; a forked child makes its own)."""
    return process_pool("datapipe-copy", workers)


def _copy(jobs: list[tuple[int, int, int]]) -> None:
    for dst, src, n in jobs:
        _memmove(dst, src, n)


def copied_out(view: memoryview, spans, *, threads: int | None = None) -> list[bytes]:
    """``bytes(view[offset:offset + n])`` for each ``(offset, n)`` pair in the flat ``spans``, in order."""
    it = iter(spans)
    pairs = list(zip(it, it))
    threads = copy_threads() if threads is None else threads
    if threads < 2 or sum(n for _, n in pairs) < MIN_BATCH_BYTES:
        return [bytes(view[offset:offset + n]) for offset, n in pairs]
    size = len(view)
    if any(offset < 0 or n < 0 or offset + n > size for offset, n in pairs):
        raise ValueError(f"loaders.DataLoader: a leaf lies outside its {size}-byte segment (an internal error; "
                         "please report it)")
    base = np.frombuffer(view, np.uint8).ctypes.data
    out: list[bytes] = []
    jobs: list[tuple[int, int, int]] = []
    for offset, n in pairs:
        if n < MIN_LEAF:
            out.append(bytes(view[offset:offset + n]))
        else:
            leaf = _new_bytes(None, n)
            out.append(leaf)
            jobs.append((_bytes_address(leaf), base + offset, n))
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
    pending = []
    try:
        pool = _executor(threads - 1)
        for c in chunks[1:]:
            pending.append(pool.submit(_copy, c))
        _copy(chunks[0] if chunks else [])
    finally:
        wait(pending)  # no thread may still write into a leaf once this returns or raises (the leaves go with it)
    for future in pending:
        future.result()
    return out
