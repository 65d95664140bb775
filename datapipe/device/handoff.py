"""Producers that run ahead of the consumer: in a background thread, and on a side CUDA stream.

``threaded`` runs any iterable in a thread, a bounded number of items ahead; ``on_side_stream``
does the same for a producer of CUDA tensors (ImageLoader drives DALI with it), so that the
training thread's ``next()`` only takes a finished batch off a queue: the producer's GPU work
runs on its own stream and the consumer's stream waits for it with an event, not the host.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Iterator

import torch

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def threaded(iterable: Iterable, *, depth: int, name: str = "datapipe-producer", join_s: float = 60.0,
             handoff: Callable[[Any], None] | None = None) -> Iterator:
    """Run ``iterable`` in a background thread, ``depth`` items ahead; its exceptions re-raise here.

    The producer may only start its next item once a slot is free, and a slot is freed after
    ``handoff(item)`` ran in the consumer's thread: the producer's Python work then overlaps the
    consumer's own work rather than the handoff (whose CUDA calls release the GIL, and a producer
    woken right then would hold the consumer up). Closing the returned generator stops the thread
    and closes ``iterable`` in that thread, waiting at most ``join_s`` seconds.
    """
    q: queue.SimpleQueue = queue.SimpleQueue()
    slots = threading.Semaphore(max(1, depth))
    stop = threading.Event()

    def take_slot() -> bool:
        while not stop.is_set():
            if slots.acquire(timeout=0.1):
                return True
        return False

    def work():
        it = iter(iterable)
        try:
            while take_slot():
                try:
                    item = next(it)
                except StopIteration:
                    q.put(_END)
                    return
                q.put(item)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            q.put(_Failure(e))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.exc
            if handoff is not None:
                handoff(item)
            slots.release()
            yield item
    finally:
        stop.set()
        thread.join(timeout=join_s)


def on_side_stream(produce: Iterable[tuple[tuple[torch.Tensor, ...], Any]], *, device: torch.device,
                   depth: int, stream: torch.cuda.Stream | None = None) -> Iterator[tuple[tuple[torch.Tensor, ...], Any]]:
    """Items ``(tensors, meta)`` made in a background thread, ahead of the consumer.

    On CUDA the producer's current stream is a side stream of ``device``: whatever it enqueues
    (DALI's output copies, label uploads, casts) overlaps with the consumer's work. Each item's
    tensors are handed over with an event the consumer's current stream waits on (no host sync)
    and ``record_stream`` so their memory is not reused while the consumer still reads it.
    Pass the same ``stream`` every epoch: the caching allocator keeps its blocks per stream, so a
    new side stream per epoch strands the last one's cached blocks (2 MB more reserved each epoch).
    """
    cuda = device.type == "cuda"

    def on_stream():
        if cuda:
            torch.cuda.set_stream(stream or torch.cuda.Stream(device))  # this thread's current stream from now on
        it = iter(produce)
        try:
            for tensors, meta in it:
                event = None
                if cuda:
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream(device))
                yield tensors, meta, event
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def handoff(item) -> None:  # in the consumer's thread, before the producer may go on
        tensors, _, event = item
        if event is not None:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(event)
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(stream)

    items = threaded(on_stream(), depth=depth, name="datapipe-device-producer", handoff=handoff)
    try:
        for tensors, meta, _ in items:
            yield tensors, meta
    finally:
        items.close()


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
