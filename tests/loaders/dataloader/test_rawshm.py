"""loaders.dataloader.rawshm: workers' raw samples (bytes, numpy arrays) travel in recycled shared memory and
come out of the loader as ordinary objects, exact, whatever the consumer does with them."""
import collections
import pickle
import time

import numpy as np
import pytest
import torch
import webdataset
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from datapipe import ShardStream
from loaders import DataLoader
from loaders.dataloader.rawshm import MIN_BYTES, MIN_LEAF, Packed, RawCopies, pack_raw
from loaders.dataloader.shm import BUSY, FREE, HEADER, SegmentPool, recycling_available
from tests.resume import assert_resumes_identically

pytestmark = pytest.mark.skipif(not recycling_available(), reason="needs torch's file_descriptor sharing")

MARK = b"rawmark!"
Pair = collections.namedtuple("Pair", "left right")
SIZE = 12_000  # a sample's payload: 32 of them make a batch over MIN_BYTES


def payload(i: int, size: int = SIZE) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(64)) * (size // 64) + bytes([i % 256]) * (i % 13)


class Raw(IterableDataset):
    """``n`` raw samples (bytes, a bytearray, numpy arrays, a nested dict and a tuple), dealt to the workers in
    blocks of 32 (a batch): torch's round robin over the workers hands them out in order."""

    def __init__(self, n=96, fail_at=None):
        self.n, self.fail_at = n, fail_at

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(self.n):
            if (i // 32) % workers != worker:
                continue
            if i == self.fail_at:
                raise ValueError(f"sample {i} unreadable")
            yield sample(i)


def sample(i):
    return {"__key__": f"{i:06d}", "jpg": payload(i), "cls": str(i % 10).encode(),
            "meta": {"npy": np.arange(i, i + 600, dtype=np.int32).reshape(20, 30), "raw": bytearray(payload(i, 640))},
            "pair": (payload(i + 1, 1024), i)}


def as_list(samples):
    return list(samples)


def default_of_plain(samples):  # default_collate's dict of lists of bytes (and a stacked tensor)
    return default_collate([{k: s[k] for k in ("__key__", "jpg", "cls", "meta")} for s in samples
                            if not s["meta"].pop("raw", None) is None])


def same(a, b) -> bool:
    """Equal values of equal types, at any depth."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.strides == b.strides and np.array_equal(a, b)
    return a == b


def segment_state(packed: Packed) -> int:
    data = packed[1][4]
    return int(torch.empty(0, dtype=torch.uint8).set_(data.untyped_storage(), 0, (HEADER,), (1,))[8])


# ---- pack and copy out, in one process -------------------------------------------------------

def test_every_packed_leaf_comes_out_equal_of_its_type_and_owned():
    big = np.arange(4000, dtype=">f8").reshape(40, 100)
    batch = {"list": [sample(i) for i in range(24)], "fortran": np.asfortranarray(big), "strided": big[:, ::2],
             "pair": Pair(payload(1), [payload(2), "text"]), "tiny": b"x" * (MIN_LEAF - 1),
             "objects": np.array([b"a" * 600, None], dtype=object),
             "records": np.zeros(100, dtype=[("a", "<i8"), ("b", "<f8")])}
    pool = SegmentPool(MARK, cap=2)
    packed = pack_raw(batch, pool)
    assert type(packed) is Packed and segment_state(packed) == BUSY
    assert packed[3].count("b") == 24 + 24 + 2 and "f" in packed[3]  # jpg and pair bytes; one Fortran array
    assert packed[7] is None  # a namedtuple and numpy arrays in the body: it travels as torch pickles it
    body = pickle.loads(pickle.dumps(packed[0]))
    assert body["tiny"] == batch["tiny"] and body["objects"] is not None  # left in the pickle
    copies = RawCopies(MARK, workers=1, batches=2)
    out = copies.unpack(Packed((body, *packed[1:])))
    expected = {**batch, "strided": np.ascontiguousarray(batch["strided"])}  # pickle's layout too
    assert same({k: v for k, v in out.items() if k not in ("objects", "records")},
                {k: v for k, v in expected.items() if k not in ("objects", "records")})
    assert out["fortran"].flags.f_contiguous and out["fortran"].dtype == np.dtype(">f8")
    assert type(out["pair"]) is Pair and type(out["list"][0]["meta"]["raw"]) is bytearray
    assert segment_state(packed) == FREE and copies.copied == 1
    packed[1][4].fill_(0)  # the segment written over (its worker's next batch): what was handed out stays
    assert same(out["list"], [sample(i) for i in range(24)]) and out["list"][0]["meta"]["npy"].flags.writeable


def test_a_small_batch_or_a_full_pool_leaves_the_batch_to_pickling():
    pool = SegmentPool(MARK, cap=1)
    small = [sample(0)]
    assert pack_raw(small, pool) is small and pool.fresh == 0  # fewer than MIN_BYTES
    batch = [sample(i) for i in range(32)]
    first = pack_raw(batch, pool)
    assert type(first) is Packed and first[1][4].numel() >= MIN_BYTES
    assert pack_raw(batch, pool) is batch  # the one segment is busy: torch's way, no wait
    RawCopies(MARK, workers=1, batches=1).unpack(first)
    assert type(pack_raw(batch, pool)) is Packed and pool.fresh == 1  # given back: reused


def test_copies_leave_other_batches_alone_and_unmap_the_segments_a_pool_lets_go():
    copies = RawCopies(MARK, workers=1, batches=1)
    assert copies.unpack([b"plain"]) == [b"plain"] and copies.copied == 0
    pool = SegmentPool(MARK, cap=1)
    for _ in range(3):  # the one segment, reused: one kept
        assert same(copies.unpack(pack_raw([sample(i) for i in range(32)], pool)), [sample(i) for i in range(32)])
    (first,) = copies.kept
    bigger = pack_raw([sample(i) for i in range(64)], pool)  # the free segment is too small: the pool replaces it
    assert pool.fresh == 2 and bigger[1][2] == (first,) and bigger[1][1] != first
    assert same(copies.unpack(bigger), [sample(i) for i in range(64)])
    assert list(copies.kept) == [bigger[1][1]] and copies.copied == 4
    copies.clear()
    assert not copies.kept


def test_a_plain_body_travels_pickled_in_the_segment_and_comes_out_equal():
    batch = [{"__key__": f"{i:06d}", "__url__": "shards/a.tar", "jpg": payload(i), "cls": b"%d" % i,
              "n": (i, 1.5, None, True)} for i in range(32)]
    pool = SegmentPool(MARK, cap=1)
    packed = pack_raw(batch, pool)
    assert packed[0] is None and type(packed[7]) is tuple and packed[3] == "b" * 32  # in the segment, after the data
    out = RawCopies(MARK, workers=1, batches=1).unpack(packed)
    assert segment_state(packed) == FREE
    packed[1][4].fill_(0)  # the worker's next batch: what was handed out stays
    assert same(out, [{"__key__": f"{i:06d}", "__url__": "shards/a.tar", "jpg": payload(i), "cls": b"%d" % i,
                       "n": (i, 1.5, None, True)} for i in range(32)])
    tensors = pack_raw([torch.ones(3), torch.zeros(2), "key"], pool, tensors=True)  # no segment: the pickle travels
    assert tensors[1] is None and type(tensors[7]) is bytes
    first, second, key = RawCopies(MARK, workers=1, batches=1).unpack(tensors)
    assert torch.equal(first, torch.ones(3)) and torch.equal(second, torch.zeros(2)) and key == "key"


# ---- through loaders.DataLoader's workers ----------------------------------------------------

@pytest.mark.parametrize("collate", [as_list, default_of_plain])
def test_worker_batches_come_out_exact_and_travel_in_segments(collate):
    reference = list(DataLoader(Raw(), batch_size=32, num_workers=0, collate_fn=collate))
    dl = DataLoader(Raw(), batch_size=32, num_workers=2, collate_fn=collate)
    got = list(dl)  # every batch held: a segment written again would show
    time.sleep(0.1)
    assert len(got) == len(reference) == 3 and all(same(a, b) for a, b in zip(got, reference))
    assert dl.stats()["raw_shared_memory"]["batches"] == 3 and not dl._raw.kept  # the workers are gone: unmapped


def test_a_slow_consumer_and_a_long_epoch_see_exact_values_in_reused_segments():
    dl = DataLoader(Raw(32 * 12), batch_size=32, num_workers=1, collate_fn=as_list, prefetch_factor=2)
    for b, batch in enumerate(dl):
        time.sleep(0.01)  # the worker runs ahead into its other segments meanwhile
        assert same(batch, [sample(i) for i in range(32 * b, 32 * (b + 1))]), b
    assert dl.stats()["raw_shared_memory"]["batches"] == 12


RECEIVED = []  # the storages the main process received through counted_rebuild


def counted_rebuild(*args):
    """torch's ``rebuild_storage_fd`` (a socket round trip to the worker for a file descriptor), counted. A
    function of this module: the workers' pickles name it."""
    import torch.multiprocessing.reductions as reductions

    RECEIVED.append(args)
    return reductions.__dict__["_counted_original"](*args)


def test_a_worker_sends_each_segment_once_then_names_it(monkeypatch):
    import torch.multiprocessing.reductions as reductions

    monkeypatch.setattr(reductions, "_counted_original", reductions.rebuild_storage_fd, raising=False)
    monkeypatch.setattr(reductions, "rebuild_storage_fd", counted_rebuild)
    RECEIVED.clear()
    dl = DataLoader(Raw(32 * 12), batch_size=32, num_workers=1, collate_fn=as_list, prefetch_factor=2, timeout=60)
    for b, batch in enumerate(dl):
        assert same(batch, [sample(i) for i in range(32 * b, 32 * (b + 1))]), b
    # the pool's segments (prefetch factor + 2), each sent once; under load a batch or two may go out in fresh
    # shared memory while the main process has yet to give the one before back (each sent once too): never one
    # a batch (12), as without tokens
    assert 1 <= len(RECEIVED) <= 6, len(RECEIVED)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_persistent_workers_over_epochs(context):
    dl = DataLoader(Raw(), batch_size=32, num_workers=2, collate_fn=as_list, persistent_workers=True,
                    multiprocessing_context=context)
    reference = [[sample(i) for i in range(32 * b, 32 * (b + 1))] for b in range(3)]
    for epoch in range(2):
        got = list(dl)
        assert len(got) == 3 and all(same(a, b) for a, b in zip(got, reference)), epoch
    assert dl.stats()["raw_shared_memory"]["batches"] == 6 and dl._raw.kept  # kept mapped for the next pass
    dl.close()
    assert not dl._raw.kept


def test_a_worker_error_reaches_the_consumer_and_the_loader_goes_on():
    dl = DataLoader(Raw(fail_at=40), batch_size=32, num_workers=1, collate_fn=as_list)
    it = iter(dl)
    assert same(next(it), [sample(i) for i in range(32)])
    with pytest.raises(ValueError, match="sample 40 unreadable"):
        next(it)
    assert same(list(DataLoader(Raw(), batch_size=32, num_workers=1, collate_fn=as_list))[2],
                [sample(i) for i in range(64, 96)])


def test_without_file_descriptor_sharing_batches_are_pickled(monkeypatch):
    import loaders.dataloader.loader as dataloader

    monkeypatch.setattr(dataloader, "recycling_available", lambda: False)
    dl = DataLoader(Raw(64), batch_size=32, num_workers=1, collate_fn=as_list)
    assert same(list(dl), [[sample(i) for i in range(32 * b, 32 * (b + 1))] for b in range(2)])
    assert "raw_shared_memory" not in dl.stats()


def write_big_shards(directory, counts):
    urls = []
    for shard, n in enumerate(counts):
        url = str(directory / f"shard-{shard:06d}.tar")
        with webdataset.TarWriter(url) as w:
            for i in range(n):
                w.write({"__key__": f"s{shard}-{i:04d}", "bin": payload(shard * 100 + i), "cls": b"%d" % (i % 7)})
        urls.append(url)
    return urls


def test_shardstream_batches_resume_exactly_on_the_raw_path(tmp_path):
    urls = write_big_shards(tmp_path, [40, 24, 36])
    seen = []

    def make():
        dl = DataLoader(ShardStream(urls, shuffle=True, shuffle_buffer=8, seed=2), batch_size=24, num_workers=2,
                        collate_fn=as_list)
        seen.append(dl)
        return dl

    def same_batch(a, b):
        return [(s["__key__"], s["bin"]) for s in a] == [(s["__key__"], s["bin"]) for s in b]

    full = assert_resumes_identically(make, steps=(1, 3), same=same_batch)
    assert sorted(s["__key__"] for b in full for s in b) == sorted(f"s{k}-{i:04d}" for k, n in enumerate([40, 24, 36])
                                                                  for i in range(n))
    assert all(type(s["bin"]) is bytes and s["bin"] == payload(int(s["__key__"][1]) * 100 + int(s["__key__"][3:]))
               for b in full for s in b)
    assert seen[0].stats()["raw_shared_memory"]["batches"] >= 3


# ---- tensors: one segment a batch instead of a file descriptor a tensor ----------------------

def tensor_leaves():
    """Tensors of every kind the segment carries, and of those it leaves to torch."""
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    shared = torch.arange(10.0).share_memory_()
    alias = torch.arange(40, dtype=torch.int16)
    packed = {"f32": base, "bf16": base.to(torch.bfloat16), "bool": base > 20, "c64": torch.complex(base, -base),
              "nhwc": torch.arange(2 * 3 * 4 * 5, dtype=torch.uint8).reshape(2, 3, 4, 5).contiguous(
                  memory_format=torch.channels_last), "scalar": torch.tensor(7, dtype=torch.int64),
              "slice": torch.arange(100.0)[10:20]}  # a dense view of a larger storage: the view's values
    kept = {"strided": base.clone()[:, ::2], "shared": shared, "alias": (alias[:20], alias[20:]),
            "grad": torch.ones(3, requires_grad=True), "param": torch.nn.Parameter(torch.ones(2)),
            "empty": torch.zeros(0)}
    return packed, kept


def test_tensors_travel_in_one_block_and_come_out_equal_each_on_its_own_storage_in_it():
    packed_leaves, kept = tensor_leaves()
    batch = {"images": [torch.full((3, 8, 8), float(i)) for i in range(6)], **packed_leaves, "kept": kept,
             "keys": [f"{i:04d}" for i in range(6)], "jpg": payload(3)}
    pool = SegmentPool(MARK, cap=2)
    assert pack_raw(batch, pool) is batch  # tensors=False: the bytes rule alone (too few), tensors as torch sends
    packed = pack_raw(batch, pool, tensors=True)
    assert type(packed) is Packed and packed[3].count("t") == 6 + len(packed_leaves) and "b" in packed[3]
    body = pickle.loads(pickle.dumps(packed[0]))
    assert body["kept"]["shared"] is not None and type(body["kept"]["param"]) is torch.nn.Parameter
    out = RawCopies(MARK, workers=1, batches=2).unpack(Packed((body, *packed[1:])))
    block = packed[6].untyped_storage()
    for name, t in {**packed_leaves, **{f"image{i}": t for i, t in enumerate(batch["images"])}}.items():
        got = out[name] if name in out else out["images"][int(name[5:])]
        assert got.dtype == t.dtype and got.shape == t.shape and got.stride() == t.stride(), name
        own = got.untyped_storage()  # its own bytes of the block: saves and pickles as those alone
        assert torch.equal(got, t) and own.nbytes() == t.numel() * t.element_size(), name
        assert block.data_ptr() <= own.data_ptr() < block.data_ptr() + block.nbytes(), name
    assert out["nhwc"].is_contiguous(memory_format=torch.channels_last) and out["keys"] == batch["keys"]
    assert out["jpg"] == payload(3) and segment_state(packed) == FREE
    packed[1][4].fill_(0)  # the worker writes its next batch into the segment: what was handed out stays
    assert torch.equal(out["images"][5], torch.full((3, 8, 8), 5.0)) and torch.equal(out["f32"], packed_leaves["f32"])
    assert out["jpg"] == payload(3)
    again = pack_raw(batch, pool, tensors=True)  # the next batch's tensors: a block of their own
    assert again[6].untyped_storage().data_ptr() != block.data_ptr()


def test_one_tensor_or_only_shared_tensors_are_left_to_torch():
    pool = SegmentPool(MARK, cap=2)
    one = [torch.ones(4), "key"]
    assert pack_raw(one, pool, tensors=True) is one
    stacked = {"images": torch.ones(4, 3, 8, 8).share_memory_(), "labels": torch.arange(4).share_memory_()}
    assert pack_raw(stacked, pool, tensors=True) is stacked and pool.fresh == 0  # default_collate's, in a worker
    only = pack_raw([torch.ones(4), torch.zeros(2)], pool, tensors=True)  # tensors alone: no segment taken
    assert type(only) is Packed and only[1] is None and pool.fresh == 0
    first, second = RawCopies(MARK, workers=1, batches=1).unpack(only)
    assert torch.equal(first, torch.ones(4)) and torch.equal(second, torch.zeros(2))


class Images(IterableDataset):
    """``n`` samples ``(key, image tensor, label)`` of varying sizes, dealt to the workers in batches of 16."""

    def __init__(self, n=64):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(self.n):
            if (i // 16) % workers == worker:
                yield image_sample(i)


def image_sample(i):
    return f"{i:04d}", torch.full((3, 8 + i % 5, 8), float(i)), i % 10


def as_lists(samples):
    keys, images, labels = zip(*samples)
    return list(keys), list(images), list(labels)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_batches_of_tensor_lists_come_out_exact_in_one_block_each(context):
    reference = list(DataLoader(Images(), batch_size=16, num_workers=0, collate_fn=as_lists))
    dl = DataLoader(Images(), batch_size=16, num_workers=2, collate_fn=as_lists, multiprocessing_context=context)
    got = list(dl)
    assert len(got) == len(reference) == 4
    for (keys, images, labels), (rkeys, rimages, rlabels) in zip(got, reference):
        assert keys == rkeys and labels == rlabels
        assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(images, rimages))
        storages = [t.untyped_storage() for t in images]  # one each (as torch), side by side in one block
        assert [s.nbytes() for s in storages] == [t.numel() * t.element_size() for t in images]
        ptrs = sorted(s.data_ptr() for s in storages)
        assert len(set(ptrs)) == len(images) and ptrs[-1] - ptrs[0] < sum(s.nbytes() + 64 for s in storages)
    assert dl.stats()["raw_shared_memory"]["batches"] == 4


def test_stacked_batches_keep_torchs_shared_memory():
    def stacked(samples):
        return default_collate([(key, torch.zeros(3, 8, 8) + float(key), label) for key, _, label in samples])

    dl = DataLoader(Images(), batch_size=16, num_workers=2, collate_fn=stacked)
    batches = list(dl)
    assert len(batches) == 4 and all(b[1].shape == (16, 3, 8, 8) and b[1].is_shared() for b in batches)
    assert "raw_shared_memory" not in dl.stats()


def test_the_batch_is_built_while_its_bytes_are_copied_and_an_error_waits_for_the_copies(monkeypatch):
    import threading

    from loaders.dataloader import copyout, rawshm, vmread

    monkeypatch.setattr(vmread, "ENABLED", False)  # copied out of the segment, not read from the packer's memory
    monkeypatch.setattr(copyout, "copy_threads", lambda: 2)
    monkeypatch.setattr(copyout, "MIN_BATCH_BYTES", 0)
    batch = [{"__key__": f"{i:06d}", "jpg": payload(i, 40_000)} for i in range(32)]
    pool = SegmentPool(MARK, cap=1)
    copies = RawCopies(MARK, workers=1, batches=1)
    copying, done = threading.Event(), []
    original = copyout._copy

    def slow(jobs):
        copying.set()
        time.sleep(0.3)
        original(jobs)
        done.append(len(jobs))

    monkeypatch.setattr(copyout, "_copy", slow)
    built = rawshm.batch_of

    def building(*args):
        assert copying.wait(5) and not done  # the body is unpickled while the copies run
        return built(*args)

    monkeypatch.setattr(rawshm, "batch_of", building)
    out = copies.unpack(pack_raw(batch, pool))
    assert same(out, batch) and len(done) == 2  # handed out only once both copies ended

    def failing(*args):
        raise pickle.UnpicklingError("a broken body")

    monkeypatch.setattr(rawshm, "batch_of", failing)
    done.clear()
    packed = pack_raw(batch, pool)
    with pytest.raises(pickle.UnpicklingError):
        copies.unpack(packed)
    assert len(done) == 2 and segment_state(packed) == FREE  # the copies ended before the segment went back


class _Indexed(list):
    """A custom batch type whose constructor hashes its leaves (a user's collate result)."""

    def __init__(self, items):
        super().__init__(items)
        self.index = {blob: i for i, blob in enumerate(items)}


def test_a_custom_batch_type_is_rebuilt_only_after_its_bytes_are_copied(monkeypatch):
    from loaders.dataloader import copyout

    monkeypatch.setattr(copyout, "copy_threads", lambda: 3)
    monkeypatch.setattr(copyout, "MIN_BATCH_BYTES", 0)
    blobs = [payload(i, 40_000) for i in range(32)]
    pool = SegmentPool(MARK, cap=1)
    packed = pack_raw(_Indexed(blobs), pool)
    assert packed[7] is None  # not a plain body: rebuilt by its type's own code
    out = RawCopies(MARK, workers=1, batches=1).unpack(packed)
    assert type(out) is _Indexed and list(out) == blobs
    assert [out.index[bytes(b)] for b in blobs] == list(range(32))  # hashed after the copies: equal bytes find it


@pytest.mark.parametrize("keep", [True, False])
def test_the_main_process_keeps_freed_memory_for_the_copies_unless_the_stream_says_no(tmp_path, monkeypatch, keep):
    from datapipe.read.options import StorageOptions
    from loaders.dataloader import copyout

    kept = []
    monkeypatch.setattr(copyout, "keep_freed_memory", lambda: kept.append(1) or True)
    urls = write_big_shards(tmp_path, [40])
    stream = ShardStream(urls, storage=StorageOptions(keep_freed_memory=keep)).map(lambda s: s)
    got = list(DataLoader(stream, batch_size=20, num_workers=1, collate_fn=as_list))
    assert sum(len(b) for b in got) == 40
    assert bool(kept) == keep  # asked in this process as the workers' raw batches are set up, or left alone
