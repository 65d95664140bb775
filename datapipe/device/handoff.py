"""Producers that run ahead of the consumer: in a background thread, and on a side CUDA stream.

:class:`Producer` is the one mechanism: a thread pulls items from an iterable into a queue,
at most ``depth`` ahead; the consumer's ``next()`` takes one, runs its ``handoff`` and only then
frees the slot, so the producer's next item starts after the handoff. ``threaded`` runs any
iterable that way; :func:`datapipe.device.side_stream.on_side_stream` does it for a producer of CUDA
tensors (ImageLoader drives DALI with it) and :class:`datapipe.DevicePrefetcher` for host-to-device copies: the producer's
GPU work runs on its own stream and the consumer's stream waits for it with an event
(:func:`wait_and_keep`), not the host.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from datapipe.device import forks
from datapipe.device.pacing import Pacer, check_pace

__all__ = ["close_last", "CurrentStream", "PassThreads", "Producer", "ProducerMeter", "Retirer", "started", "threaded",
           "wait_and_keep"]

_POLL_S = 0.05
WAIT_NOTE_S = 30.0  # PassThreads.wait logs every this many seconds it waits
log = logging.getLogger(__name__)
_END = object()


class ProducerMeter:
    """CPU seconds a producer thread spent making items (``time.thread_time``), and the items made.

    An upper bound on that thread's share of the GIL: C code that releases the GIL while it works
    (copies, DALI, numpy on large arrays) counts too. Also: ``empty_takes``, the consumer's takes
    that found nothing queued (each pass's first among them), and ``unpaced``, items made without
    the pacing hold because such a take had just turned it off (see :class:`~datapipe.device.pacing.Pacer`).
    """

    __slots__ = ("cpu_s", "items", "empty_takes", "unpaced")

    def __init__(self):
        self.cpu_s = 0.0
        self.items = 0
        self.empty_takes = 0  # counted by the consumer's thread
        self.unpaced = 0  # counted by the producer's

    def stats(self) -> dict:
        """``cpu_s``, ``batches``, ``cpu_ms_per_batch``, ``empty_takes`` and ``unpaced``."""
        per = 1e3 * self.cpu_s / self.items if self.items else 0.0
        return {"cpu_s": round(self.cpu_s, 4), "batches": self.items, "cpu_ms_per_batch": round(per, 3),
                "empty_takes": self.empty_takes, "unpaced": self.unpaced}


class CurrentStream:
    """``torch.cuda.current_stream(device)`` for a consumer that asks every step, without the cost.

    ``torch.cuda.current_stream`` builds a new Stream object on each call (a device switch and
    back): 0.04 ms per call on an H200 host while DALI runs,
    twice in each ``next()``. This asks torch only for the calling thread's current stream id
    and returns the same Stream object while that id stays the same (a ``torch.cuda.stream()``
    context switches it, and the next call follows).
    """

    def __init__(self, device: torch.device):
        self.index = device.index
        self._query = getattr(torch._C, "_cuda_getCurrentStream", None)  # None: a torch without it
        self._key = None
        self._stream: torch.cuda.Stream | None = None

    def __call__(self) -> torch.cuda.Stream:
        index = torch.cuda.current_device() if self.index is None else self.index
        if self._query is None:
            return torch.cuda.current_stream(index)
        key = self._query(index)  # (stream id, device index, device type)
        if key != self._key:
            self._stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            self._key = key
        return self._stream


class Retirer:
    """Frees handed-out device batches in the producer thread, not in the training thread.

    Dropping a batch's last reference frees its device memory (DALI's deleter, the caching
    allocator's stream bookkeeping): 0.2-0.3 ms of the training thread's step, spent right after
    its ``next()``. The consumer's ``next()`` keeps the last ``keep`` items alive (the training loop
    still holds the previous one while it asks for the next); older ones go to the producer
    thread with a fence on the consumer's stream, and that thread drops them once the fence has
    passed (their last reads are done), after it delivered its next item. A batch the caller
    still references is freed whenever the caller lets go of it, as before.

    The fence (a CUDA event on the consumer's stream) is recorded in the consumer's ``next()``.
    """

    def __init__(self, device: torch.device, keep: int = 2, fence: Callable[[], Any] | None = None,
                 stream: CurrentStream | None = None):
        self.device = device
        self.keep = keep
        self.fence = fence  # returns a marker with .query(): True once passed; None: a CUDA event
        # (not a bound method of self: that cycle would leave the batches to the cyclic collector,
        # which may then run in a forked DataLoader worker and free CUDA memory there: abort)
        self.stream = stream or CurrentStream(device)  # the consumer's stream (shared with its handoff)
        self._recent: deque = deque()
        self._dead: deque = deque()  # (item, marker); drained by the producer
        self._spare: deque = deque()  # CUDA events that passed, recorded again (creating one is an API call)

    def _mark(self) -> Any:
        if self.fence is not None:
            return self.fence()
        event = self._spare.pop() if self._spare else torch.cuda.Event()
        event.record(self.stream())
        return event

    def handed(self, item: Any) -> None:
        """(Consumer thread) ``item`` was just handed out."""
        self._recent.append(item)
        if len(self._recent) > self.keep:
            self._dead.append((self._recent.popleft(), self._mark()))

    def bury(self) -> None:
        """(Producer thread) drop the items the consumer's stream is done with."""
        dead = self._dead
        while dead and dead[0][1].query():
            _, marker = dead.popleft()
            if self.fence is None and len(self._spare) < 2 * self.keep:
                self._spare.append(marker)

    def clear(self) -> None:
        self._recent.clear()
        self._dead.clear()
        self._spare.clear()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _produce(iterable: Iterable, out: queue.SimpleQueue, slots: threading.Semaphore, stop: threading.Event,
             setup: Callable[[], None] | None, transform: Callable[[Any], Any] | None,
             pacer: Pacer | None = None, meter: ProducerMeter | None = None,
             retirer: Retirer | None = None) -> None:
    """Producer thread body: take a slot, pull, transform, put; end with _END or a _Failure; stop on request.

    Runs ``setup()`` first and closes the iterator at the end, both in this thread. It holds no
    reference to its :class:`Producer`, so dropping that stops the thread.
    """

    def take_slot() -> bool:
        while not stop.is_set():
            if slots.acquire(timeout=_POLL_S):
                return True
        return False

    try:
        if setup is not None:
            setup()
        it = iter(iterable)
        try:
            while take_slot():
                if pacer is not None and pacer.hold(out.qsize(), stop) and meter is not None:
                    meter.unpaced += 1
                cpu0 = time.thread_time()
                try:
                    item = next(it)
                except StopIteration:
                    out.put(_END)
                    return
                if transform is not None:
                    item = transform(item)
                if meter is not None:
                    meter.cpu_s += time.thread_time() - cpu0
                    meter.items += 1
                if stop.is_set():
                    return
                out.put(item)
                del item
                if retirer is not None:  # off the critical path: the item is delivered already
                    retirer.bury()
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
        out.put(_Failure(e))


class Producer(Iterator):
    """Items of ``iterable`` made in a background thread named ``name``, at most ``depth`` ahead.

    In the thread: ``setup()`` once, then ``transform(item)`` per item. In the consumer's
    ``next()``: ``handoff(item)``, whose result is returned; the item's slot is freed only after
    it ran, so the producer's Python work overlaps the consumer's own work rather than the
    handoff (whose CUDA calls release the GIL, and a producer woken right then would hold the
    consumer up). An exception of the producer is re-raised by ``next()`` (same object, its
    traceback kept; ``note`` is added to it). ``close()`` (or dropping the iterator) stops the
    thread, which closes ``iterable``'s iterator in that thread. ``pace`` (a fraction, see
    :class:`Pacer`): while an item is still queued, the next one
    starts only that far into the consumer's step, not while its thread launches the step.
    ``meter`` (a :class:`ProducerMeter`, shared across epochs if the caller keeps one) counts the
    thread's CPU time per item. ``retire`` (a :class:`Retirer`): handed-out items are dropped in the
    producer thread once the consumer's stream is done with them.
    """

    def __init__(self, iterable: Iterable, *, depth: int, name: str = "datapipe-producer",
                 setup: Callable[[], None] | None = None, transform: Callable[[Any], Any] | None = None,
                 handoff: Callable[[Any], Any] | None = None, note: str | None = None, join_s: float = 60.0,
                 pace: float | None = None, meter: ProducerMeter | None = None, retire: Retirer | None = None):
        forks.install()  # from now on a forked worker never frees the items this thread makes (see forks)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # bounded by the slots: depth items ahead
        self._slots = threading.Semaphore(max(1, depth))
        self._stop = threading.Event()
        self._handoff = handoff
        self._note = note
        self._join_s = join_s
        self._done = False
        self._retirer = retire
        pace = check_pace(pace)
        self._pacer = Pacer(pace) if pace else None
        self.meter = meter if meter is not None else ProducerMeter()
        self._thread = threading.Thread(
            target=_produce,
            args=(iterable, self._queue, self._slots, self._stop, setup, transform, self._pacer, self.meter, retire),
            name=name, daemon=True,
        )
        self._thread.start()

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        empty = self._queue.empty()
        if empty:
            self.meter.empty_takes += 1
        waited = self._pacer is not None and empty
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise RuntimeError(f"{self._thread.name}: the producer thread stopped without a result") from None
        if item is _END:
            self._done = True
            self._thread.join()
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            self._thread.join()
            exc = item.exc
            if self._note and hasattr(exc, "add_note") and not getattr(exc, "_datapipe_noted", False):
                exc.add_note(self._note)
                try:
                    exc._datapipe_noted = True
                except AttributeError:
                    pass
            raise exc  # same object: keeps the producer's traceback frames
        if self._handoff is not None:
            item = self._handoff(item)
        if self._pacer is not None:
            self._pacer.took(waited)
        if self._retirer is not None:
            self._retirer.handed(item)
        self._slots.release()  # after the handoff: the producer's next item starts now
        return item

    def close(self, timeout: float | None = None) -> None:
        """Stop the producer thread and drop queued items; wait at most ``timeout`` (default ``join_s``)."""
        self._done = True
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(self._join_s if timeout is None else timeout)
        if self._retirer is not None:
            self._retirer.clear()

    def stopper(self) -> Callable[..., bool]:
        """A function that stops this producer's thread and waits for it (at most ``timeout`` seconds, default
        ``join_s``), and says whether it ended. It holds the thread, not the producer: dropping the producer
        still stops the thread."""
        thread, stop, join_s = self._thread, self._stop, self._join_s

        def stop_and_wait(timeout: float | None = None) -> bool:
            stop.set()
            if thread.is_alive() and threading.current_thread() is not thread:
                thread.join(join_s if timeout is None else timeout)
            return not thread.is_alive()

        return stop_and_wait

    def __del__(self):
        try:
            self._done = True
            self._stop.set()
        except Exception:
            pass


def wait_and_keep(event: torch.cuda.Event | None, tensors: Iterable[torch.Tensor], stream: torch.cuda.Stream) -> None:
    """(Consumer thread) make ``stream`` (the consumer's current one) wait for ``event`` (None: the
    work is known done) and ``record_stream`` the CUDA tensors on it.

    No host sync; the caching allocator will not reuse the tensors' memory while the consumer's
    stream may still read it.
    """
    if event is not None:
        stream.wait_event(event)
    for t in tensors:
        if t.is_cuda:
            t.record_stream(stream)


def close_last(ref) -> None:
    """Close the iterator behind ``ref`` (a weakref, or None) if it is still alive: a loader whose passes
    share one source stops the last pass's producer thread before a new pass starts."""
    it = ref() if ref is not None else None
    if it is not None:
        it.close()


class PassThreads:
    """The producer threads of a loader's passes, each beside a weak reference to its pass's iterator. A dropped
    iterator only asks its thread to stop; a new pass must not start while that thread still runs (it may be
    calling the dataset, drawing from the sampler's generator or reading the workers' one torch iterator)."""

    def __init__(self):
        self._passes: list = []

    def add(self, iterator, stop: Callable[[], bool]) -> None:
        """A pass's ``iterator`` and its thread's :meth:`Producer.stopper`."""
        self._passes = [(ref, s) for ref, s in self._passes if ref() is not None] + [(weakref.ref(iterator), stop)]

    def wait(self) -> None:
        """Stop the threads of the passes whose iterator is gone and wait for them, however long a dataset call
        under way takes (torch's next pass waits for it too), saying so every :data:`WAIT_NOTE_S` seconds."""
        for ref, stop in list(self._passes):
            if ref() is not None:
                continue
            waited = 0.0
            while not stop(WAIT_NOTE_S):
                waited += WAIT_NOTE_S
                log.warning("loaders.DataLoader: waiting for a pass left unfinished to let go of the dataset "
                            "(%.0f s so far; its prefetch thread is inside a dataset call)", waited)
            self._passes.remove((ref, stop))


def threaded(iterable: Iterable, *, depth: int, name: str = "datapipe-producer", join_s: float = 60.0,
             handoff: Callable[[Any], None] | None = None) -> Iterator:
    """Run ``iterable`` in a background thread, ``depth`` items ahead; its exceptions re-raise here.

    A :class:`Producer` started on the first ``next()``; ``handoff(item)`` runs in the consumer's
    thread before the item's slot is freed. Closing the returned generator stops the thread and
    closes ``iterable`` in that thread, waiting at most ``join_s`` seconds.
    """
    def hand(item):
        handoff(item)
        return item

    producer = Producer(iterable, depth=depth, name=name, join_s=join_s,
                        handoff=None if handoff is None else hand)
    try:
        yield from producer
    finally:
        producer.close()


class started:
    """``gen``, with its first item already fetched (so whatever it starts, it starts now, in this thread)."""

    def __init__(self, gen: Iterator):
        self.gen = gen
        self.first = [next(gen, _END)]

    def __iter__(self):
        return self

    def __next__(self):
        item = self.first.pop() if self.first else next(self.gen)
        if item is _END:
            raise StopIteration
        return item

    def close(self) -> None:
        self.gen.close()
