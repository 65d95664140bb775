"""loaders.dataloader.handback: torch's next index for a worker held until the batch just received is copied out."""
import time

import numpy as np
import pytest
import torch.utils.data

from datapipe.device import autotune
from loaders import DataLoader
from loaders.dataloader.handback import IndexAfterCopy, holds
from loaders.dataloader.shm import recycling_available
from loaders.dataloader.stock import forks
from tests.loaders.dataloader.test_rawshm import Raw, as_list, same, sample


class FakeTorchIter:
    """torch's multi-process iterator as far as the hold sees it: ``_process_data`` sends the next index."""

    def __init__(self, batches):
        self.batches = iter(batches)
        self.sent = 0
        self._shutdown = False

    def __next__(self):
        return self._process_data(next(self.batches), 0)

    def _process_data(self, data, worker_idx):
        self._try_put_index()
        return data

    def _try_put_index(self):
        self.sent += 1


def test_the_index_of_a_returned_batch_waits_for_send_and_goes_before_the_next_batch():
    it, hold = FakeTorchIter(["a", "b"]), IndexAfterCopy()
    assert hold.next(it) == "a" and it.sent == 0 and hold.pending == 1
    hold.send()
    assert it.sent == 1 and hold.pending == 0
    assert hold.next(it) == "b" and it.sent == 1  # held again
    assert hold.next(FakeTorchIter(["c"])) == "c" and it.sent == 2  # a next() sends what was held first
    assert hold.held == 3
    assert "_process_data" not in vars(it) and "_try_put_index" not in vars(it)  # torch's own methods again


def test_nothing_goes_to_an_iterator_already_shut_down():
    it, hold = FakeTorchIter(["a"]), IndexAfterCopy()
    hold.next(it)
    it._shutdown = True
    hold.send()
    assert it.sent == 0 and hold.pending == 0


def test_a_single_process_iterator_is_passed_through():
    assert IndexAfterCopy().next(iter([1, 2])) == 1


@pytest.mark.skipif(not recycling_available(), reason="needs torch's file_descriptor sharing")
@pytest.mark.parametrize("workers", [1, 2])
def test_two_segments_serve_a_worker_and_every_batch_is_exact(monkeypatch, workers):
    """Held until the copy-out, a worker's next index finds the segment of its batch before last free again: with
    torch's prefetch factor of 2 a worker makes two segments in a pass (torch's timing: a third, often)."""
    if not forks(None):
        pytest.skip("the default start method does not fork")
    monkeypatch.setattr(autotune, "usable_cores", lambda: workers)  # the workers and the main process outnumber them
    reference = [sample(i) for i in range(32 * 12)]
    dl = DataLoader(Raw(32 * 12), batch_size=32, num_workers=workers, collate_fn=as_list, prefetch_factor=2)
    got = []
    for batch in dl:
        got.append(batch)
        time.sleep(0.01)  # the copy-out is slower than the worker's next batch: a third segment without the hold
    assert len(got) == 12 and all(same(b, reference[32 * i:32 * (i + 1)]) for i, b in enumerate(got))
    assert len(dl._stock) <= 2 * workers
    dl.close()


def test_the_index_is_held_only_where_the_workers_and_the_main_process_outnumber_the_cores(monkeypatch):
    copies = object()
    for cores, workers, want in ((2, 1, False), (2, 2, True), (2, 4, True), (16, 4, False), (16, 8, False),
                                 (16, 15, False), (16, 16, True)):
        monkeypatch.setattr(autotune, "usable_cores", lambda c=cores: c)
        assert holds(copies, workers, False) is want, (cores, workers)
        assert not holds(copies, workers, True) and not holds(None, workers, False)
    assert not holds(copies, 0, False)


class Numbered(torch.utils.data.Dataset):
    def __len__(self):
        return 320

    def __getitem__(self, i):
        return {"k": i, "b": bytes([i % 251]) * 20000, "a": np.full(300, i)}


class BreaksAtSeven:
    """A batch sampler whose seventh batch raises (torch asks for it as it sends a worker an index)."""

    def __len__(self):
        return 10

    def __iter__(self):
        for b in range(10):
            if b == 6:
                raise KeyError("sampler broke")
            yield list(range(b * 32, b * 32 + 32))


def first_keys(dl) -> list:
    out, it = [], iter(dl)
    while True:
        try:
            out.append(next(it)[0]["k"])
        except StopIteration:
            return out
        except KeyError:
            out.append("KeyError")


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_sampler_that_raises_as_a_held_index_goes_loses_the_batch_torch_loses_and_the_pass_goes_on(device):
    options = dict(batch_sampler=BreaksAtSeven(), num_workers=2, prefetch_factor=2, collate_fn=list)
    torchs = first_keys(torch.utils.data.DataLoader(Numbered(), **options))
    assert "KeyError" in torchs and torchs[-1] != "KeyError"
    assert first_keys(DataLoader(Numbered(), device=device, **options)) == torchs
