"""loaders.dataloader.vmread: a worker batch's raw bytes read out of the worker's memory by the main process, exact,
each leaf kept alive in the worker until its segment is handed back, and the segment path wherever reading is not
allowed."""
import ctypes
import mmap
import os
import signal
import time

import numpy as np
import torch
import pytest

from datapipe import ShardStream, ShardWriter
from datapipe.read import rawbytes
from loaders import DataLoader
from loaders.dataloader import copyout, vmread
from loaders.dataloader.rawshm import RawCopies, pack_raw
from loaders.dataloader.shm import FREE, SegmentPool, _STATE, recycling_available

pytestmark = pytest.mark.skipif(not recycling_available(), reason="needs torch's file_descriptor sharing")
needs_reads = pytest.mark.skipif(not vmread.allowed(*vmread.writer()), reason="this machine refuses process_vm_readv")

MARK = b"vmreads!"


@pytest.fixture(autouse=True)
def reads_on_any_machine(monkeypatch):
    monkeypatch.setattr(vmread, "MIN_CORES", 0)  # the library reads from 12 cores on; these tests read anywhere


def leaves(n, size, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size + i % 7, dtype=np.uint8).tobytes() for i in range(n)]


@needs_reads
@pytest.mark.parametrize("threads", [1, 3])
def test_reading_gives_each_leaf_exactly_in_order_past_the_iovec_limit(threads, monkeypatch):
    monkeypatch.setattr(vmread, "MIN_BATCH_BYTES", 0)
    values = leaves(vmread.MAX_IOV * 2 + 5, 700)
    pairs = [(rawbytes.data_address(v), len(v)) for v in values]
    pid, address, token = vmread.writer()
    out, copying = vmread.reading(pid, (address, token), pairs, threads=threads)
    copying.wait()
    assert out == values and all(type(v) is bytes for v in out)


def test_a_worker_gone_or_another_process_under_its_pid_reads_as_torchs_worker_death(monkeypatch):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # gone
    value = b"x" * 4096
    _, address, token = vmread.writer()
    with pytest.raises(vmread.WorkerGone, match=r"^DataLoader worker \(pid\(s\) %d\) exited unexpectedly" % pid):
        vmread.reading(pid, (address, token), [(rawbytes.data_address(value), len(value))], threads=1)
    assert vmread.allowed(pid, address, token) is False and (pid, token) not in vmread._verdicts  # still open
    # this process, as if it had taken a dead worker's pid: its memory holds no such token there
    with pytest.raises(vmread.WorkerGone):
        vmread.reading(os.getpid(), (address, b"another worker's"), [(rawbytes.data_address(value), 4096)], threads=1)
    assert vmread.allowed(os.getpid(), address, b"another worker's") is False
    monkeypatch.setattr(vmread, "ENABLED", False)
    assert vmread.allowed(*vmread.writer()) is False


@needs_reads
def test_a_packed_batch_names_its_leaves_once_reads_are_allowed_and_holds_them_until_its_segment_is_free():
    batch = [{"__key__": f"{i:04d}", "jpg": v} for i, v in enumerate(leaves(32, 12_000, seed=1))]
    pool = SegmentPool(MARK, cap=2)
    copies = RawCopies(MARK, workers=1, batches=2)
    first = pack_raw(batch, pool)
    assert first[3] == "b" * 32 and not pool.held  # copied: the main process has not said it reads
    assert copies.unpack(first) == batch
    assert pool.reads  # the main process marked the segment as it mapped it
    second = pack_raw(batch, pool)
    assert second[3] == "r" * 32 and [len(v) for v in next(iter(pool.held.values()))] == [len(s["jpg"]) for s in batch]
    storage = second[1][4].untyped_storage()
    assert int(storage.data_ptr() in pool.held) and second[2][0] == rawbytes.data_address(batch[0]["jpg"])
    out = copies.unpack(second)
    assert out == batch and all(a["jpg"] is not b["jpg"] for a, b in zip(out, batch))  # the consumer's own bytes
    assert int(pool.segments[0][1][_STATE]) == FREE and storage.data_ptr() in pool.held  # held until taken again
    third = pack_raw(batch[:16] + batch[:16], pool)
    assert third[1][4].untyped_storage().data_ptr() == storage.data_ptr()  # the same segment: the old ones let go
    assert len(pool.held) == 1 and copies.unpack(third) == batch[:16] + batch[:16]


def _kinds_of_three_passes(pool, *, seed):
    """A batch of 32 raw leaves packed into ``pool`` and unpacked three times: the kinds it travelled as (each
    unpacked batch checked equal to the batch)."""
    batch = [{"__key__": f"{i:04d}", "jpg": v} for i, v in enumerate(leaves(32, 12_000, seed=seed))]
    copies = RawCopies(MARK, workers=1, batches=2)
    kinds = []
    for _ in range(3):
        packed = pack_raw(batch, pool)
        assert copies.unpack(packed) == batch
        kinds.append(packed[3])
    return kinds


def test_where_reads_are_refused_batches_travel_in_their_segments(monkeypatch):
    monkeypatch.setattr(vmread, "ENABLED", False)
    pool = SegmentPool(MARK, cap=2)
    assert _kinds_of_three_passes(pool, seed=2) == ["b" * 32] * 3
    assert not pool.reads and not pool.held


def _shards(tmp_path, n=600, seed=5):
    rng = np.random.default_rng(seed)
    samples = [{"__key__": f"k{i:05d}", "bin": rng.integers(0, 256, 3000 + int(rng.integers(0, 30000)),
                                                           dtype=np.uint8).tobytes(), "cls": str(i % 7)}
               for i in range(n)]
    with ShardWriter(str(tmp_path / "s-%04d.tar"), max_count=70) as w:
        for s in samples:
            w.write(s)
    return samples


@needs_reads
@pytest.mark.parametrize("persistent", [False, True])
def test_worker_batches_read_from_the_workers_memory_come_out_exact_every_pass(tmp_path, monkeypatch, persistent):
    monkeypatch.setattr(copyout, "read_threads", lambda: 3)
    monkeypatch.setattr(vmread, "MIN_BATCH_BYTES", 1 << 16)
    reads = []
    real = vmread.reading
    monkeypatch.setattr(vmread, "reading", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    samples = _shards(tmp_path)
    want = {s["__key__"]: (s["bin"], s["cls"].encode()) for s in samples}
    loader = DataLoader(ShardStream(str(tmp_path), shuffle=True, seed=1), batch_size=32, num_workers=2,
                        collate_fn=lambda b: b, persistent_workers=persistent)
    kept = []
    for epoch in range(3):
        got = {}
        for batch in loader:
            kept.append(batch)  # batches kept across passes stay whole
            for s in batch:
                assert s["__key__"] not in got
                got[s["__key__"]] = (s["bin"], s["cls"])
        assert got == want, epoch
    assert len(reads) > 10 and len(set(reads)) >= 2 and os.getpid() not in reads  # read from the workers
    time.sleep(0.1)
    assert {s["__key__"]: (s["bin"], s["cls"]) for b in kept[-5:] for s in b}.items() <= want.items()


class FastAndSlow(torch.utils.data.IterableDataset):
    """Worker 0 yields two batches soon and is done; worker 1 yields three, slowly: torch tells worker 0 to exit
    as its end comes in, while its second batch still waits behind worker 1's first."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        batches = 2 if info.id == 0 else 3
        for b in range(batches):
            time.sleep(0.8 if info.id == 1 else 0.2 * b)  # worker 0's second batch: once its first is read
            for i in range(32):
                yield {"__key__": f"w{info.id}-{b}-{i:02d}", "jpg": bytes([info.id, b, i]) * 4000}


@needs_reads
def test_a_worker_told_to_exit_stays_until_the_batches_read_from_its_memory_are_read():
    reads = []
    real = vmread.reading
    vmread.reading = lambda *a, **k: reads.append(a[0]) or real(*a, **k)
    try:
        loader = DataLoader(FastAndSlow(), batch_size=32, num_workers=2, collate_fn=lambda b: b)
        got = [s["__key__"] for batch in loader for s in batch]
    finally:
        vmread.reading = real
    assert sorted(got) == sorted(f"w{w}-{b}-{i:02d}" for w, n in ((0, 2), (1, 3)) for b in range(n) for i in range(32))
    assert reads  # the second batch of a worker is read from its memory


class DiesAfterTwo(torch.utils.data.IterableDataset):
    """Worker 0 yields two batches and is then killed; worker 1 yields slowly, so worker 0's second batch (read
    from its memory) is still unread when it dies."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for b in range(2 if info.id == 0 else 3):
            time.sleep(0.8 if info.id == 1 else 0.2 * b)
            for i in range(32):
                yield {"__key__": f"w{info.id}-{b}-{i:02d}", "jpg": bytes([info.id, b, i]) * 4000}
        if info.id == 0:
            time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGKILL)


@needs_reads
def test_a_worker_killed_before_its_batch_is_read_ends_the_pass_with_torchs_error_and_no_wrong_batch():
    loader = DataLoader(DiesAfterTwo(), batch_size=32, num_workers=2, collate_fn=lambda b: b)
    got = []
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid"):
        for batch in loader:
            got.append(batch)
    for batch in got:  # what came before the error is whole and right
        w, b = batch[0]["__key__"].split("-")[:2]
        assert [s["__key__"] for s in batch] == [f"{w}-{b}-{i:02d}" for i in range(32)]
        assert all(s["jpg"] == bytes([int(w[1:]), int(b), i]) * 4000 for i, s in enumerate(batch))


def test_an_exiting_worker_waits_for_its_held_batches_until_read_or_torch_shuts_it_down():
    import multiprocessing
    import threading

    batch = [{"__key__": f"{i:04d}", "jpg": v} for i, v in enumerate(leaves(32, 12_000, seed=3))]
    pool = SegmentPool(MARK, cap=2)
    copies = RawCopies(MARK, workers=1, batches=2)
    copies.unpack(pack_raw(batch, pool))
    held = pack_raw(batch, pool)
    assert held[3] == "r" * 32 and pool.held_busy()
    done = multiprocessing.get_context("fork").Event()
    waiting = threading.Thread(target=vmread.drain, args=(pool,), kwargs={"done": done})
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive()  # its batch is not read yet
    assert copies.unpack(held) == batch
    waiting.join(5)
    assert not waiting.is_alive() and not pool.held_busy()
    held = pack_raw(batch, pool)
    waiting = threading.Thread(target=vmread.drain, args=(pool,), kwargs={"done": done})
    waiting.start()
    done.set()  # torch shuts its workers down: nothing more is read
    waiting.join(5)
    assert not waiting.is_alive() and pool.held_busy()
    copies.release()  # the pass ends: every segment free
    assert not pool.held_busy()


@needs_reads
def test_a_forked_child_of_a_worker_does_not_pass_as_that_worker():
    """A process forked from a worker (os.fork or a fork Pool in the dataset's code) gets a token of its own where
    the worker held its: if it took the dead worker's pid, a read fails as the worker's death, not with its bytes."""
    pid, address, token = vmread.writer()  # this process plays the worker
    leaf = os.urandom(4096)  # a leaf the "worker" holds
    r, w = os.pipe()
    r2, w2 = os.pipe()
    child = os.fork()
    if child == 0:  # the worker's child: its memory diverges from the worker's after the fork
        try:
            ctypes.memset(rawbytes.data_address(leaf), ord("Z"), len(leaf))
            os.write(w2, b"1")
            os.read(r, 1)
        finally:
            os._exit(0)
    try:
        os.read(r2, 1)
        # as the main process would read worker `pid` if `child` had taken its pid after the worker died
        try:
            out, copying = vmread.reading(child, (address, token), [(rawbytes.data_address(leaf), len(leaf))],
                                          threads=1)
            copying.wait()
        except vmread.WorkerGone:
            return  # what the module promises
        assert out[0] == leaf, "bytes of another process passed the token check (silently wrong bytes)"
        pytest.fail("a process other than the worker passed its token check")
    finally:
        os.write(w, b"1")
        os.waitpid(child, 0)


@needs_reads
def test_a_call_of_more_than_2_gib_reads_whole():
    """Linux reads at most 2 GiB - 4 KiB in one process_vm_readv: a batch larger than that (one thread reads all of
    it below 8 cores) goes in several calls, whole. (The iovecs share one buffer each: a few MB, not 2 GiB.)"""
    n = 2_200_000
    src = mmap.mmap(-1, n)
    src.write(os.urandom(n))
    dst = mmap.mmap(-1, n)
    src_addr = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst_addr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    count = vmread.MAX_IOV - 1
    local = np.array([[dst_addr, n]] * count, np.uint64)
    remote = np.array([[src_addr, n]] * count, np.uint64)
    assert count * n > 2**31
    pid, address, token = vmread.writer()
    try:
        vmread._read(pid, (address, token), local, remote)
        assert dst[:] == src[:]
    finally:
        del local, remote


def test_a_leaf_larger_than_a_call_goes_in_pieces(monkeypatch):
    monkeypatch.setattr(vmread, "MAX_CALL_BYTES", 1000)
    monkeypatch.setattr(vmread, "MAX_IOV", 4)
    local = np.array([[10_000, 2500], [20_000, 10], [30_000, 990]], np.uint64)
    remote = local + np.array([1, 0], np.uint64)
    calls = [(loc.tolist(), rem.tolist()) for loc, rem in vmread._calls(local, remote)]
    assert [sum(n for _, n in loc) for loc, _ in calls] == [1000, 1000, 1000, 500]
    assert all(len(loc) <= 3 for loc, _ in calls)
    pieces = [row for loc, _ in calls for row in loc]
    assert pieces[:3] == [[10_000, 1000], [11_000, 1000], [12_000, 500]]
    assert [r[0] - p[0] for (loc, rem) in calls for p, r in zip(loc, rem)] == [1] * len(pieces)
    assert sum(n for _, n in pieces) == 2500 + 10 + 990



def test_below_the_cores_it_needs_batches_travel_in_their_segments(monkeypatch):
    from datapipe.device import autotune

    monkeypatch.setattr(vmread, "MIN_CORES", 12)
    monkeypatch.setattr(autotune, "usable_cores", lambda: 11)
    assert not vmread.wanted()
    assert _kinds_of_three_passes(SegmentPool(MARK, cap=2), seed=4) == ["b" * 32] * 3
    monkeypatch.setattr(autotune, "usable_cores", lambda: 12)
    assert vmread.wanted() == vmread.allowed(*vmread.writer())
