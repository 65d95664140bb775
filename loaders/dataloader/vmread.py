"""(Main process) a worker batch's raw leaves read straight out of the worker's memory (``process_vm_readv``).

A worker that packs a batch of raw ``bytes`` copies every leaf into a shared-memory segment, and the main process
copies it out again: with the worker's own read from the page cache, three copies of each sample, and on a 16-core
host the workers' cost a sample rises with their number as they share the memory's bandwidth (docs/performance.md).
Where the kernel lets the main process read a worker's memory (Linux's ``process_vm_readv``: the workers are its
children; refused under Yama's ``ptrace_scope`` 2 or 3, a seccomp filter, or a worker that is not dumpable), the
worker names each leaf by its address instead and keeps it alive until the main process hands the batch's segment
back (the segment still carries the batch's pickled body): two copies a sample.

Each worker process holds a token of random bytes and writes its pid, the token's address and the token into its
segments' headers (:func:`writer`). The main process reads the token back from a worker once (:func:`allowed`), and
with every read of leaves after that, in the same call: a read that does not find the token came from another
process (the worker died and its pid was reused) and fails as the worker's death, never as wrong bytes.
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

MAX_IOV = 1024  # iovecs in one call (Linux's IOV_MAX)
MAX_CALL_BYTES = 1 << 30  # bytes in one call (Linux reads at most 2 GiB - 4 KiB a call; a larger leaf goes in pieces)
TOKEN_BYTES = 16
ENABLED = True  # False: workers always copy into their segments (what tests of that path set)
MIN_CORES = 12  # reads only from this many usable cores on: on 2 cores, 4 workers, they cost the main process more
#                 CPU than the copy out of the segment (31-36 against 19-22 us a sample, 16-18k against 19-21k
#                 samples/s); on 16, 4 and 8 workers read 24-39% more (docs/performance.md)
DRAIN_POLL_S = 0.002

_function = None  # libc's process_vm_readv, made on first use; False where this platform has none
_token = None  # (pid, buffer): this process's token, in a buffer a forked child overwrites (_new_token)
_verdicts: dict[tuple[int, bytes], bool] = {}  # (pid, token) of a worker -> whether this process may read it


def _new_token() -> None:
    """A token of this process's own, in the buffer it inherited if it was forked: a child of a worker must not
    hold the worker's token where the worker held it, or it could pass for the worker once it took its pid."""
    global _token
    if _token is None:
        os.register_at_fork(after_in_child=_new_token)  # once: forked children inherit the registration
        buf = ctypes.create_string_buffer(TOKEN_BYTES)
    else:
        buf = _token[1]
    buf.raw = os.urandom(TOKEN_BYTES)
    _token = (os.getpid(), buf)


def writer() -> tuple[int, int, bytes]:
    """This process's pid, its token's address and its token (made once per process)."""
    if _token is None or _token[0] != os.getpid():
        _new_token()
    pid, buf = _token
    return pid, ctypes.addressof(buf), buf.raw


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


def wanted() -> bool:
    """Whether this process reads its workers' memory where it may (:data:`ENABLED`, :data:`MIN_CORES`)."""
    from datapipe.device.autotune import usable_cores

    return ENABLED and usable_cores() >= MIN_CORES


def allowed(pid: int, address: int, token: bytes) -> bool:
    """Whether this process may read worker ``pid``'s memory: its ``token`` reads back from ``address`` there
    (found out once per worker; a worker already gone leaves the question open)."""
    if not ENABLED:
        return False
    key = (pid, bytes(token))
    verdict = _verdicts.get(key)
    if verdict is None:
        f = _readv()
        if f is None:
            return False
        buf = ctypes.create_string_buffer(TOKEN_BYTES)
        local = np.array([[ctypes.addressof(buf), TOKEN_BYTES]], np.uint64)
        remote = np.array([[address, TOKEN_BYTES]], np.uint64)
        got = f(pid, local.ctypes.data, 1, remote.ctypes.data, 1, 0)
        if got < 0 and ctypes.get_errno() == errno.ESRCH:
            return False
        if len(_verdicts) > 4096:  # workers of long-gone passes
            _verdicts.clear()
        verdict = _verdicts[key] = got == TOKEN_BYTES and buf.raw == key[1]
    return verdict


_GONE = (errno.ESRCH, errno.EFAULT)  # no such process, or none with the token's memory where the worker held it


class WorkerGone(RuntimeError):
    """The worker whose memory held a batch exited before the batch was read (torch's wording, so that the
    loader treats it as the worker death it is: ``loaders.dataloader.deaths``)."""


def _calls(local: np.ndarray, remote: np.ndarray):
    """``(local, remote)`` iovecs of each call: at most :data:`MAX_IOV` - 1 and :data:`MAX_CALL_BYTES` a call (a
    larger leaf in pieces)."""
    if len(local) <= MAX_IOV - 1 and int(local[:, 1].sum()) <= MAX_CALL_BYTES:
        yield local, remote
        return
    rows_l, rows_r, total = [], [], 0
    for (dst, n), (src, _) in zip(local.tolist(), remote.tolist()):
        at = 0
        while at < n:
            piece = min(n - at, MAX_CALL_BYTES - total)
            rows_l.append((dst + at, piece))
            rows_r.append((src + at, piece))
            total, at = total + piece, at + piece
            if total >= MAX_CALL_BYTES or len(rows_l) >= MAX_IOV - 1:
                yield np.array(rows_l, np.uint64), np.array(rows_r, np.uint64)
                rows_l, rows_r, total = [], [], 0
    if rows_l:
        yield np.array(rows_l, np.uint64), np.array(rows_r, np.uint64)


def _read(pid: int, probe: tuple[int, bytes], local: np.ndarray, remote: np.ndarray) -> None:
    """The leaves (:func:`_calls`), each call reading the worker's token first; raises unless every byte came from
    the worker that holds the token."""
    f = _readv()
    address, token = probe
    check = ctypes.create_string_buffer(TOKEN_BYTES)
    head_l = np.array([[ctypes.addressof(check), TOKEN_BYTES]], np.uint64)
    head_r = np.array([[address, TOKEN_BYTES]], np.uint64)
    for loc, rem in _calls(local, remote):
        loc, rem = np.concatenate([head_l, loc]), np.concatenate([head_r, rem])
        want = int(loc[:, 1].sum())
        ctypes.memset(check, 0, TOKEN_BYTES)
        got = f(pid, loc.ctypes.data, len(loc), rem.ctypes.data, len(rem), 0)
        err = ctypes.get_errno() if got < 0 else 0
        if err in _GONE or (got >= TOKEN_BYTES and check.raw != token):  # gone (its pid another's now, maybe)
            raise WorkerGone(f"DataLoader worker (pid(s) {pid}) exited unexpectedly")
        if err == errno.EPERM:
            raise RuntimeError(f"loaders.DataLoader: worker {pid} no longer lets this process read its memory (it "
                               "changed its credentials or stopped being dumpable?), so a batch of it is lost")
        if got != want:
            why = os.strerror(err) if err else f"{got} of {want} bytes"
            raise RuntimeError(f"loaders.DataLoader: reading a batch out of worker {pid}'s memory failed ({why}; an "
                               "internal error, please report it)")


def reading(pid: int, probe: tuple[int, bytes], pairs: list[tuple[int, int]], *,
            threads: int) -> tuple[list[bytes], Copying]:
    """New ``bytes`` for each ``(address, length)`` of worker ``pid``'s memory in ``pairs``, and the reads into
    them, under way in up to ``threads`` pool threads (one: done here before it returns); ``probe``: the worker's
    token's address and the token. The caller must ``wait()`` on the
    :class:`~loaders.dataloader.copyout.Copying` before any leaf is read (it raises :class:`WorkerGone` where the
    worker exited first)."""
    remote = np.array(pairs, np.uint64).reshape(-1, 2)
    lengths = remote[:, 1]
    out = [rawbytes.new_bytes(None, n) for n in lengths.tolist()]
    local = np.column_stack([np.fromiter(map(rawbytes.data_address, out), np.uint64, len(out)), lengths])
    if threads < 2 or len(pairs) < 2 or int(lengths.sum()) < MIN_BATCH_BYTES:
        _read(pid, probe, local, remote)
        return out, Copying()
    ends = np.searchsorted(np.cumsum(lengths), np.linspace(0, int(lengths.sum()), threads + 1)[1:-1])
    bounds = [0, *sorted({int(e) + 1 for e in ends if 0 <= e < len(pairs) - 1}), len(pairs)]
    copying = Copying(keep=out)
    try:
        pool = process_pool("datapipe-copy", threads)
        for lo, hi in zip(bounds, bounds[1:]):
            copying.pending.append(pool.submit(_read, pid, probe, local[lo:hi], remote[lo:hi]))
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


def drain(pool, done=None) -> None:
    """(Worker, exiting) wait until the main process has read every batch whose leaves it reads from this worker's
    memory: their segments in ``pool`` (a ``loaders.dataloader.shm.SegmentPool``) ``FREE`` again, however long
    the consumer takes (torch lets an exhausted worker go while its last batches may still wait to be read). The
    wait ends too once the pass ends (the main process sets every segment free: ``RawCopies.release``), torch
    shuts its workers down (``done``, its event: it reads no batch after) or the main process is gone."""
    parent = os.getppid()
    while pool.held_busy() and not (done is not None and done.is_set()) and os.getppid() == parent:
        time.sleep(DRAIN_POLL_S)
