"""loaders.dataloader_iter: the producer-side stream of a loaders.DataLoader pass."""
import threading

from loaders.dataloader_iter import Failed, pinned


class Batch:
    """A custom batch type: torch's pin_memory util calls its ``pin_memory()``."""

    def __init__(self, i):
        self.i = i
        self.pinned_in = None

    def pin_memory(self):
        out = Batch(self.i)
        out.pinned_in = threading.current_thread().name
        return out


def test_pinned_pins_each_batch_in_the_iterating_thread_and_passes_failures_through():
    failure = Failed(ValueError("bad batch"))
    stream = iter([(Batch(0), None), (None, failure), (Batch(2), "meta")])
    got = []
    worker = threading.Thread(target=lambda: got.extend(pinned(stream)), name="producer")
    worker.start()
    worker.join()
    assert [(b.i, b.pinned_in, m) for b, m in (got[0], got[2])] == [(0, "producer", None), (2, "producer", "meta")]
    assert got[1] == (None, failure)


def test_closing_pinned_closes_the_stream_it_wraps():
    closed = []

    def stream():
        try:
            yield Batch(0), None
            yield Batch(1), None
        finally:
            closed.append(True)

    def consume():  # in a thread of its own, as the prefetch thread (pinned sets that thread's torch threads)
        it = pinned(stream())
        next(it)
        it.close()

    worker = threading.Thread(target=consume)
    worker.start()
    worker.join()
    assert closed == [True]
