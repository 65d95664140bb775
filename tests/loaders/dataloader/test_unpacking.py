"""loaders.dataloader.unpacking: an iterable pass whose workers' raw leaves the main process reads out of their memory
takes its next batch in a thread of its own and starts that batch's reads while the consumer takes this one; every
batch exact, the thread gone once the pass is left, copies never outliving the leaves they write into."""
import gc
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from loaders import DataLoader
from loaders.dataloader import handback, rawshm, unpacking, vmread
from loaders.dataloader.copyout import Copying
from loaders.dataloader.shm import recycling_available

pytestmark = pytest.mark.skipif(not recycling_available(), reason="needs torch's file_descriptor sharing")
needs_reads = pytest.mark.skipif(not vmread.allowed(*vmread.writer()), reason="this machine refuses process_vm_readv")
THREAD = "datapipe-unpack"


@pytest.fixture(autouse=True)
def as_on_many_cores(monkeypatch):
    """What a 12-core machine does with 2 workers: reads the workers' memory in threads, holds no index."""
    monkeypatch.setattr(vmread, "MIN_CORES", 0)
    monkeypatch.setattr(handback, "HOLD", False)
    monkeypatch.setattr(rawshm, "read_threads", lambda: 4)  # batches of 4 MB or more are read in 4 threads


def payload(key: str, n: int = 300_000) -> bytes:
    return np.random.default_rng(zlib.crc32(key.encode())).integers(0, 256, n, dtype=np.uint8).tobytes()


class Raw(torch.utils.data.IterableDataset):
    """Each worker yields ``per_worker`` samples of raw bytes whose content is a function of the key."""

    def __init__(self, per_worker=96):
        self.per_worker = per_worker

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid = info.id if info is not None else 0
        for i in range(self.per_worker):
            key = f"w{wid}-{i:03d}"
            yield {"__key__": key, "bin": payload(key)}


def ident(batch):
    return batch


def unpack_threads() -> int:
    return sum(t.name == THREAD for t in threading.enumerate())


def wrong(batches) -> list:
    return [s["__key__"] for b in batches for s in b if s["bin"] != payload(s["__key__"])]


def keys(batches) -> list:
    return sorted(s["__key__"] for b in batches for s in b)


ALL = sorted(f"w{w}-{i:03d}" for w in range(2) for i in range(96))


def wait_gone(seconds=10.0) -> int:
    end = time.monotonic() + seconds
    while unpack_threads() and time.monotonic() < end:
        gc.collect()
        time.sleep(0.05)
    return unpack_threads()


@needs_reads
def test_a_pass_reads_ahead_in_its_thread_and_every_batch_is_exact():
    loader = DataLoader(Raw(), batch_size=16, num_workers=2, collate_fn=ident)
    for _ in range(2):
        seen, threads = [], 0
        for batch in loader:
            seen.append(batch)
            threads = max(threads, unpack_threads())
        assert threads == 1
        assert keys(seen) == ALL and wrong(seen) == []
    assert wait_gone() == 0


@needs_reads
@pytest.mark.parametrize("persistent", [False, True])
def test_a_pass_left_midway_lets_its_thread_go_and_the_next_pass_is_whole(persistent):
    loader = DataLoader(Raw(), batch_size=16, num_workers=2, collate_fn=ident, persistent_workers=persistent)
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    assert wrong(head) == []
    del it
    assert wait_gone() == 0
    again = list(loader)
    assert keys(again) == ALL and wrong(again) == []


@needs_reads
def test_two_live_iterators_each_get_their_own_pass():
    loader = DataLoader(Raw(), batch_size=16, num_workers=2, collate_fn=ident)
    a, b = iter(loader), iter(loader)
    got_a, got_b = [], []
    for x, y in zip(a, b):
        got_a.append(x)
        got_b.append(y)
    got_a += list(a)
    got_b += list(b)
    assert keys(got_a) == ALL and keys(got_b) == ALL
    assert wrong(got_a) == [] and wrong(got_b) == []


@needs_reads
def test_a_slow_consumer_gets_the_batches_in_order_unchanged():
    loader = DataLoader(Raw(48), batch_size=16, num_workers=2, collate_fn=ident)
    first = [[s["__key__"] for s in b] for b in loader]
    loader2 = DataLoader(Raw(48), batch_size=16, num_workers=2, collate_fn=ident)
    slow = []
    for b in loader2:
        time.sleep(0.05)  # the thread runs ahead meanwhile: its batch waits, started, in the queue
        slow.append(b)
    assert [[s["__key__"] for s in b] for b in slow] == first
    assert wrong(slow) == []


def test_no_thread_where_reads_ahead_is_off(monkeypatch):
    monkeypatch.setattr(unpacking, "ENABLED", False)
    loader = DataLoader(Raw(32), batch_size=16, num_workers=2, collate_fn=ident)
    threads = 0
    for _ in loader:
        threads = max(threads, unpack_threads())
    assert threads == 0
    assert not unpacking.reads_ahead(2)
    monkeypatch.setattr(unpacking, "ENABLED", True)
    assert unpacking.reads_ahead(2) == vmread.wanted()
    assert not unpacking.reads_ahead(0)


def test_copies_dropped_unwaited_end_before_their_leaves_go():
    """A batch started ahead of a pass that ends is dropped with its copies under way: they end first."""
    done = []

    def slow_copy():
        time.sleep(0.3)
        done.append(True)

    with ThreadPoolExecutor(1) as pool:
        copying = Copying(keep=[bytearray(10)])
        copying.pending.append(pool.submit(slow_copy))
        del copying
        assert done == [True]
