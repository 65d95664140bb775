"""(Main process) a worker batch's raw leaves read straight out of the worker's memory (``process_vm_readv``).

A worker that packs a batch of raw ``bytes`` copies every leaf into a shared-memory segment, and the main process
copies it out again: with the worker's own read from the page cache, three copies of each sample, and on a 16-core
host the workers' cost a sample rises with their number as they share the memory's bandwidth (docs/performance.md).
Where the kernel lets the main process read its workers' memory (Linux's ``process_vm_readv``: the workers are its
children; refused under Yama's ``ptrace_scope`` 2 or 3 or a seccomp filter), a worker names each leaf by its address
instead and keeps it alive until the main process hands the batch's segment back (the segment still carries the
batch's pickled body and the worker's pid): two copies a sample. The main process finds out once whether it may, by
reading a probe of known content from the first worker that sends it a segment (:func:`allowed`); until then, and
wherever it may not, workers copy into the segment as before.
"""
from __future__ import annotations

import ctypes
import errno
import multiprocessing
import os
import time

import numpy as np

from datapipe.read import rawbytes
from datapipe.read.pools import process_pool
from loaders.dataloader.copyout import MIN_BATCH_BYTES, Copying, _wait_through

PROBE = b"datapipe: this worker's memory, read by the main process (loaders.dataloader.vmread)"
MAX_IOV = 1024  # iovecs in one call (Linux's IOV_MAX)
ENABLED = True  # False: workers always copy into their segments (what tests of that path set)

_function = None  # libc's process_vm_readv, made on first use; False where this platform has none
_verdict: bool | None = None  # whether this process may read its workers' memory (None: not found out yet)


def probe_address() -> int:
    """Where :data:`PROBE`'s bytes lie in this process (a worker writes it in its segment's header)."""
    return rawbytes.data_address(PROBE)


def _readv():
    global _function
    if _function is None:
        try:
            f = ctypes.CDLL(None, use_errno=True).process_vm_readv  # CDLL: the interpreter lock is let go
            f.restype = ctypes.c_ssize_t
            f.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                          ctypes.c_ulong)
            _function = f
        except (OSError, AttributeError):  # not Linux, or a C library without it
            _function = False
    return _function or None


def allowed(pid: int, address: int) -> bool:
    """Whether this process may read its workers' memory: found out once per process, by reading the probe that
    worker ``pid`` holds at ``address``; a worker already gone leaves the question open."""
    global _verdict
    if not ENABLED:
        return False
    if _verdict is None:
        f = _readv()
        if f is None:
            _verdict = False
            return False
        n = len(PROBE)
        buf = ctypes.create_string_buffer(n)
        local = np.array([[ctypes.addressof(buf), n]], np.uint64)
        remote = np.array([[address, n]], np.uint64)
        got = f(pid, local.ctypes.data, 1, remote.ctypes.data, 1, 0)
        if got < 0 and ctypes.get_errno() == errno.ESRCH:
            return False
        _verdict = got == n and buf.raw == PROBE
    return _verdict


class WorkerGone(RuntimeError):
    """The worker whose memory held a batch exited before the batch was read (torch's wording, so that the
    loader treats it as the worker death it is: ``loaders.dataloader.deaths``)."""


def _read(pid: int, local: np.ndarray, remote: np.ndarray) -> None:
    """One call per :data:`MAX_IOV` leaves; raises unless every byte came."""
    f = _readv()
    for lo in range(0, len(local), MAX_IOV):
        loc, rem = local[lo:lo + MAX_IOV], remote[lo:lo + MAX_IOV]
        want = int(loc[:, 1].sum())
        got = f(pid, loc.ctypes.data, len(loc), rem.ctypes.data, len(rem), 0)
        if got == want:
            continue
        err = ctypes.get_errno() if got < 0 else 0
        if err == errno.ESRCH:
            raise WorkerGone(f"DataLoader worker (pid(s) {pid}) exited unexpectedly")
        why = os.strerror(err) if err else f"{got} of {want} bytes"
        raise RuntimeError(f"loaders.DataLoader: reading a batch out of worker {pid}'s memory failed ({why}; an "
                           "internal error, please report it)")


def reading(pid: int, pairs: list[tuple[int, int]], *, threads: int) -> tuple[list[bytes], Copying]:
    """New ``bytes`` for each ``(address, length)`` of worker ``pid``'s memory in ``pairs``, and the reads into
    them, under way in up to ``threads`` pool threads (one: done here before it returns): the caller must
    ``wait()`` on the :class:`~loaders.dataloader.copyout.Copying` before any leaf is read (it raises
    :class:`WorkerGone` where the worker exited first)."""
    out = [rawbytes.new_bytes(None, n) for _, n in pairs]
    lengths = np.fromiter((n for _, n in pairs), np.uint64, len(pairs))
    local = np.empty((len(pairs), 2), np.uint64)
    local[:, 0] = np.fromiter(map(rawbytes.data_address, out), np.uint64, len(out))
    local[:, 1] = lengths
    remote = np.empty_like(local)
    remote[:, 0] = np.fromiter((a for a, _ in pairs), np.uint64, len(pairs))
    remote[:, 1] = lengths
    if threads < 2 or len(pairs) < 2 or int(lengths.sum()) < MIN_BATCH_BYTES:
        _read(pid, local, remote)
        return out, Copying()
    ends = np.searchsorted(np.cumsum(lengths), np.linspace(0, int(lengths.sum()), threads + 1)[1:-1])
    bounds = [0, *sorted({int(e) + 1 for e in ends if 0 <= e < len(pairs) - 1}), len(pairs)]
    copying = Copying(keep=out)
    try:
        pool = process_pool("datapipe-copy", threads)
        for lo, hi in zip(bounds, bounds[1:]):
            copying.pending.append(pool.submit(_read, pid, local[lo:hi], remote[lo:hi]))
    except BaseException:
        _wait_through(copying.pending)  # none may still write into a leaf once this raises
        raise
    return out, copying


def torch_done_event():
    """(Worker) the event torch's DataLoader sets as it shuts its workers down (one of the worker process's
    arguments), or None."""
    from multiprocessing.synchronize import Event

    args = getattr(multiprocessing.current_process(), "_args", None) or ()
    return next((a for a in args if isinstance(a, Event)), None)


def drain(pool, done=None, timeout: float = 60.0) -> None:
    """(Worker, exiting) wait until the main process has read every batch whose leaves it reads from this worker's
    memory: their segments in ``pool`` (a ``loaders.dataloader.shm.SegmentPool``) ``FREE`` again. torch lets an
    exhausted worker go while its last batches may still wait to be read. The wait ends too once the pass ends
    (the main process sets every segment free: ``RawCopies.release``), torch shuts its workers down (``done``, its
    event: it reads no batch after), the main process is gone, or ``timeout`` passed."""
    parent, end = os.getppid(), time.monotonic() + timeout
    while pool.held_busy() and not (done is not None and done.is_set()) and os.getppid() == parent \
            and time.monotonic() < end:
        time.sleep(0.001)
