"""A worker process of ``loaders.DataLoader`` that dies: torch's error, soon, from whichever thread reads torch's pipe.

torch finds a dead worker two ways: its SIGCHLD handler raises in the main thread, and its iterator,
waiting for a batch, looks at its workers every ``MP_STATUS_CHECK_INTERVAL`` (5 s). Where the loader
reads torch's iterator in a thread of its own (``device=``, a pin thread), only the second reaches that
thread, 5 s late, and the main thread then waits on it. :func:`watch` makes the iterator look every
:data:`POLL_S` when it waits without a user ``timeout``. A batch whose shared memory the main process
was fetching from the worker as it died fails with ``ConnectionResetError`` or ``EOFError`` (its socket
closed), before the worker counts as dead: :func:`death` waits up to :data:`GRACE_S` for it to, and
gives torch's message instead. A dead worker ends the pass (:func:`fatal`): torch's iterator would go on
without the dead worker's batches; persistent workers with one dead (:func:`dead`) are let go before the
next pass, which starts new ones.
"""
from __future__ import annotations

import threading
import time
import weakref

__all__ = ["GRACE_S", "POLL_S", "PassLeft", "dead", "death", "fatal", "watch"]

POLL_S = 0.2  # how often a waiting iterator looks at its workers
GRACE_S = 1.0  # how long a broken connection waits for its worker to count as dead
_BROKEN = (ConnectionError, EOFError)
_TORCH = "DataLoader worker (pid"  # every torch message about a worker that died starts so


class PassLeft(BaseException):
    """Raised in a thread that waits on torch's iterator for a pass its consumer has left
    (:func:`watch`'s ``leaving``): the thread's stream ends there, shutting torch's workers down as a pass left
    in the consumer's own thread does, instead of waiting for a batch nobody takes."""


def watch(torch_it, leaving=None) -> None:
    """Make ``torch_it`` (torch's multi-process iterator) look at its workers every :data:`POLL_S` while it
    waits for a batch without a user ``timeout`` (torch: every 5 s); and, once ``leaving`` (a
    ``threading.Event``) is set, raise :class:`PassLeft` in the thread that called this, instead of waiting on
    (a user ``timeout`` is then waited in :data:`POLL_S` slices, as one wait)."""
    try:  # each pass's own (persistent workers keep one torch iterator); no other thread ever raises it
        torch_it._datapipe_leaving = (leaving, threading.get_ident()) if leaving is not None else None
    except AttributeError:  # not one of torch's iterators
        pass
    try_get = getattr(type(torch_it), "_try_get_data", None)
    if try_get is None or getattr(torch_it.__dict__.get("_try_get_data"), "_datapipe_watch", False):
        return
    ref = weakref.ref(torch_it)  # no cycle: torch's iterator is freed (its workers shut down) when dropped

    def polled(timeout=None):
        it = ref()
        left = it.__dict__.get("_datapipe_leaving")
        if left is None or left[1] != threading.get_ident():
            return try_get(it, POLL_S if timeout is None else timeout)
        end = time.monotonic() + (POLL_S if timeout is None else timeout)
        while True:
            if left[0].is_set():
                raise PassLeft
            rest = end - time.monotonic()
            got = try_get(it, max(0.0, min(POLL_S, rest)))
            if got[0] or rest <= POLL_S:
                return got

    polled._datapipe_watch = True
    torch_it._try_get_data = polled


def dead(torch_it) -> list:
    """The workers of ``torch_it`` that torch still counts on and that have exited."""
    workers = getattr(torch_it, "_workers", None) or []
    status = getattr(torch_it, "_workers_status", None) or []
    return [w for i, w in enumerate(workers) if i < len(status) and status[i] and not w.is_alive()]


def fatal(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's error for a worker that died."""
    return isinstance(exc, RuntimeError) and str(exc).startswith(_TORCH)


def death(torch_it, exc: BaseException) -> RuntimeError | None:
    """torch's error for a worker of ``torch_it`` that died, if one did, given ``exc`` raised by ``next()``;
    a broken connection waits up to :data:`GRACE_S` for its worker to count as dead."""
    end = time.monotonic() + (GRACE_S if isinstance(exc, _BROKEN) else 0.0)
    while True:
        gone = dead(torch_it)
        if gone:
            pids = ", ".join(str(w.pid) for w in gone)
            return RuntimeError(f"DataLoader worker (pid(s) {pids}) exited unexpectedly")
        if time.monotonic() >= end:
            return None
        time.sleep(0.01)
