"""loaders.dataloader.iterator: the producer-side stream of a loaders.DataLoader pass."""
import threading

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader, IterableDataset, get_worker_info

from loaders.dataloader.iterator import ConstantBatches, Failed, pinned


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


def test_the_unpinned_batch_is_dropped_at_the_next_pull_not_before():
    import weakref

    raws = [Batch(0), Batch(1)]
    refs = [weakref.ref(b) for b in raws]

    def source():  # holds no batch once it handed it over (as torch's iterator)
        while raws:
            yield raws.pop(0), None

    stream = source()
    seen = []

    def consume():
        it = pinned(stream)
        next(it)
        seen.append(refs[0]() is not None)  # kept while the producer works on the pinned copy
        next(it)
        seen.append(refs[0]() is None)  # gone once the producer asked for the next batch
        it.close()
        seen.append(refs[1]() is None)

    worker = threading.Thread(target=consume)
    worker.start()
    worker.join()
    assert seen == [True, True, True]


class Unpinnable(Batch):
    def pin_memory(self):
        raise RuntimeError("cannot pin this one")


def test_a_batch_whose_pinning_raises_becomes_a_failure_and_the_stream_goes_on():
    stream = iter([(Unpinnable(0), None), (Batch(1), None)])
    got = []
    worker = threading.Thread(target=lambda: got.extend(pinned(stream)))
    worker.start()
    worker.join()
    assert got[0][0] is None and isinstance(got[0][1], Failed)
    assert "cannot pin this one" in str(got[0][1].exc)
    assert got[1][0].i == 1 and got[1][0].pinned_in is not None


class Returns:
    """Stands in for loaders.dataloader.returns.SegmentReturns: records what was given back, and when."""

    def __init__(self):
        self.released = []
        self.cleared = 0

    def adopt(self, batch):
        return False  # no segment registered for CUDA: every batch is copied out by pinning

    def release(self, batch, adopted=False):
        self.released.append(batch.i)

    def clear(self):
        self.cleared += 1


def test_pinned_gives_each_raw_batch_back_once_pinned_or_failed_and_clears_at_the_end():
    returns = Returns()
    stream = iter([(Batch(0), None), (Unpinnable(1), None), (None, Failed(ValueError("made none"))), (Batch(3), None)])
    got = []

    def consume():
        for batch, meta in pinned(stream, returns=returns):
            got.append((list(returns.released), batch.i if batch is not None else None))

    worker = threading.Thread(target=consume)
    worker.start()
    worker.join()
    # batch 0 given back before it was handed on; the failed pin too; a batch that never came, not
    assert got == [([0], 0), ([0, 1], None), ([0, 1], None), ([0, 1, 3], 3)]
    assert returns.cleared == 1


def test_pinned_keeps_the_segments_for_persistent_workers():
    returns = Returns()
    worker = threading.Thread(target=lambda: list(pinned(iter([(Batch(0), None)]), returns=returns, keep=True)))
    worker.start()
    worker.join()
    assert returns.released == [0] and returns.cleared == 0


class DirectReturns(Returns):
    """As SegmentReturns(register=True): every batch goes out in its segments, registered for CUDA."""

    def adopt(self, batch):
        return True

    def release(self, batch, adopted=False):
        self.released.append((batch.i, adopted))


class Event:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class CopyStream:
    """Stands in for the prefetcher's side stream: its events finish when the test says so."""

    def __init__(self):
        self.events = []
        self.synced = 0

    def record_event(self):
        self.events.append(Event())
        return self.events[-1]

    def synchronize(self):
        self.synced += 1
        for e in self.events:
            e.done = True


def test_a_batch_copied_in_place_goes_back_only_once_its_copy_has_finished():
    returns, copies = DirectReturns(), CopyStream()
    seen = []

    def consume():
        it = pinned(iter([(Batch(i), None) for i in range(4)] + [(Unpinnable(4), None)]), returns=returns,
                    copy_stream=copies)
        next(it)
        seen.append(list(returns.released))  # handed on, its copy not enqueued yet: kept
        next(it)
        seen.append((len(copies.events), list(returns.released)))  # batch 0's copy recorded, not finished
        copies.events[0].done = True
        next(it)
        seen.append(list(returns.released))  # batch 0's copy finished: given back at this pull
        it.close()  # batch 1's copy waited for; batch 2 handed on as the pass closed: the stream synced
        seen.append((list(returns.released), copies.synced, returns.cleared))

    worker = threading.Thread(target=consume)
    worker.start()
    worker.join()
    assert seen == [[], (1, []), [(0, True)], ([(0, True), (1, True), (2, True)], 1, 1)]


def test_a_batch_adopted_for_an_in_place_copy_whose_pinning_raises_goes_back_at_once():
    returns, copies = DirectReturns(), CopyStream()
    got = []
    worker = threading.Thread(target=lambda: got.extend(pinned(iter([(Unpinnable(0), None)]), returns=returns,
                                                                copy_stream=copies)))
    worker.start()
    worker.join()
    assert isinstance(got[0][1], Failed) and returns.released == [(0, True)] and not copies.events


class Counting(IterableDataset):
    """``n`` samples, split over the workers, each a dict with its number."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return ({"i": i} for i in range(worker, self.n, workers))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_an_iterable_datasets_batches_come_from_one_list_a_batch_and_equal_torchs(workers, drop_last):
    from loaders import DataLoader

    dl = DataLoader(Counting(23), batch_size=5, num_workers=workers, drop_last=drop_last)
    sampler = dl._index_sampler
    assert type(sampler) is ConstantBatches and next(iter(sampler)) == [None] * 5  # no Python step a sample
    torch_batches = list(TorchLoader(Counting(23), batch_size=5, num_workers=workers, drop_last=drop_last))
    got = list(dl)
    assert len(got) == len(torch_batches) and all(torch.equal(a["i"], b["i"]) for a, b in zip(got, torch_batches))
    unbatched = DataLoader(Counting(3), batch_size=None)  # torch's sampler of single samples stays
    assert type(unbatched._index_sampler) is not ConstantBatches and list(unbatched) == [{"i": 0}, {"i": 1}, {"i": 2}]
