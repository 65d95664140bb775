"""A producer of CUDA tensors on a side stream, handed to the consumer ready to read (``ImageLoader`` drives DALI with it).

How the consumer learns an item's GPU work is done is ``ready`` (``ImageLoader(ready=...)``):

- ``"event"`` (the default): the consumer's stream waits on an event recorded after the item's work
  (``cudaStreamWaitEvent`` in ``next()``, no host sync), and ``next()`` records the freeing fence;
- ``"host"``: the producer thread waits for that event (sleeping on a blocking-sync event) before it
  queues the item, and records the freeing fences itself: ``next()`` makes no CUDA driver call, but a
  batch whose GPU work is late now keeps the training thread waiting on the host;
- ``"checked"``: the producer never waits; before it queues an item it asks once whether the items
  still queued are done (``cudaEventQuery``), and the consumer's stream waits only on those it could
  not confirm; the producer records the freeing fences. ``next()`` makes no driver call for a batch
  made a step ahead, and a late one is waited for on the GPU, as with ``"event"``.

README, "The handoff without CUDA calls in ``next()``", has what each measured.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from datapipe.device.handoff import CurrentStream, Producer, ProducerMeter, Retirer, wait_and_keep
from datapipe.device.pacing import PACE

__all__ = ["READY_MODES", "check_ready", "confirm_done", "on_side_stream"]

READY_MODES = ("event", "host", "checked")


def check_ready(ready: str) -> str:
    """``ready`` checked: one of :data:`READY_MODES`."""
    if ready not in READY_MODES:
        raise ValueError(f"ready={ready!r}: use 'event' (the consumer's stream waits), 'host' (the producer thread "
                         "waits) or 'checked' (the producer checks queued items once)")
    return ready


def confirm_done(queued: Iterable[list]) -> None:
    """(Producer thread, ``"checked"``) drop the event of each queued ``[item, event]`` whose work is done.

    One query each: a step after an item was queued its work is likely done. The consumer reads the
    slot once, in its handoff: the event (a wait on the GPU, harmless once passed) or None, both right.
    """
    for held in queued:
        if held[1] is not None and held[1].query():
            held[1] = None


def on_side_stream(produce: Iterable[tuple[tuple[torch.Tensor, ...], Any]], *, device: torch.device,
                   depth: int, stream: torch.cuda.Stream | None = None, pace: float | None = PACE,
                   meter: ProducerMeter | None = None, ready: str = "event") -> Iterator[tuple[tuple[torch.Tensor, ...], Any]]:
    """Items ``(tensors, meta)`` made in a background thread, ahead of the consumer.

    On CUDA the producer's current stream is a side stream of ``device``: whatever it enqueues
    (DALI's output copies, label uploads, casts) overlaps with the consumer's work. Each item's
    tensors are handed over ``record_stream``-ed on the consumer's stream, so their memory is not
    reused while the consumer still reads it, and ready as ``ready`` says (module docstring).
    Pass the same ``stream`` every epoch: the caching allocator keeps its blocks per stream, so a
    new side stream per epoch strands the last one's cached blocks (2 MB more reserved each epoch).
    Paced (``pace``, see :class:`~datapipe.device.handoff.Producer`) by default: it feeds a training
    loop. Handed-out items are freed in the producer thread (:class:`~datapipe.device.handoff.Retirer`),
    not in the consumer's.
    """
    cuda = device.type == "cuda"
    mode = check_ready(ready)
    side = (stream or torch.cuda.Stream(device)) if cuda else None
    consumer = CurrentStream(device) if cuda else None
    done = torch.cuda.Event(blocking=True) if cuda and mode == "host" else None  # reused: waited for before the next record
    queued: deque[list] = deque(maxlen=max(1, depth))  # "checked": [item, event] of the last items queued

    def setup() -> None:  # in the producer thread
        torch.cuda.set_stream(side)  # this thread's current stream from now on

    def mark(item):  # in the producer thread, after the item's work was enqueued
        if done is not None:
            done.record(side)
            done.synchronize()  # this thread sleeps (GIL released) until the item's work is done
            return [item, None]
        if mode == "checked":
            confirm_done(queued)
        event = torch.cuda.Event()
        event.record(side)
        marked = [item, event]
        if mode == "checked":
            queued.append(marked)
        return marked

    def handoff(marked):  # in the consumer's thread, before the producer may go on
        (tensors, meta), event = marked
        wait_and_keep(event, tensors, consumer())
        return tensors, meta

    producer = Producer(produce, depth=depth, name="datapipe-device-producer", setup=setup if cuda else None,
                        transform=mark if cuda else None, handoff=handoff if cuda else None, pace=pace, meter=meter,
                        retire=Retirer(device, stream=consumer, fence_in_producer=mode != "event") if cuda else None)
    try:
        yield from producer
    finally:
        producer.close()
