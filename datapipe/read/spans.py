"""Many values of one local file read ahead into fresh ``bytes`` by a few threads, while the caller goes on.

A one-process reader hands out each value as new ``bytes``, and on a fast host the kernel's copy of the value
from the page cache into that new memory is most of its time per sample (docs/performance.md). ``start_spans``
reads a run of values (the next samples of a shard, from its member table) with one ``preadv`` per stretch of
the file: each value's ``bytes`` is made uninitialised (``PyBytes_FromStringAndSize(NULL, n)``, as C code makes
them, and written before anyone sees it) and is one of the call's buffers; what lies between values (tar
headers, padding) lands in a scratch buffer. The stretches are shared among pool threads, each calling
``preadv`` through ctypes, which lets go of the interpreter lock for the whole call, so the copies run on other
cores while the caller hands out the values read before (the consuming thread's work per sample is then its
Python alone).

A read that comes back short (the file shrank) gives None and hands out nothing: the caller reads those values
one by one, as before, and reports where the file ends.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from datapipe.read.pools import process_pool

MAX_GAP = 64 << 10  # a gap wider than this between two values ends a stretch (it is not read)
MAX_IOV = 1024  # buffers in one preadv (Linux's IOV_MAX)
MIN_THREAD_BYTES = 1 << 20  # a thread is worth its hand-over for at least this many bytes
MAX_VALUE = 32 << 20  # larger values are read on their own (one pread may return less than asked past 2 GB)

_lib = None  # what _functions() returns, made on first use; False where this platform cannot
_scratch = None
_init_lock = threading.Lock()
POOL = "datapipe-read"  # the reading threads' name (datapipe.read.pools)


CORES_PER_THREAD = 4  # by default one reading thread per this many usable cores, MIN_THREADS to MAX_THREADS
MIN_THREADS, MAX_THREADS = 2, 4


def read_threads(asked: int | None, *, in_worker: bool) -> int:
    """The threads a stream reads local values with (``StorageOptions.read_threads``; 0: a ``pread`` each)."""
    if not available():
        return 0
    if asked is not None:
        return asked
    from datapipe.device.autotune import usable_cores

    cores = usable_cores()
    if in_worker or cores < 2:
        return 0
    return max(MIN_THREADS, min(MAX_THREADS, cores // CORES_PER_THREAD))


def available() -> bool:
    """Whether this platform has what ``start_spans`` needs (Linux's ``preadv`` in the C library, CPython)."""
    return _functions() is not None


def _functions():
    """``(preadv, new_bytes, data_offset, scratch address, scratch size)``, made once per process under a lock
    (two threads starting at once must not make two scratch buffers), or None where this platform lacks them."""
    global _lib, _scratch
    if _lib is None:
        with _init_lock:
            if _lib is None:
                try:
                    if ctypes.sizeof(ctypes.c_void_p) != 8:
                        raise OSError("the iovecs are built as two 64-bit words: 64-bit platforms only")
                    from datapipe.read import rawbytes  # CPython's C API through ctypes
                    libc = ctypes.CDLL(None, use_errno=True)
                    preadv = getattr(libc, "preadv64", None) or libc.preadv  # CDLL: the interpreter lock is let go
                    preadv.restype = ctypes.c_ssize_t
                    preadv.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64)
                    if _scratch is None:  # never replaced: reads may still write gaps into it
                        _scratch = ctypes.create_string_buffer(MAX_GAP)  # threads share it: never read
                    _lib = (preadv, rawbytes.new_bytes, rawbytes.DATA_OFFSET, ctypes.addressof(_scratch),
                            len(_scratch))
                except (AttributeError, OSError, TypeError, ValueError):
                    _lib = False
    return _lib or None


def _executor(threads: int) -> ThreadPoolExecutor:
    """This process's reading threads, at least ``threads`` of them."""
    return process_pool(POOL, threads)


def _stretches(spans: list[tuple[int, int]], most: int, max_gap: int = MAX_GAP) -> list[list[int]]:
    """Indices of ``spans`` grouped into stretches one ``preadv`` reads: in file order, gaps of at most ``max_gap``
    (the scratch buffer's size), at most ``MAX_IOV`` buffers (values and gaps) and, past its first value, at most
    ``most`` bytes each."""
    groups: list[list[int]] = []
    end = None
    buffers = filled = 0
    for i, (offset, size) in enumerate(spans):
        gap = None if end is None else offset - end
        if gap is None or gap < 0 or gap > max_gap or buffers + 2 > MAX_IOV or filled + gap + size > most:
            groups.append([i])
            buffers, filled = 1, size
        else:
            groups[-1].append(i)
            buffers += 2 if gap else 1
            filled += gap + size
        end = offset + size
    return groups


def _read_stretch(preadv, fd: int, iov: np.ndarray, count: int, offset: int, want: int) -> bool:
    """One ``preadv`` of ``count`` buffers described by ``iov``; whether all ``want`` bytes came."""
    got = preadv(fd, iov.ctypes.data, count, offset)
    if got == want:
        return True
    if got < 0 and ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
        global _lib
        _lib = False  # a sandbox that refuses preadv: read a pread a value from now on
    if got <= 0:
        return False  # the file ends first (or an error: the caller's own reads say which)
    return _read_rest(fd, iov, count, offset, got, want)  # cut short (a regular file does so only at its end)


def _read_rest(fd: int, iov: np.ndarray, count: int, offset: int, got: int, want: int) -> bool:
    """Finish a stretch whose ``preadv`` stopped ``got`` bytes in, buffer by buffer with ``os.pread``."""
    at = 0
    for base, length in iov.reshape(-1, 2)[:count].tolist():
        skip = min(max(got - at, 0), length)
        if skip < length:
            data = os.pread(fd, length - skip, offset + at + skip)
            if len(data) != length - skip:
                return False
            ctypes.memmove(base + skip, data, len(data))
        at += length
    return at == want


def _prepare(fd: int, spans: list[tuple[int, int]], threads: int):
    """The values made (uninitialised) and their stretches in shares a thread each: ``(values, shares, preadv)``,
    or None where they cannot be read this way."""
    lib = _functions()
    if lib is None or any(size > MAX_VALUE or size < 0 for _, size in spans):
        return None
    preadv, new_bytes, data_offset, scratch, scratch_size = lib
    out = [new_bytes(None, size) for _, size in spans]
    total = sum(size for _, size in spans)
    threads = max(1, min(threads, total // MIN_THREAD_BYTES))
    jobs = []  # (iov, count, offset, bytes) per stretch
    for group in _stretches(spans, -(-total // threads), scratch_size):
        flat: list[int] = []
        first = end = spans[group[0]][0]
        for i in group:
            offset, size = spans[i]
            if offset > end:
                flat += (scratch, offset - end)  # the gap (headers, padding): into the scratch, never read
            flat += (id(out[i]) + data_offset, size)
            end = offset + size
        jobs.append((np.array(flat, np.uint64), len(flat) // 2, first, end - first))
    return out, _shares(jobs, threads), preadv


class Reading:
    """Values being read by pool threads while the caller goes on (:func:`start_spans`). ``values``: the
    ``bytes`` being filled, never to be read, hashed or handed out before every one of ``futures`` is done and
    gave True (``result()`` waits for that)."""

    def __init__(self, out: list[bytes], futures: list):
        self.values, self.futures, self._pid = out, futures, os.getpid()

    def result(self) -> list[bytes] | None:
        """The values once every thread is done, or None where the file no longer held one of them whole (or in a
        forked child, which has none of the threads: the caller reads the values itself)."""
        if self._pid != os.getpid():
            return None
        wait(self.futures)  # all of them, also where one fails: none may still write into a value after this
        return self.values if all([f.result() for f in self.futures]) else None


def start_spans(fd: int, spans: list[tuple[int, int]], *, threads: int = 1) -> Reading | None:
    """Start reading ``os.pread(fd, size, offset)`` for each ``(offset, size)`` of ``spans``, in ``threads`` pool
    threads, while the caller goes on; None where they cannot be read this way (a value over ``MAX_VALUE``, no
    ``preadv``, an interpreter shutting down: the caller reads them itself). ``result()`` waits and gives the values
    in order, or None where the file no longer held one of them whole (nothing is handed out then). The threads
    read a duplicate of ``fd``, closed when they are done: the caller may close its own at any time, and need not
    wait for a read it no longer wants (its values stay alive until the threads let them go)."""
    prepared = _prepare(fd, spans, threads)
    if prepared is None:
        return None
    out, shares, preadv = prepared
    own = os.dup(fd)
    futures: list = []
    try:
        pool = _executor(len(shares))
        for share in shares:
            futures.append(pool.submit(_read_share, preadv, own, share, out))
    except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
        _close_when_done(own, futures)
        return None
    except BaseException:
        _close_when_done(own, futures)
        raise
    _close_when_done(own, futures)
    return Reading(out, futures)


def _close_when_done(fd: int, futures: list) -> None:
    """Close ``fd`` once every one of ``futures`` is done (at once if there are none)."""
    if not futures:
        os.close(fd)
        return
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            os.close(fd)

    for future in futures:
        future.add_done_callback(one_done)


def _shares(jobs: list, threads: int) -> list[list]:
    """The stretches in ``threads`` runs of about equal bytes (each stretch goes where its middle falls)."""
    if threads < 2:
        return [jobs]
    per = sum(job[3] for job in jobs) / threads
    shares: list[list] = [[] for _ in range(threads)]
    filled = 0
    for job in jobs:
        shares[min(threads - 1, int((filled + job[3] / 2) // per))].append(job)
        filled += job[3]
    return [share for share in shares if share]


def _read_share(preadv, fd: int, share: list, values: list) -> bool:
    """One thread's stretches; ``values`` (the bytes they are read into) stay alive until it returns."""
    return all(_read_stretch(preadv, fd, iov, count, offset, want) for iov, count, offset, want in share)
