"""DevicePrefetcher: nesting, depth, errors, shutdown; GPU stream/event correctness (marked gpu)."""
import dataclasses
import gc
import threading
import time
import traceback
from collections import OrderedDict, namedtuple

import pytest
import torch

from datapipe import DevicePrefetcher

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Item:
    image: torch.Tensor
    name: str
    extra: dict = dataclasses.field(default_factory=dict)


def _nested(i):
    return {
        "a": torch.full((2, 3), float(i)),
        "t": (torch.tensor([i]), "tag", None),
        "l": [torch.arange(i + 1), 7],
        "nt": Pair(torch.tensor(i), i),
        "dc": Item(image=torch.ones(2) * i, name=f"n{i}", extra={"k": torch.tensor([i, i])}),
        "od": OrderedDict(z=torch.tensor(1.5 * i)),
    }


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "datapipe-prefetch" and t.is_alive()]


def _wait_no_threads(timeout=10.0):
    deadline = time.monotonic() + timeout
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return _prefetch_threads()


def _check_nested(got, i, device):
    assert isinstance(got, dict) and set(got) == {"a", "t", "l", "nt", "dc", "od"}
    assert torch.equal(got["a"].cpu(), torch.full((2, 3), float(i))) and got["a"].device.type == device
    assert isinstance(got["t"], tuple) and got["t"][1] == "tag" and got["t"][2] is None
    assert isinstance(got["l"], list) and got["l"][1] == 7 and torch.equal(got["l"][0].cpu(), torch.arange(i + 1))
    assert isinstance(got["nt"], Pair) and got["nt"].y == i and got["nt"].x.item() == i
    assert isinstance(got["dc"], Item) and got["dc"].name == f"n{i}"
    assert got["dc"].image.device.type == device and torch.equal(got["dc"].extra["k"].cpu(), torch.tensor([i, i]))
    assert isinstance(got["od"], OrderedDict) and got["od"]["z"].item() == 1.5 * i


@pytest.mark.parametrize("device", [None, "cpu"])
def test_cpu_nested_batches_pass_through(device):
    batches = [_nested(i) for i in range(5)]
    with DevicePrefetcher(batches, device=device, depth=2) as pf:
        out = list(pf)
    assert len(out) == 5
    for i, got in enumerate(out):
        _check_nested(got, i, "cpu")
    assert _wait_no_threads() == []


def test_each_iter_is_one_epoch():
    src = [torch.tensor(i) for i in range(4)]
    pf = DevicePrefetcher(src, device="cpu")
    first = [int(t) for t in pf]
    second = [int(t) for t in pf]
    assert first == second == [0, 1, 2, 3]
    assert len(pf) == 4
    pf.close()


def test_runs_at_most_depth_ahead():
    pulled = []

    def source():
        for i in range(100):
            pulled.append(i)
            yield torch.tensor(i)

    depth = 3
    pf = DevicePrefetcher(source(), device="cpu", depth=depth)
    it = iter(pf)
    assert int(next(it)) == 0
    deadline = time.monotonic() + 10
    while len(pulled) < 1 + depth and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # give an over-eager producer the chance to run further ahead
    # one consumed, `depth` made ahead; the producer takes a slot before it pulls the next
    assert len(pulled) == 1 + depth
    assert int(next(it)) == 1
    deadline = time.monotonic() + 10
    while len(pulled) < 2 + depth and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert len(pulled) == 2 + depth
    it.close()
    assert _wait_no_threads() == []


def _failing_source():
    for i in range(3):
        yield torch.tensor(i)
    raise KeyError("bad sample 3")


def test_producer_exception_reraised_with_traceback():
    pf = DevicePrefetcher(_failing_source(), device="cpu")
    it = iter(pf)
    got = [int(next(it)) for _ in range(3)]
    assert got == [0, 1, 2]
    with pytest.raises(KeyError, match="bad sample 3") as info:
        next(it)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_failing_source" in frames  # the producer's frames are kept
    assert any("DevicePrefetcher" in n for n in getattr(info.value, "__notes__", []))
    with pytest.raises(StopIteration):
        next(it)
    assert _wait_no_threads() == []


def test_non_tensor_batches_pass_through():
    src = ["text", 3, None, {"k": "v"}, b"bytes"]
    assert list(DevicePrefetcher(src, device="cpu")) == src


def test_close_stops_an_infinite_producer():
    def forever():
        i = 0
        while True:
            i += 1
            yield torch.tensor(i)

    pf = DevicePrefetcher(forever(), device="cpu", depth=2)
    it = iter(pf)
    next(it)
    thread = it._thread
    pf.close()
    thread.join(10)
    assert not thread.is_alive()
    with pytest.raises(ValueError, match="closed"):
        iter(pf)


def test_garbage_collection_stops_the_thread():
    closed = threading.Event()

    def forever():
        try:
            while True:
                yield torch.zeros(1)
        finally:
            closed.set()

    it = iter(DevicePrefetcher(forever(), device="cpu"))
    next(it)
    thread = it._thread
    del it
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
    assert closed.wait(5)  # the source generator was closed by its own thread


def test_context_manager_stops_thread_mid_epoch():
    with DevicePrefetcher((torch.tensor(i) for i in range(1000)), device="cpu") as pf:
        it = iter(pf)
        next(it)
        thread = it._thread
    thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize("depth", [0, -1, 1.5, True])
def test_bad_depth(depth):
    with pytest.raises(ValueError, match="depth"):
        DevicePrefetcher([], device="cpu", depth=depth)


def test_missing_cuda_device_is_value_error():
    with pytest.raises(ValueError, match="cuda"):
        DevicePrefetcher([], device="cuda:99")


def test_bad_device_string():
    with pytest.raises(ValueError, match="device"):
        DevicePrefetcher([], device="not-a-device")


# ---------------------------------------------------------------- GPU ----------------------------

@pytest.mark.gpu
def test_gpu_nested_and_types():
    out = list(DevicePrefetcher([_nested(i) for i in range(4)], device="cuda"))
    for i, got in enumerate(out):
        _check_nested(got, i, "cuda")


@pytest.mark.gpu
def test_gpu_reused_pinned_buffer_never_overwritten_in_flight():
    """Copies are held back on a busy side stream while the producer refills the same buffers."""
    n, shape = 24, (1024, 1024)
    src = torch.empty(shape)  # one pageable source tensor, overwritten for every batch

    def source():
        for i in range(n):
            src.fill_(float(i))
            yield {"x": src, "i": i}

    pf = DevicePrefetcher(source(), device="cuda", depth=1)
    with torch.cuda.stream(pf.stream):
        torch.cuda._sleep(2_000_000_000)  # keep the side stream busy so copies queue up
    out = [b for b in pf]
    torch.cuda.synchronize()
    for b in out:
        assert torch.all(b["x"] == float(b["i"])).item(), b["i"]
    stats = pf.pool_stats()
    assert stats["buffers"] <= 1 + 2 and stats["allocations"] <= 3
    assert stats["reuses"] >= n - 3
    pf.close()
    assert pf.pool_stats()["bytes"] == 0


@pytest.mark.gpu
def test_gpu_pinned_source_copied_directly_and_independent():
    pinned = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    pf = DevicePrefetcher([pinned], device="cuda")
    (got,) = list(pf)
    torch.cuda.current_stream().synchronize()
    pinned.fill_(-1.0)  # poison the source after hand-off
    assert torch.equal(got.cpu(), torch.arange(1 << 20, dtype=torch.float32))
    assert pf.pool_stats()["allocations"] == 0  # no staging buffer for an already-pinned source


@pytest.mark.gpu
def test_gpu_pool_bounded_across_epochs():
    batches = [{"x": torch.randn(256, 256), "y": torch.randint(0, 9, (256,))} for _ in range(10)]
    pf = DevicePrefetcher(batches, device="cuda", depth=2)
    sizes = []
    for _ in range(3):
        for b, ref in zip(pf, batches):
            assert torch.equal(b["y"].cpu(), ref["y"])
        sizes.append(pf.pool_stats())
    bound = 2 * (2 + 2)  # two keys, depth + 2 buffers each
    assert sizes[2]["allocations"] <= bound and sizes[2]["buffers"] <= bound  # not one per batch
    assert sizes[2]["reuses"] >= 3 * 2 * len(batches) - bound
    pf.close()
    assert pf.pool_stats()["buffers"] == 0


@pytest.mark.gpu
def test_gpu_copy_overlaps_consumer_compute():
    release = threading.Event()

    def source():
        yield torch.zeros(1 << 20)
        release.wait(30)
        yield torch.ones(1 << 20)

    pf = DevicePrefetcher(source(), device="cuda", depth=1)
    it = iter(pf)
    next(it)
    torch.cuda._sleep(4_000_000_000)  # long "compute" on the consumer's stream
    compute_done = torch.cuda.Event()
    compute_done.record()
    release.set()
    second = next(it)
    pf.stream.synchronize()  # the side-stream copy finished ...
    assert not compute_done.query()  # ... while the compute was still running
    assert second.sum().item() == float(1 << 20)
    pf.close()


@pytest.mark.gpu
def test_gpu_error_propagates():
    with pytest.raises(KeyError, match="bad sample 3"):
        list(DevicePrefetcher(_failing_source(), device="cuda"))
    assert _wait_no_threads() == []


def test_producer_stats_count_every_epochs_batches():
    pf = DevicePrefetcher([torch.ones(3)] * 5, device=None)
    for _ in range(2):
        assert len(list(pf)) == 5
    stats = pf.producer_stats()
    assert stats["batches"] == 10 and stats["cpu_s"] >= 0.0 and set(stats) == {"cpu_s", "batches", "cpu_ms_per_batch", "empty_takes", "unpaced"}


@pytest.mark.gpu
def test_gpu_handed_out_batches_are_freed_by_the_producer_not_kept():
    """Retired batches are dropped once the consumer's stream is past them: memory stays bounded."""
    mb4 = 1 << 20  # float32 elements: 4 MB a batch
    pf = DevicePrefetcher((torch.full((mb4,), float(i)) for i in range(40)), device="cuda", depth=2)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    peak, total = 0, 0.0
    for i, b in enumerate(pf):
        total += b.sum().item() / mb4  # a read on the consumer's stream (and a sync)
        peak = max(peak, torch.cuda.memory_allocated() - base)
    assert total == sum(range(40))
    assert peak <= 8 * 4 * mb4  # queued + in flight + kept + retired, not one per batch
    pf.close()


def test_first_tensor_finds_what_map_tensors_visits_first_without_rebuilding():
    import collections
    import dataclasses

    from datapipe.device.prefetch import first_tensor, map_tensors

    Pair = collections.namedtuple("Pair", "a b")

    @dataclasses.dataclass
    class Box:
        name: str
        value: object

    a, b = torch.zeros(3), torch.ones(2, 2)
    for batch in ({"k": "x", "v": [1, Pair(None, a)], "w": b}, [Box("n", {"t": a}), b], ("s", 1.0, [b, a])):
        seen = []
        map_tensors(lambda t: seen.append(t) or t, batch)
        assert first_tensor(batch) is seen[0]
    assert first_tensor([{"jpg": b"..", "cls": 3}] * 4) is None
    assert first_tensor(a) is a
