"""loaders.dataloader.shm: worker batches in recycled shared memory, handed back once copied out."""
import collections
import dataclasses
import os
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from loaders.dataloader.returns import SegmentReturns
from loaders.dataloader.shm import (BUSY, FREE, HEADER, PooledCollate, SegmentPool,
                                    recycling_available)

pytestmark = pytest.mark.skipif(not recycling_available(), reason="needs torch's file_descriptor sharing")

MARK = b"testmark"
Pair = collections.namedtuple("Pair", "left right")


class Images(Dataset):
    """Sample i: a 3x32x32 uint8 image filled from i, and the label i."""

    def __init__(self, n=96):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((3, 32, 32), i % 251, dtype=torch.uint8) + torch.arange(32, dtype=torch.uint8), i


def expected(i, batch_size=8):
    ids = list(range(i * batch_size, (i + 1) * batch_size))
    return torch.stack([Images()[j][0] for j in ids]), torch.tensor(ids)


def state(t):
    return int(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), 0, (HEADER,), (1,))[8])


def loader(collate=None, workers=2, **kw):
    from torch.utils.data import default_collate

    return DataLoader(Images(), batch_size=8, num_workers=workers,
                      collate_fn=PooledCollate(collate or default_collate, MARK, batches=4), **kw)


def test_batches_arrive_exact_and_their_segments_are_reused():
    returns = SegmentReturns(MARK, workers=2, batches=4)
    segments = set()
    for i, (images, labels) in enumerate(loader()):
        img, lab = expected(i)
        assert torch.equal(images.clone(), img) and torch.equal(labels.clone(), lab)  # the copy out
        assert state(images) == BUSY and state(labels) == BUSY
        segments |= {images.untyped_storage().data_ptr(), labels.untyped_storage().data_ptr()}
        returns.release((images, labels))
    # a worker may take a released segment back at once (BUSY again): only after the last batch,
    # with no more to make, does a released segment stay FREE for sure
    assert state(images) == FREE and state(labels) == FREE
    assert i == 11 and returns.released == 24
    # two workers, 4 batches in flight each, 2 tensors a batch: 16 segments at most, against 24 sends;
    # a segment the main process mapped anew each time would count again (the kept ones stay mapped)
    assert len(segments) <= 16
    assert len(returns.kept) == len(segments)


def test_a_batch_held_back_is_not_overwritten_and_unreturned_segments_fall_back():
    batches = list(loader(prefetch_factor=2))  # none returned: every worker runs out of free segments
    time.sleep(0.2)
    for i, (images, labels) in enumerate(batches):
        img, lab = expected(i)
        assert torch.equal(images, img) and torch.equal(labels, lab)


def test_slow_consumer_sees_its_batch_unchanged_until_it_returns_it():
    returns = SegmentReturns(MARK, workers=1, batches=4)
    for i, (images, labels) in enumerate(loader(workers=1)):
        time.sleep(0.02)  # the worker runs ahead meanwhile, into other segments
        img, lab = expected(i)
        assert torch.equal(images, img) and torch.equal(labels, lab)
        returns.release((images, labels))


def custom(samples):
    images = torch.stack([s[0] for s in samples]).float()
    base = torch.arange(10.0)
    return {"nhwc": images.contiguous(memory_format=torch.channels_last), "pair": Pair(images[:, 0], [1, "a"]),
            "base": base, "view": base[2:5], "ids": torch.tensor([s[1] for s in samples])}


def test_a_custom_collates_tensors_move_with_layout_and_aliasing_kept():
    plain = list(DataLoader(Images(32), batch_size=8, num_workers=2, collate_fn=custom))
    returns = SegmentReturns(MARK, workers=2, batches=4)
    for ref, got in zip(plain, DataLoader(Images(32), batch_size=8, num_workers=2,
                                          collate_fn=PooledCollate(custom, MARK, batches=4))):
        assert torch.equal(got["nhwc"], ref["nhwc"]) and got["nhwc"].stride() == ref["nhwc"].stride()
        assert got["nhwc"].is_contiguous(memory_format=torch.channels_last) and state(got["nhwc"]) == BUSY
        assert isinstance(got["pair"], Pair) and got["pair"].right == [1, "a"]
        assert torch.equal(got["pair"].left, ref["pair"].left) and torch.equal(got["ids"], ref["ids"])
        # base and view share a storage: both travel as torch sends them, still sharing
        assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
        assert torch.equal(got["view"], torch.arange(2.0, 5.0))
        returns.release(got)
    assert returns.released == 4 * 2  # nhwc and ids; pair.left, a strided view of another tensor, as torch sends it


def test_in_the_main_process_it_is_the_wrapped_collate():
    calls = []

    def collate(samples):
        calls.append(len(samples))
        return len(samples)

    assert list(DataLoader(Images(16), batch_size=8, collate_fn=PooledCollate(collate, MARK, batches=4))) == [8, 8]
    assert calls == [8, 8]


def test_pool_takes_the_smallest_free_fit_up_to_its_cap():
    pool = SegmentPool(MARK, cap=2)
    a = pool.take(1000)
    b = pool.take(100)
    assert a is not None and b is not None and pool.fresh == 2
    assert pool.take(10) is None  # both busy, cap reached: the caller falls back
    for s in (a, b):
        torch.empty(0, dtype=torch.uint8).set_(s, 0, (HEADER,), (1,))[8] = FREE
    assert pool.take(50).data_ptr() == b.data_ptr()  # the smaller one that fits
    grown = pool.take(5000)  # a too small: the free segment makes way for a larger one, with room to grow
    assert grown is not None and grown.nbytes() >= HEADER + 5000 + 5000 // 4
    assert pool.fresh == 3 and len(pool.segments) == 2


def _resident_pages(storage) -> tuple[int, int]:
    """(pages of ``storage`` in memory, pages in all), by mincore(2)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-storage.nbytes() // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(storage.data_ptr()), ctypes.c_size_t(storage.nbytes()), vec) == 0
    return sum(v & 1 for v in vec), pages


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux only (madvise MADV_POPULATE_WRITE, mincore)")
def test_a_new_segment_comes_mapped_in_not_a_fault_a_page():
    """A new segment's pages are made in one call as the pool takes it (the writes that follow fault nothing), with a
    quarter more room for a later, larger batch where asked (raw batches), none for a tensor's fixed size."""
    from loaders.dataloader import shm

    if shm._madvise() is None:
        pytest.skip("no madvise here")
    storage = SegmentPool(MARK, cap=1).take(8 << 20, room=True)
    resident, pages = _resident_pages(storage)
    import re

    kernel = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
    if kernel < (5, 14):
        pytest.skip("kernel older than 5.14: no MADV_POPULATE_WRITE")
    import mmap

    asked = -(-(HEADER + (8 << 20)) // mmap.PAGESIZE)
    assert storage.nbytes() >= HEADER + (8 << 20) + (8 << 20) // 4
    assert asked <= resident <= pages
    assert SegmentPool(MARK, cap=1).take(8 << 20).nbytes() == HEADER + (8 << 20)
    unmapped = torch.UntypedStorage._new_shared(8 << 20)  # what the pool got from torch: nothing made yet
    assert _resident_pages(unmapped)[0] < pages // 2


def test_placed_tensors_keep_their_memory_format():
    pool = SegmentPool(MARK, cap=4)
    t = pool.place(torch.float32, (2, 3, 4, 5), torch.channels_last)
    assert t.is_contiguous(memory_format=torch.channels_last) and t.storage_offset() * 4 == HEADER
    assert pool.place(torch.int64, (7,)).stride() == (1,)


def test_returns_ignore_other_tensors_and_keep_a_bounded_set():
    returns = SegmentReturns(MARK, workers=1, batches=1)
    returns.release((torch.zeros(100), torch.zeros(100).share_memory_()))
    assert returns.released == 0
    other = SegmentPool(b"othermrk", cap=1).place(torch.uint8, (10,))
    returns.release(other)
    assert returns.released == 0 and state(other) == BUSY  # another loader's segment: left alone
    pool = SegmentPool(MARK, cap=8)
    placed = [pool.place(torch.uint8, (10,)) for _ in range(5)]  # five segments, all busy
    assert pool.place(torch.uint8, (10,)).untyped_storage().data_ptr() not in {
        t.untyped_storage().data_ptr() for t in placed}
    for t in placed:
        returns.release(t)
    assert pool.place(torch.uint8, (10,)).untyped_storage().data_ptr() == placed[0].untyped_storage().data_ptr()
    assert returns.released == 5 and len(returns.kept) == 2  # 2 x 1 worker x 1 batch x 1 tensor
    returns.clear()
    assert not returns.kept


def test_the_pool_is_made_again_in_a_new_process():
    collate = PooledCollate(lambda s: s, MARK, batches=2)
    collate._pid = os.getpid() + 1  # as if this object was copied into another process
    assert collate.pool.cap == 2 and collate._pid == os.getpid()
    assert "_pool" in collate.__getstate__() and collate.__getstate__()["_pool"] is None


def calls_default_collate(samples):
    from torch.utils.data import default_collate
    from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

    return {"batch": default_collate(samples), "patched": default_collate_fn_map[torch.Tensor] is not collate_tensor_fn}


def test_default_collate_inside_a_custom_collate_stacks_into_segments_and_the_map_is_restored():
    from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

    returns = SegmentReturns(MARK, workers=2, batches=4)
    for i, got in enumerate(DataLoader(Images(32), batch_size=8, num_workers=2,
                                       collate_fn=PooledCollate(calls_default_collate, MARK, batches=4))):
        assert got["patched"] and state(got["batch"][0]) == BUSY
        assert torch.equal(got["batch"][0], expected(i)[0])
        returns.release(got)
    assert returns.released == 4 * 2
    assert default_collate_fn_map[torch.Tensor] is collate_tensor_fn  # untouched in this process


def test_a_raising_collate_leaves_torchs_map_as_it_was(monkeypatch):
    import loaders.dataloader.shm as shm
    from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

    def broken(samples):
        raise ValueError("bad samples")

    monkeypatch.setattr(shm, "get_worker_info", lambda: object())  # as if in a worker
    with pytest.raises(ValueError, match="bad samples"):
        PooledCollate(broken, MARK, batches=2)([1, 2])
    assert default_collate_fn_map[torch.Tensor] is collate_tensor_fn


def test_a_collate_that_raises_after_stacking_gives_its_segments_back(monkeypatch):
    import loaders.dataloader.shm as shm
    from torch.utils.data import default_collate

    def half_done(samples):
        default_collate([s[0] for s in samples])  # stacks into a segment, then fails
        raise ValueError("labels unreadable")

    monkeypatch.setattr(shm, "get_worker_info", lambda: object())  # as if in a worker
    collate = PooledCollate(half_done, MARK, batches=2)
    with pytest.raises(ValueError, match="labels unreadable"):
        collate([Images()[i] for i in range(4)])
    pool = collate.pool
    assert pool.fresh == 1 and all(int(h[8]) == FREE for _, h in pool.segments)


class Tagged(dict):
    """A dict subclass with an attribute: a moved batch keeps both."""


def test_moved_containers_keep_their_types_and_untouched_ones_stay_the_same_object():
    from loaders.dataloader.shm import _moved

    pool = SegmentPool(MARK, cap=8)
    batch = Tagged(x=torch.arange(6.0).reshape(2, 3), names=["a", "b"])
    batch.source = "shard-1"
    moved = _moved(batch, pool, set())
    assert type(moved) is Tagged and moved.source == "shard-1" and moved["names"] is batch["names"]
    assert torch.equal(moved["x"], batch["x"]) and state(moved["x"]) == BUSY
    plain = {"names": ["a"], "n": 3}
    assert _moved(plain, pool, set()) is plain
    pair = Pair(torch.ones(2), 5)
    got = _moved(pair, pool, set())
    assert type(got) is Pair and got.right == 5 and state(got.left) == BUSY


def test_a_pool_that_cannot_get_shared_memory_leaves_the_batch_to_torch(monkeypatch):
    import loaders.dataloader.shm as shm
    from torch.utils.data import default_collate

    def no_room(cls, size):
        raise RuntimeError("unable to write to file </torch_1_2>: No space left on device (28)")

    monkeypatch.setattr(shm, "get_worker_info", lambda: object())  # as if in a worker
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", classmethod(no_room))
    collate = PooledCollate(default_collate, MARK, batches=2)
    images, labels = collate([Images()[i] for i in range(4)])
    assert torch.equal(images, expected(0, batch_size=4)[0]) and labels.tolist() == [0, 1, 2, 3]
    assert collate.pool.fresh == 0


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_persistent_workers_reuse_their_segments_across_epochs(context):
    from torch.utils.data import default_collate

    returns = SegmentReturns(MARK, workers=2, batches=4)
    dl = DataLoader(Images(64), batch_size=8, num_workers=2, persistent_workers=True, multiprocessing_context=context,
                    collate_fn=PooledCollate(default_collate, MARK, batches=4))
    images_segments = set()
    for _ in range(2):
        for i, (images, labels) in enumerate(dl):
            assert state(images) == BUSY and torch.equal(images, expected(i)[0]) and torch.equal(labels, expected(i)[1])
            images_segments.add(images.untyped_storage().data_ptr())
            returns.release((images, labels))
    assert returns.released == 2 * 8 * 2
    assert len(images_segments) <= 2 * 4  # 16 image batches over two epochs in at most 2 workers x 4 segments


def scaled(samples):
    from torch.utils.data import default_collate

    images, labels = default_collate(samples)  # stacked into a segment, then left behind
    return images.float() / 255, labels


def test_a_collates_intermediate_stack_goes_back_to_the_pool_at_once():
    returns = SegmentReturns(MARK, workers=1, batches=4)
    collate = PooledCollate(scaled, MARK, batches=4)
    for i, (images, labels) in enumerate(DataLoader(Images(160), batch_size=8, num_workers=1, collate_fn=collate)):
        assert images.dtype == torch.float32 and state(images) == BUSY  # the float result moved into a segment
        assert torch.allclose(images, expected(i)[0].float() / 255)
        returns.release((images, labels))
    assert returns.released == 20 * 2  # every batch, to the last, still travels in segments


def test_settle_frees_what_the_batch_does_not_send():
    pool = SegmentPool(MARK, cap=4)
    sent = pool.place(torch.uint8, (4,))
    dropped = pool.place(torch.uint8, (4,))
    pool.settle({sent.untyped_storage().data_ptr()})
    assert state(sent) == BUSY and state(dropped) == FREE and pool.taken == []


def fake_registry(monkeypatch, refuse=()):
    """host_register stood in for (no GPU here): which pointers are registered, and the calls."""
    import loaders.dataloader.returns as returns_module

    calls = []

    def register(ptr, nbytes):
        calls.append(("register", ptr, nbytes))
        return ptr not in refuse

    monkeypatch.setattr(returns_module.host_register, "register", register)
    monkeypatch.setattr(returns_module.host_register, "unregister", lambda ptr: calls.append(("unregister", ptr)))
    return calls


def test_adopted_segments_are_registered_once_and_never_dropped_while_a_copy_reads_them(monkeypatch):
    calls = fake_registry(monkeypatch)
    returns = SegmentReturns(MARK, workers=1, batches=1, register=True)
    pool = SegmentPool(MARK, cap=8)
    first = pool.place(torch.uint8, (10,))
    ptr = first.untyped_storage().data_ptr()
    assert returns.adopt((first, torch.zeros(3)))  # the plain tensor: not a segment, left alone
    assert calls == [("register", ptr, first.untyped_storage().nbytes())] and returns.registered == {ptr}
    others = [pool.place(torch.uint8, (10,)) for _ in range(4)]
    for t in others:  # four more segments adopted and released: the bound is 2
        returns.adopt(t)
        returns.release(t, adopted=True)
    assert ptr in returns.kept and state(first) == BUSY  # its copy still runs: kept, registered
    assert len(returns.kept) == 2 and sum(c[0] == "unregister" for c in calls) == 3  # the others: LRU out
    returns.release(first, adopted=True)
    assert state(first) == FREE and ("unregister", ptr) not in calls
    assert returns.adopt(first) and sum(c[0] == "register" for c in calls) == 5  # still registered: not again
    returns.release(first, adopted=True)
    returns.clear()
    assert not returns.kept and not returns.registered
    assert sum(c[0] == "register" for c in calls) == sum(c[0] == "unregister" for c in calls)


def test_without_register_or_when_cuda_refuses_the_batch_is_copied_out(monkeypatch):
    pool = SegmentPool(MARK, cap=4)
    t = pool.place(torch.uint8, (10,))
    calls = fake_registry(monkeypatch, refuse={t.untyped_storage().data_ptr()})
    assert not SegmentReturns(MARK, workers=1, batches=1).adopt(t) and not calls
    refused = SegmentReturns(MARK, workers=1, batches=1, register=True)
    assert not refused.adopt(t) and not refused.registered and len(calls) == 1
    refused.release(t)
    refused.clear()
    assert len(calls) == 1  # nothing registered, nothing to undo


def test_returns_dropped_without_clear_unregister_their_segments(monkeypatch):
    calls = fake_registry(monkeypatch)
    returns = SegmentReturns(MARK, workers=1, batches=2, register=True)
    t = SegmentPool(MARK, cap=2).place(torch.uint8, (10,))
    assert returns.adopt(t)
    returns.release(t, adopted=True)
    forked = SegmentReturns(MARK, workers=1, batches=2, register=True)
    forked.registered, forked._pid = {1}, os.getpid() + 1  # as a copy in a forked worker
    del returns, forked  # a loader dropped without close(); the worker's copy leaves CUDA alone
    assert [c[0] for c in calls] == ["register", "unregister"]


class CustomBatch:
    """A custom batch type (torch supports them, with a ``pin_memory()`` method): its tensors are out of sight."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def pin_memory(self):
        return self


@dataclasses.dataclass
class DataBatch:
    images: torch.Tensor
    labels: torch.Tensor


def as_custom(samples):
    return CustomBatch(*default_collate(samples))


def as_dataclass(samples):
    return DataBatch(*default_collate(samples))


def as_numpy(samples):  # a numpy view of default_collate's stack
    images, labels = default_collate(samples)
    return images.numpy(), labels


@pytest.mark.parametrize("collate", [as_custom, as_dataclass, as_numpy])
def test_a_batch_that_hides_its_tensors_keeps_its_segments_and_turns_recycling_off(collate):
    batches = list(loader(collate, prefetch_factor=2))  # all held, none given back: a reused segment would show
    time.sleep(0.2)
    for i, batch in enumerate(batches):
        img, lab = expected(i)
        images, labels = (batch.images, batch.labels) if hasattr(batch, "labels") else batch
        assert torch.equal(torch.as_tensor(images), img) and torch.equal(labels, lab), i


def test_a_new_pass_frees_what_the_last_one_left_in_flight():
    pool = SegmentPool(MARK, cap=4)
    pool.new_pass(0)
    held = [pool.place(torch.uint8, (10,)) for _ in range(4)]  # sent, never given back (a pass left early)
    pool.settle({t.untyped_storage().data_ptr() for t in held})
    assert pool.place(torch.uint8, (10,)) is None  # all busy, the pool full
    pool.new_pass(0)  # the same pass: nothing changes
    assert all(state(t) == BUSY for t in held)
    pool.new_pass(1)
    assert all(state(t) == FREE for t in held) and pool.place(torch.uint8, (10,)) is not None


def test_the_batch_walks_find_every_tensor_in_order_and_every_type_they_cannot_see_into():
    from loaders.dataloader.shm import _opaque, _shared_storages, _tensors

    class Param(torch.Tensor):
        pass

    Pair = collections.namedtuple("Pair", "a b")
    a, b, c = torch.zeros(2), torch.ones(3), torch.arange(4).as_subclass(Param)
    batch = [{"k": "x", "v": b"1", "t": a}, (None, 3, 2.5, True, c), Pair(b, collections.OrderedDict(z=a[:1]))]
    assert [id(t) for t in _tensors(batch)] == [id(a), id(c), id(b), id(batch[2].b["z"])]
    assert _shared_storages(batch) == {a.untyped_storage().data_ptr()}  # a and its view a[:1]
    assert not _opaque(batch) and not _opaque([1j, b"", "s", None, c])
    for inside in (bytearray(b"x"), object(), dataclasses.make_dataclass("D", [])()):
        assert _opaque([{"ok": a}, {"x": inside}]) and _opaque((inside,))
