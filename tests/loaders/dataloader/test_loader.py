"""loaders.DataLoader: torch parity, autotune bounds, pinning in a thread of its own, clean failure without
orphaned workers or threads. Its state: test_state.py; its stats(): test_stats.py."""
import gc
import logging
import threading
import time

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from datapipe.device import autotune
from loaders import DataLoader
from tests.loaders.toy_datasets import (N, SHARDS, Counting, Squares, ToyStream, children_gone, plain, run,
                                        threads_gone)

# ---------------------------------------------------------------- torch parity --------------------

def _pair(dataset, *, seed=0, **kw):
    ours = DataLoader(dataset, seed=seed, **kw)
    theirs = torch.utils.data.DataLoader(dataset, generator=torch.Generator().manual_seed(seed), **kw)
    return run(ours), run(theirs)


class Fixed(torch.utils.data.Sampler):
    def __init__(self, order):
        self.order = order

    def __iter__(self):
        return iter(self.order)

    def __len__(self):
        return len(self.order)


def _dict_collate(samples):
    return {"sum": torch.stack([s["x"] for s in samples]).sum(0), "names": [s["name"] for s in samples]}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("case", ["shuffle", "shuffle_drop_last", "sampler", "collate", "batch_sampler",
                                  "no_batching", "iterable", "weighted"])
def test_same_batches_as_torch(case, workers):
    ds = Squares()
    kw = {"num_workers": workers, "batch_size": 4}
    if case == "shuffle":
        kw.update(shuffle=True)
    elif case == "shuffle_drop_last":
        kw.update(shuffle=True, drop_last=True, batch_size=5)
    elif case == "sampler":
        kw.update(sampler=Fixed([5, 3, 1, 20, 0, 7, 7]))
    elif case == "collate":
        kw.update(shuffle=True, collate_fn=_dict_collate)
    elif case == "batch_sampler":
        kw.pop("batch_size")
        kw.update(batch_sampler=[[1, 2], [9], [4, 5, 6]])
    elif case == "no_batching":
        kw.update(batch_size=None, shuffle=True)
    elif case == "iterable":
        ds = Counting()
    elif case == "weighted":
        # a sampler with its own seeded generator: same order when both start from the same state
        kw.update(sampler=torch.utils.data.WeightedRandomSampler(
            [1.0] * N, 10, generator=torch.Generator().manual_seed(5)))
        ours = run(DataLoader(ds, **kw))
        kw["sampler"].generator.manual_seed(5)
        assert ours == run(torch.utils.data.DataLoader(ds, **kw))
        return
    ours, theirs = _pair(ds, seed=11, **kw)
    assert len(ours) > 0 and ours == theirs


def test_protocol_dataset_batches_equal_torch():
    for workers in (0, 2):
        ours = run(DataLoader(ToyStream(SHARDS), batch_size=2, num_workers=workers))
        theirs = run(torch.utils.data.DataLoader(ToyStream(SHARDS), batch_size=2, num_workers=workers))
        assert ours == theirs and len(ours) > 3


def test_user_generator_is_used():
    ds = Squares()
    ours = run(DataLoader(ds, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(9)))
    theirs = run(torch.utils.data.DataLoader(ds, batch_size=3, shuffle=True,
                                              generator=torch.Generator().manual_seed(9)))
    assert ours == theirs


def test_device_cpu_prefetch_same_batches():
    ds = Squares()
    ours = run(DataLoader(ds, batch_size=4, shuffle=True, device="cpu", prefetch_depth=3, seed=2))
    assert ours == run(DataLoader(ds, batch_size=4, shuffle=True, seed=2))
    assert threads_gone()


# ---------------------------------------------------------------- worker-state protocol ------------

def test_recycled_worker_memory_composes_with_the_worker_state_protocol(monkeypatch):
    kw = dict(batch_size=2, num_workers=2)
    full = run(DataLoader(ToyStream(SHARDS), **kw))
    _fake_pinning(monkeypatch)  # as with a GPU (GPU tests run that): our thread pins, segments recycled
    a = DataLoader(ToyStream(SHARDS), pin_memory=True, **kw)
    got = []
    for batch in a:
        got.append(plain(batch))
        if len(got) == 3:
            break
    returns = a._returns
    assert a.stats()["shared_memory"]["recycled"] >= 3  # the pin thread may run ahead
    state = a.state_dict()
    a.close()
    assert not returns.kept
    b = DataLoader(ToyStream(SHARDS), pin_memory=True, **kw)
    b.load_state_dict(state)
    assert got + run(b) == full


# ---------------------------------------------------------------- autotune --------------------------

@pytest.mark.parametrize("produce,consume,avail,cap", [
    (0.1, 0.001, 64 << 30, None), (0.001, 0.1, 64 << 30, None), (0.05, 0.01, 1 << 20, None),
    (1.0, None, None, 3), (0.0, 0.0, 0, 1)])
def test_choose_num_workers_within_bounds(produce, consume, avail, cap):
    d = autotune.choose_num_workers(produce_s=produce, consume_s=consume, batch_bytes=10 << 20,
                                    available_bytes=avail, max_workers=cap)
    lo, hi = d["bounds"]
    assert lo == 1 and lo <= d["value"] <= hi
    assert hi <= (cap or max(1, autotune.usable_cores() - 1))
    if avail == 1 << 20:
        assert d["value"] == 1  # memory bound
    assert d["reason"]


def test_choose_workers_follows_the_ratio():
    d = autotune.choose_num_workers(produce_s=0.04, consume_s=0.01, batch_bytes=0, max_workers=64,
                                    available_bytes=1 << 40)
    assert d["value"] == 5  # ceil(1.25 * 4)


def test_adapt_grows_within_bounds_never_shrinks():
    keep = autotune.adapt(num_workers=2, workers_hi=8, depth=2, depth_hi=8, batches=100, elapsed_s=10, wait_s=0.1)
    assert keep["num_workers"] == 2 and keep["prefetch_depth"] == 2
    grow = autotune.adapt(num_workers=2, workers_hi=8, depth=2, depth_hi=8, batches=100, elapsed_s=10, wait_s=8)
    assert 2 < grow["num_workers"] <= 8 and 2 < grow["prefetch_depth"] <= 8
    capped = autotune.adapt(num_workers=4, workers_hi=4, depth=8, depth_hi=8, batches=10, elapsed_s=1, wait_s=0.9)
    assert capped["num_workers"] == 4 and capped["prefetch_depth"] == 8


def test_choose_depth_bounds():
    d = autotune.choose_depth(batch_bytes=1 << 30, available_bytes=4 << 30)
    assert d["value"] == 1 and d["bounds"] == [1, 1]
    d = autotune.choose_depth(batch_bytes=1 << 10, available_bytes=4 << 30)
    assert d["value"] == 2 and d["bounds"][1] == 8


def test_auto_loader_same_order_and_logged(caplog):
    kw = dict(batch_size=2, shuffle=True, seed=4)
    ref = run(DataLoader(Squares(), **kw))
    with caplog.at_level(logging.INFO, logger="datapipe.device.autotune"):
        dl = DataLoader(Squares(), num_workers="auto", prefetch_depth="auto", device="cpu", max_workers=2, **kw)
        assert run(dl) == ref  # probe batches from the main process, then workers, same order
        run(dl)
    s = dl.stats()
    choice = s["autotune"]["num_workers"]
    assert 1 <= choice["value"] <= 2 and 1 <= s["num_workers"] <= 2
    assert any("num_workers=" in r.getMessage() for r in caplog.records if r.name == "datapipe.device.autotune")
    dl.close()
    assert children_gone() and threads_gone()


def test_auto_iterable_within_bounds():
    dl = DataLoader(ToyStream(SHARDS), batch_size=2, num_workers="auto", max_workers=2)
    assert run(dl) == run(DataLoader(ToyStream(SHARDS), batch_size=2, num_workers=dl.stats()["num_workers"]))
    assert 1 <= dl.stats()["num_workers"] <= 2


# ---------------------------------------------------------------- bad input -------------------------

def _bad_collate(samples):
    if any(s["i"] == 9 for s in samples):
        raise ValueError("collate cannot handle sample 9")
    return torch.utils.data.default_collate(samples)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers,device", [(0, None), (2, None), (2, "cpu")])
def test_collate_error_reaches_consumer(workers, device):
    dl = DataLoader(Squares(), batch_size=2, num_workers=workers, collate_fn=_bad_collate, device=device)
    with pytest.raises(ValueError, match="sample 9"):
        run(dl)
    gc.collect()  # like torch's, the iterator survives one batch's error (cyclic traceback refs)
    assert children_gone() and threads_gone()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers,device", [(0, None), (2, None), (2, "cpu")])
def test_dataset_error_in_worker_reaches_consumer(workers, device):
    dl = DataLoader(Squares(fail_at=13), batch_size=2, num_workers=workers, device=device, shuffle=True)
    with pytest.raises(RuntimeError, match="cannot read sample 13"):
        run(dl)
    gc.collect()  # like torch's, the iterator survives one batch's error (cyclic traceback refs)
    assert children_gone() and threads_gone()


@pytest.mark.timeout(60)
def test_break_and_close_leave_nothing_running():
    dl = DataLoader(Squares(), batch_size=2, num_workers=2, device="cpu", persistent_workers=True)
    run(dl, limit=2)
    it = iter(dl)  # a new pass abandons the old one
    next(it)
    dl.close()
    assert children_gone() and threads_gone()
    with DataLoader(Counting(), batch_size=2, num_workers=2, device="cpu") as dl2:
        run(dl2, limit=1)
    assert children_gone() and threads_gone()


def test_non_tensor_leaves_pass_through():
    out = list(DataLoader(Squares(), batch_size=3, device="cpu"))
    assert out[0]["name"] == ["s0", "s1", "s2"] and out[0]["i"].tolist() == [0, 1, 2]


def test_bad_arguments():
    with pytest.raises(ValueError, match="cuda"):
        DataLoader(Squares(), device="cuda:99")
    with pytest.raises(ValueError) as ours:
        DataLoader(Squares(), num_workers=-1)
    with pytest.raises(ValueError) as torchs:
        torch.utils.data.DataLoader(Squares(), num_workers=-1)
    assert str(ours.value) == str(torchs.value)  # torch's type and torch's words (its own test suite checks them)
    with pytest.raises(TypeError, match="num_workers"):
        DataLoader(Squares(), num_workers="4")
    with pytest.raises(ValueError, match="prefetch_depth"):
        DataLoader(Squares(), prefetch_depth=0)
    with pytest.raises(ValueError, match="shuffle"):  # torch's own validation
        DataLoader(Squares(), sampler=Fixed([0]), shuffle=True)
    with pytest.raises(TypeError):  # no pace knob: the loader paces its prefetch thread itself
        DataLoader(Squares(), pace=0.5)


def _fake_pinning(monkeypatch):
    """A CPU machine cannot pin: the loader is told it can, and a copy stands in for pinning. Returns
    the names of the threads that pinned."""
    import loaders.dataloader.loader as module
    from torch.utils.data._utils import pin_memory as torch_pin

    from datapipe.device.prefetch import map_tensors

    threads = set()

    def copy_as_pinning(data, device=None):
        threads.add(threading.current_thread().name)
        return map_tensors(lambda t: t.clone(), data)

    monkeypatch.setattr(module, "pins_for_cuda", lambda device: True)
    monkeypatch.setattr(torch_pin, "pin_memory", copy_as_pinning)
    return threads


@pytest.mark.parametrize("workers", [0, 2])
def test_pin_memory_pins_in_a_thread_of_ours_and_recycles_worker_memory(monkeypatch, workers):
    threads = _fake_pinning(monkeypatch)
    kw = dict(batch_size=4, num_workers=workers)
    ref = run(torch.utils.data.DataLoader(Pictures(), **kw))
    dl = DataLoader(Pictures(), pin_memory=True, **kw)
    for epoch in range(2):
        held = list(dl)  # every batch kept: its copy outlives the segment it came in, reused meanwhile
        assert [plain(b) for b in held] == ref
        # 12 batches x 2 tensors; without workers torch's own path (which pins nothing on a CPU machine)
        assert dl.stats().get("shared_memory", {}).get("recycled") == (24 * (epoch + 1) if workers else None)
    assert threads == ({"datapipe-pin-memory"} if workers else set())
    dl.close()
    assert not dl._returns.kept


@pytest.mark.parametrize("where", ["pin", "cpu"])
def test_a_new_pass_over_persistent_workers_stops_the_last_ones_thread_first(monkeypatch, where):
    _fake_pinning(monkeypatch)
    kw = dict(batch_size=4, num_workers=2, persistent_workers=True)
    ref = run(torch.utils.data.DataLoader(Pictures(), **kw))
    dl = DataLoader(Pictures(), **(dict(pin_memory=True) if where == "pin" else dict(device="cpu")), **kw)
    for _ in range(8):  # the old pass still referenced, its thread running ahead
        old = iter(dl)
        next(old)
        assert run(dl) == ref
        with pytest.raises(StopIteration):  # superseded: stopped (torch's one iterator of persistent workers)
            next(old)
    dl.close()


class Blobs(Dataset):
    """Raw bytes large enough to travel in recycled shared memory, each sample telling which it is."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        return {"i": i, "blob": bytes([i]) * (40_000 + 1000 * i)}


@pytest.mark.parametrize("where", ["pin", "cpu"])
def test_a_pass_left_and_dropped_over_persistent_workers_is_stopped_before_the_next_starts(monkeypatch, where):
    """``for b in dl: break`` drops the pass's iterator at once: its thread, still unpacking a batch, must be done
    with the workers' one torch iterator before the next pass resets it (else: batches of the wrong samples,
    torch's "Invalid iterator state")."""
    import loaders.dataloader.rawshm as rawshm

    _fake_pinning(monkeypatch)
    real = rawshm.copying_out

    def slow(*args, **kw):  # the copy-out under way as the next pass starts
        time.sleep(0.01)
        return real(*args, **kw)

    monkeypatch.setattr(rawshm, "copying_out", slow)
    kw = dict(batch_size=4, num_workers=2, persistent_workers=True, collate_fn=list)
    dl = DataLoader(Blobs(), **(dict(pin_memory=True) if where == "pin" else dict(device="cpu")), **kw)
    for _ in range(6):
        for batch in dl:
            break
        got = [s for batch in dl for s in batch]
        assert [s["i"] for s in got] == list(range(48))
        assert all(s["blob"] == bytes([s["i"]]) * (40_000 + 1000 * s["i"]) for s in got)
    dl.close()


class OneAtATime(Dataset):
    """Counts calls of ``__getitem__`` that overlap (a dataset reading one open file assumes none, as torch's
    loader without workers makes none)."""

    def __init__(self):
        self.lock, self.overlaps = threading.Lock(), 0

    def __len__(self):
        return 40

    def __getitem__(self, i):
        if not self.lock.acquire(blocking=False):
            self.overlaps += 1
            self.lock.acquire()
        try:
            time.sleep(0.002)
            return i
        finally:
            self.lock.release()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_left_and_dropped_ends_its_thread_before_the_next_pass_starts(workers):
    """``for b in dl: break`` drops the pass; its prefetch thread, which calls the dataset itself without
    workers and draws from the sampler's generator, is done before the next pass starts: as in torch, no two
    calls of the dataset at once, and the next pass's order is the same every time."""
    ds = OneAtATime()
    firsts = set()
    for _ in range(3):
        dl = DataLoader(ds, batch_size=4, shuffle=True, num_workers=workers, device="cpu", prefetch_depth=4,
                        generator=torch.Generator().manual_seed(3))
        for _ in range(4):
            for batch in dl:
                break
            got = [int(i) for batch in dl for i in batch]
            assert sorted(got) == list(range(40))
        firsts.add(tuple(got))
        dl.close()
    assert ds.overlaps == 0 and len(firsts) == 1


def test_two_passes_without_workers_draw_their_orders_in_the_order_they_were_made():
    """Without workers the prefetch thread runs torch's iterator; the sampler's first draw is made as the pass is,
    right after its base seed (as torch's iterator with workers draws it), not in the thread, where it raced the
    next pass's draws from the same generator."""
    def orders(cls, **kw):
        dl = cls(list(range(20)), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(0), **kw)
        a, b = iter(dl), iter(dl)
        return tuple(next(a).tolist()), tuple(next(b).tolist())

    torchs = orders(torch.utils.data.DataLoader)
    seen = {orders(DataLoader, device="cpu") for _ in range(6)}
    assert len(seen) == 1
    assert next(iter(seen))[1] == torchs[1]  # the second pass's order is torch's (the same draws came before it)


@pytest.mark.parametrize("where", ["pin", "cpu"])
def test_passes_of_non_persistent_workers_run_side_by_side_in_threads_of_ours(monkeypatch, where):
    _fake_pinning(monkeypatch)
    kw = dict(batch_size=4, num_workers=2)
    ref = run(torch.utils.data.DataLoader(Pictures(), **kw))
    dl = DataLoader(Pictures(), **(dict(pin_memory=True) if where == "pin" else dict(device="cpu")), **kw)
    for _ in range(3):  # as torch: each iterator its own workers, the old one goes on where it was
        old = iter(dl)
        first = plain(next(old))
        assert run(dl) == ref
        assert [first] + [plain(b) for b in old] == ref
    dl.close()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_persistent_workers_recycle_again_after_passes_left_unfinished(monkeypatch, context):
    _fake_pinning(monkeypatch)
    kw = dict(batch_size=4, num_workers=2, persistent_workers=True, multiprocessing_context=context)
    ref = run(torch.utils.data.DataLoader(Pictures(), **kw))
    dl = DataLoader(Pictures(), pin_memory=True, **kw)
    assert run(dl) == ref and dl._returns.released == 24
    for _ in range(3):  # each leaves its in-flight batches to torch, which drops them unread
        it = iter(dl)
        next(it)
        it.close()
    before = dl._returns.released
    held = list(dl)  # a whole pass, every batch kept
    assert [plain(b) for b in held] == ref
    # recycled again (0 of 24 before the workers freed them); a batch the last unfinished pass was still
    # collating when this one began may hold its segment for this pass: at most one per outstanding task
    stale = kw["num_workers"] * 2 * 2  # workers x prefetch_factor x tensors per batch
    assert 24 - stale <= dl._returns.released - before <= 24
    dl.close()


def test_without_pinning_or_a_gpu_torch_keeps_its_own_path(monkeypatch):
    kw = dict(batch_size=4, num_workers=2)
    plain = DataLoader(Pictures(), **kw)
    assert run(plain) == run(torch.utils.data.DataLoader(Pictures(), **kw))
    assert "shared_memory" not in plain.stats() and not plain._returns.released
    if not torch.cuda.is_available():  # pin_memory=True without a GPU: torch's loader warns and does not pin
        with pytest.warns(UserWarning, match="pin_memory"):
            pinned_off = DataLoader(Pictures(), pin_memory=True, **kw)
            run(pinned_off)
        assert "shared_memory" not in pinned_off.stats()



# ---------------------------------------------------------------- GPU -------------------------------

@pytest.mark.gpu
def test_gpu_loader_batches_and_resume():
    kw = dict(batch_size=4, shuffle=True, num_workers=2, seed=6)
    ref = run(DataLoader(Squares(), **kw))
    dl = DataLoader(Squares(), device="cuda", **kw)
    got = []
    for b in dl:
        assert b["x"].is_cuda
        got.append(plain(b))
        if len(got) == 2:
            break
    state = dl.state_dict()
    dl.close()
    dl2 = DataLoader(Squares(), device="cuda", **kw)
    dl2.load_state_dict(state)
    assert got + run(dl2) == ref
    # the batches come pinned (pinned in the prefetch thread), so the prefetcher stages no copies of its own,
    # and torch's iterator runs no pin-memory thread of its own
    assert dl2.stats()["pinned_pool"]["allocations"] == 0
    assert not [t for t in threading.enumerate() if "_pin_memory_loop" in t.name]
    assert dl2.pin_memory  # what the loader reports is unchanged
    dl2.close()


class Pictures(Dataset):
    """Map-style: a 3x64x64 uint8 image made from i, and the label i."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        return torch.full((3, 64, 64), i, dtype=torch.uint8), i


@pytest.mark.gpu
@pytest.mark.parametrize("workers", [0, 2])
def test_gpu_pin_memory_true_pins_in_our_thread_with_recycled_memory(workers):
    kw = dict(batch_size=4, num_workers=workers)
    ref = run(torch.utils.data.DataLoader(Pictures(), **kw))
    dl = DataLoader(Pictures(), pin_memory=True, **kw)
    held = list(dl)
    assert all(t.is_pinned() and not t.is_cuda for images, labels in held for t in (images, labels))
    assert [plain(b) for b in held] == ref
    # without workers torch pins in this thread, as before: no pin thread, no shared memory
    assert dl.stats().get("shared_memory", {}).get("recycled") == (24 if workers else None)
    assert not [t for t in threading.enumerate() if "_pin_memory_loop" in t.name]
    dl.close()


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
def test_gpu_worker_batches_travel_in_recycled_shared_memory(persistent):
    dl = DataLoader(Pictures(), batch_size=4, num_workers=2, device="cuda", persistent_workers=persistent)
    for epoch in range(2):
        for i, (images, labels) in enumerate(dl):
            assert images.is_cuda and labels.tolist() == list(range(4 * i, 4 * i + 4))
            assert torch.equal(images[:, 0, 0, 0].cpu(), torch.arange(4 * i, 4 * i + 4, dtype=torch.uint8))
        # every batch's two tensors went back to their workers once pinned; the segments stay mapped
        # only while their workers live
        assert dl._returns.released == 24 * (epoch + 1) == dl.stats()["shared_memory"]["recycled"]
        assert (len(dl._returns.kept) > 0) == persistent
        # registered for CUDA and copied in place while kept; unregistered with the workers
        assert (dl.stats()["shared_memory"]["registered"] > 0) == persistent
    dl.close()
    assert not dl._returns.kept and not dl._returns.registered


class Frames(Dataset):
    """Map-style: a 3x256x256 uint8 image filled with i % 251 (copies big enough to overlap a worker's writes)."""

    def __len__(self):
        return 256

    def __getitem__(self, i):
        return torch.full((3, 256, 256), i % 251, dtype=torch.uint8), i


@pytest.mark.gpu
@pytest.mark.parametrize("register", [True, False])
def test_gpu_batches_copied_in_place_from_registered_segments_arrive_whole(register):
    dl = DataLoader(Frames(), batch_size=16, num_workers=4, device="cuda", persistent_workers=True)
    dl._returns.register = register
    held = []
    for epoch in range(2):
        for i, (images, labels) in enumerate(dl):
            held.append((images, labels))  # kept on the GPU: their segments were reused meanwhile
            time.sleep(0.002 * (i % 3))  # an uneven consumer
    for i, (images, labels) in enumerate(held):
        want = torch.arange(16 * (i % 16), 16 * (i % 16) + 16, device="cuda")
        flat = images.view(16, -1)
        assert torch.equal(labels, want)
        assert torch.equal(flat.amin(1), (want % 251).to(torch.uint8)) and torch.equal(flat.amax(1), flat.amin(1))
    assert (dl.stats()["shared_memory"]["registered"] > 0) == register
    assert dl.stats()["pinned_pool"]["allocations"] == 0
    dl.close()


class _Flaky(IterableDataset):
    """0..n-1, raising once at ``bad`` (the generator then ends, as any generator that raised does)."""

    def __init__(self, n, bad=None):
        self.n, self.bad = n, bad

    def __iter__(self):
        for i in range(self.n):
            if i == self.bad:
                raise RuntimeError("bad sample")
            yield i


def _batches(loader):
    out, it = [], iter(loader)
    while True:
        try:
            batch = next(it)
            out.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)
        except StopIteration:
            return out
        except RuntimeError as e:
            out.append(str(e))


@pytest.mark.parametrize("n,batch_size,drop_last,bad", [(10, 3, False, None), (10, 3, True, None), (9, 3, True, None),
                                                        (10, 4, False, 5), (0, 2, False, None), (10, None, False, 3)])
def test_iterable_batches_as_torch_without_workers(n, batch_size, drop_last, bad):
    """Without workers an iterable dataset's batches, last partial batch, drop_last and errors are torch's."""
    kw = dict(batch_size=batch_size, drop_last=drop_last)
    ours = _batches(DataLoader(_Flaky(n, bad), **kw))
    assert ours == _batches(torch.utils.data.DataLoader(_Flaky(n, bad), **kw))
