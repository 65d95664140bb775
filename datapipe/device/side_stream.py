"""A producer of CUDA tensors on a side stream, handed to the consumer ready to read (``ImageLoader`` drives DALI with it).

The consumer's stream waits on an event recorded after each item's work (``cudaStreamWaitEvent``
in ``next()``, no host sync), and ``next()`` records the fence after which the item may be freed.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from datapipe.device.handoff import CurrentStream, Producer, ProducerMeter, Retirer, wait_and_keep
from datapipe.device.pacing import PACE

__all__ = ["on_side_stream"]


def on_side_stream(produce: Iterable[tuple[tuple[torch.Tensor, ...], Any]], *, device: torch.device,
                   depth: int, stream: torch.cuda.Stream | None = None, pace: float | None = PACE,
                   meter: ProducerMeter | None = None) -> Iterator[tuple[tuple[torch.Tensor, ...], Any]]:
    """Items ``(tensors, meta)`` made in a background thread, ahead of the consumer.

    On CUDA the producer's current stream is a side stream of ``device``: whatever it enqueues
    (DALI's output copies, label uploads, casts) overlaps with the consumer's work. Each item's
    tensors are handed over ``record_stream``-ed on the consumer's stream, which waits for the
    item's event, so their memory is not reused while the consumer still reads it.
    Pass the same ``stream`` every epoch: the caching allocator keeps its blocks per stream, so a
    new side stream per epoch strands the last one's cached blocks (2 MB more reserved each epoch).
    ``pace``: see :class:`~datapipe.device.handoff.Producer`. Handed-out items are freed in the
    producer thread (:class:`~datapipe.device.handoff.Retirer`), not in the consumer's.
    """
    cuda = device.type == "cuda"
    side = (stream or torch.cuda.Stream(device)) if cuda else None
    consumer = CurrentStream(device) if cuda else None

    def setup() -> None:  # in the producer thread
        torch.cuda.set_stream(side)  # this thread's current stream from now on

    def mark(item):  # in the producer thread, after the item's work was enqueued
        event = torch.cuda.Event()
        event.record(side)
        return item, event

    def handoff(marked):  # in the consumer's thread, before the producer may go on
        (tensors, meta), event = marked
        wait_and_keep(event, tensors, consumer())
        return tensors, meta

    producer = Producer(produce, depth=depth, name="datapipe-device-producer", setup=setup if cuda else None,
                        transform=mark if cuda else None, handoff=handoff if cuda else None, pace=pace, meter=meter,
                        retire=Retirer(device, stream=consumer) if cuda else None)
    try:
        yield from producer
    finally:
        producer.close()
