"""datapipe.device.side_stream: items made on a side CUDA stream, handed over ready to read."""
import pytest
import torch

from datapipe.device.side_stream import check_ready, confirm_done, on_side_stream


def test_on_side_stream_on_cpu_passes_items_through():
    items = [((torch.full((2,), i),), {"i": i}) for i in range(4)]
    got = list(on_side_stream(iter(items), device=torch.device("cpu"), depth=2))
    assert [m["i"] for _, m in got] == [0, 1, 2, 3]
    assert all(torch.equal(t[0], torch.full((2,), i)) for i, (t, _) in enumerate(got))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ready", ["event", "host", "checked"])
def test_side_stream_work_is_finished_before_the_consumer_reads_it(ready):
    """The producer's stream is busy (a long sleep kernel) before it writes; the consumer must see the write."""
    device = torch.device("cuda")

    def produce():
        for i in range(5):
            x = torch.zeros(1 << 20, device=device)
            torch.cuda._sleep(50_000_000)  # ~tens of ms on the producer's (side) stream
            x.fill_(i + 1)
            yield (x,), i

    seen = []
    for (x,), i in on_side_stream(produce(), device=device, depth=2, ready=ready):
        seen.append(i)
        assert x.sum().item() == (i + 1) * (1 << 20)  # the consumer stream waits, or the producer saw it done
    assert seen == list(range(5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ready", ["host", "checked"])
def test_batches_stay_intact_while_the_consumer_still_reads_them_with_fences_from_the_producer(monkeypatch, ready):
    """"host" and "checked": the retire fences come from the producer thread, so a batch
    the consumer's stream is still reading (behind a sleep kernel) is not reused for a later one.
    record_stream is turned off, as for DALI's memory (not the caching allocator's): only the fences protect it."""
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    device = torch.device("cuda")
    n = 1 << 22

    def produce():
        for i in range(12):
            yield (torch.full((n,), float(i + 1), device=device),), i

    sums = []
    for (x,), i in on_side_stream(produce(), device=device, depth=2, ready=ready):
        torch.cuda._sleep(20_000_000)  # the consumer's stream lags: the producer runs ahead meanwhile
        sums.append(x.sum())  # enqueued behind the sleep
    assert [round(s.item() / n) for s in sums] == list(range(1, 13))


def test_ready_is_checked_and_the_environment_does_not_change_it(monkeypatch):
    assert check_ready("event") == "event" and check_ready("checked") == "checked"
    monkeypatch.setenv("DATAPIPE_READY", "host")  # the variable of earlier versions: no effect now
    assert check_ready("event") == "event"
    with pytest.raises(ValueError, match="ready='later'"):
        check_ready("later")
    with pytest.raises(ValueError, match="'event'"):
        list(on_side_stream(iter([]), device=torch.device("cpu"), depth=1, ready="soon"))


class _Event:
    def __init__(self, done):
        self.done, self.queries = done, 0

    def query(self):
        self.queries += 1
        return self.done


def test_checked_drops_only_the_events_whose_work_is_done_and_asks_each_once():
    done, pending = _Event(True), _Event(False)
    queued = [["a", done], ["b", pending], ["c", None]]
    confirm_done(queued)
    assert [held[1] for held in queued] == [None, pending, None]  # the consumer's stream still waits on "b"
    assert done.queries == 1 and pending.queries == 1
    confirm_done(queued)
    assert done.queries == 1 and pending.queries == 2  # a confirmed one is not asked again
