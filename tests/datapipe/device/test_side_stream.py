"""datapipe.device.side_stream: items made on a side CUDA stream, handed over ready to read."""
import pytest
import torch

from datapipe.device.side_stream import on_side_stream


def test_on_side_stream_on_cpu_passes_items_through():
    items = [((torch.full((2,), i),), {"i": i}) for i in range(4)]
    got = list(on_side_stream(iter(items), device=torch.device("cpu"), depth=2))
    assert [m["i"] for _, m in got] == [0, 1, 2, 3]
    assert all(torch.equal(t[0], torch.full((2,), i)) for i, (t, _) in enumerate(got))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_side_stream_work_is_finished_before_the_consumer_reads_it():
    """The producer's stream is busy (a long sleep kernel) before it writes; the consumer must see the write."""
    device = torch.device("cuda")

    def produce():
        for i in range(5):
            x = torch.zeros(1 << 20, device=device)
            torch.cuda._sleep(50_000_000)  # ~tens of ms on the producer's (side) stream
            x.fill_(i + 1)
            yield (x,), i

    seen = []
    for (x,), i in on_side_stream(produce(), device=device, depth=2):
        seen.append(i)
        assert x.sum().item() == (i + 1) * (1 << 20)  # the consumer stream waited for the producer's
    assert seen == list(range(5))
