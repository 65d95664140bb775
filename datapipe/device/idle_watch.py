"""How much of a consumer's wait in ``next()`` its GPU spent idle: the starved part, not the whole wait.

A loop that runs ahead of the GPU (and one under CUDA graphs, whose host launches a step in microseconds)
blocks in ``next()`` while its GPU still works through the steps it queued: that wait is the host waiting
for the GPU, not a loader starving it. Only the time from the moment the consumer's stream ran dry to the
moment the batch came starved the GPU. :class:`IdleWatch` measures that part: it asks the stream
(``query()``, no synchronisation, nothing enqueued) as the wait begins and, while the wait lasts, every
``POLL_S`` from a helper thread that sleeps between waits. ImageLoader's decoder choice judges these
seconds (:mod:`loaders.images.decoder_choice`).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["IdleWatch"]

POLL_S = 0.0005  # the idle part is found to within this (against steps of 10-60 ms)


class IdleWatch:
    """Times the idle part of each wait: ``begin()`` as ``next()`` starts, ``end()`` as the batch came.

    ``stream()`` returns the consumer's stream (called in the consumer's thread, at ``begin``); anything with
    ``query()`` -> True once it has nothing left to run. ``threaded=False`` polls only when :meth:`poll` is
    called (tests); otherwise one daemon thread, started at the first wait that begins with the stream busy,
    polls while a wait lasts. :meth:`close` stops it.
    """

    def __init__(self, stream: Callable[[], Any], *, clock: Callable[[], float] = time.perf_counter,
                 threaded: bool = True):
        self._stream_of = stream
        self._clock = clock
        self._threaded = threaded
        self._stream = None
        self._wait = 0  # the current wait's number (0: none yet); a finding carries the number of its wait
        self._since: tuple[int, float] | None = None  # (wait, clock) when the stream was first seen idle in it
        self._active = False  # a wait is on
        self._closed = False
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def begin(self) -> None:
        """(Consumer) a wait starts now."""
        self._wait += 1
        start = self._clock()
        self._stream = self._stream_of()
        if self._stream.query():  # nothing left to run already: all of this wait starves the GPU
            self._since = (self._wait, start)
            return
        self._since = None
        if self._threaded:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="datapipe-idle-watch", daemon=True)
                self._thread.start()
            with self._cv:
                self._active = True
                self._cv.notify()

    def poll(self) -> None:
        """Ask the stream once; the first idle answer of a wait is when its starved part began."""
        wait, stream, since = self._wait, self._stream, self._since
        if stream is None or (since is not None and since[0] == wait):
            return
        if stream.query():
            now = self._clock()
            if wait == self._wait:  # not the finding of a wait that has ended since
                self._since = (wait, now)

    def end(self) -> float:
        """(Consumer) the batch came: the seconds of this wait the stream had nothing to run (0.0 if none)."""
        now = self._clock()
        self._active = False
        since = self._since
        if since is None or since[0] != self._wait:
            return 0.0
        return max(0.0, now - since[1])

    def _run(self) -> None:
        handled = 0
        while not self._closed:
            with self._cv:
                while not self._closed and not (self._active and self._wait != handled):
                    self._cv.wait(timeout=1.0)
                wait = handled = self._wait
            while self._active and self._wait == wait and not self._closed:
                self.poll()
                since = self._since
                if since is not None and since[0] == wait:
                    break  # found for this wait: nothing more to look for
                time.sleep(POLL_S)

    def close(self) -> None:
        """Stop the helper thread (it exits at once; it holds nothing)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
