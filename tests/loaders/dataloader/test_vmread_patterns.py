"""loaders.dataloader.vmread in the patterns users run: every batch exact byte for byte whether its raw leaves are read
out of the workers' memory or not (passes left and restarted, live iterators, kept and pickled batches, errors, start
methods, resume), and a pause of the consumer of any length while a finished worker still holds unread batches."""
import io
import os
import pickle
import time
import zlib

import numpy as np
import pytest
import torch

from datapipe import ShardStream, ShardWriter
from loaders import DataLoader
from loaders.dataloader import handback, rawshm, vmread
from loaders.dataloader.shm import recycling_available
from tests.shards import write_keyed

pytestmark = pytest.mark.skipif(not recycling_available(), reason="needs torch's file_descriptor sharing")
needs_reads = pytest.mark.skipif(not vmread.allowed(*vmread.writer()), reason="this machine refuses process_vm_readv")


@pytest.fixture(autouse=True, params=["held", "ahead"])
def reads_on_any_machine(monkeypatch, request):
    """The library reads from 12 cores on; these tests read anywhere. ``held``: torch's next index held until the
    copy (the 2-core machine's way, loaders.dataloader.handback); ``ahead``: not held, so an iterable pass reads
    its next batch in a thread of its own (loaders.dataloader.unpacking), and reads a batch of 4 MB or more in 4
    threads, as on 12 cores or more."""
    monkeypatch.setattr(vmread, "MIN_CORES", 0)
    if request.param == "ahead":
        monkeypatch.setattr(handback, "HOLD", False)
        monkeypatch.setattr(rawshm, "read_threads", lambda: 4)


def payload(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


class EarlyDone(torch.utils.data.IterableDataset):
    """Worker 0 yields 2 batches and its share ends; worker 1 yields 3, more slowly. Worker 0's later batches are
    packed after the main process mapped its first segment, so they travel as addresses (kind "r")."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for b in range(2 if info.id == 0 else 3):
            time.sleep(0.3 if info.id == 0 else 1.0)
            for i in range(32):
                key = f"w{info.id}-{b}-{i:02d}"
                yield {"__key__": key, "jpg": payload(zlib.crc32(key.encode()), 12_000)}


def _keys_and_wrong(batches):
    """The sorted keys delivered and the keys whose bytes differ from what was yielded."""
    keys = sorted(s["__key__"] for b in batches for s in b)
    wrong = [s["__key__"] for b in batches for s in b if s["jpg"] != payload(zlib.crc32(s["__key__"].encode()), 12_000)]
    return keys, wrong


EARLY_KEYS = sorted(f"w{w}-{b}-{i:02d}" for w, n in ((0, 2), (1, 3)) for b in range(n) for i in range(32))


@needs_reads
def test_a_pause_of_the_consumer_while_a_finished_worker_holds_unread_batches_loses_nothing():
    """torch tells a worker whose share ended to exit while its last batches still wait to be read: the worker
    stays (vmread.drain) however long the consumer pauses (an evaluation, a checkpoint mid-epoch)."""
    loader = DataLoader(EarlyDone(), batch_size=32, num_workers=2, collate_fn=lambda b: b, prefetch_factor=4)
    got = []
    for i, batch in enumerate(loader):
        got.append(batch)
        if i == 1:
            time.sleep(2.5)
    assert _keys_and_wrong(got) == (EARLY_KEYS, [])


SIZES = [0, 1, 511, 512, 513, 4096, 100_000, 2_500_000]


class Blobs(torch.utils.data.Dataset):
    """Map-style: sample i is a dict of bytes of many sizes, content a function of i; raises for ``bad``."""

    def __init__(self, n=48, bad=()):
        self.n, self.bad = n, set(bad)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise ValueError(f"bad sample {i}")
        size = SIZES[i % len(SIZES)]
        return {"i": i, "data": payload(i, size), "more": payload(10_000 + i, 700 + i)}


def _exact(batch, ids=None):
    """Every sample of ``batch`` (a list of dicts or default_collate's dict of lists) as written."""
    rows = batch if isinstance(batch, list) else [dict(zip(batch, v)) for v in zip(*batch.values())]
    out = []
    for s in rows:
        i = int(s["i"])
        assert s["data"] == payload(i, SIZES[i % len(SIZES)]), i
        assert s["more"] == payload(10_000 + i, 700 + i), i
        assert type(s["data"]) is bytes
        out.append(i)
    return out


@needs_reads
@pytest.mark.parametrize("workers,prefetch,persistent,collate", [
    (1, 1, False, "list"), (2, 4, True, "list"), (3, 1, True, "default"), (4, 2, False, "default"),
])
def test_held_exact_over_passes_left_early_and_restarted_at_once(workers, prefetch, persistent, collate):
    loader = DataLoader(Blobs(), batch_size=4, num_workers=workers, prefetch_factor=prefetch,
                        persistent_workers=persistent, shuffle=True,
                        collate_fn=(lambda b: b) if collate == "list" else None)
    kept = []
    for epoch in range(4):
        seen = []
        for k, batch in enumerate(loader):
            seen += _exact(batch)
            kept.append(pickle.dumps(batch))
            if epoch % 2 == 0 and k == 2:
                break  # left early, the next pass starts at once
        if epoch % 2 == 1:
            assert sorted(seen) == list(range(48))
    for blob in kept:
        _exact(pickle.loads(blob))
    buf = io.BytesIO()
    torch.save([pickle.loads(b) for b in kept[:3]], buf)
    buf.seek(0)
    for b in torch.load(buf, weights_only=False):
        _exact(b)


@needs_reads
def test_held_two_live_iterators_interleaved():
    loader = DataLoader(Blobs(), batch_size=4, num_workers=2, collate_fn=lambda b: b)
    a, b = iter(loader), iter(loader)
    seen_a, seen_b = [], []
    for x, y in zip(a, b):
        seen_a += _exact(x)
        seen_b += _exact(y)
    assert seen_a == seen_b == list(range(48))


@needs_reads
def test_held_a_worker_raising_mid_pass():
    loader = DataLoader(Blobs(bad={9, 30}), batch_size=4, num_workers=2, collate_fn=lambda b: b)
    it, seen, errors = iter(loader), [], 0
    while True:
        try:
            seen += _exact(next(it))
        except StopIteration:
            break
        except ValueError:
            errors += 1
    assert errors == 2 and sorted(seen) == [i for i in range(48) if i // 4 not in (9 // 4, 30 // 4)]


@needs_reads
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_held_other_start_methods(context):
    loader = DataLoader(Blobs(24), batch_size=4, num_workers=2, collate_fn=None, multiprocessing_context=context,
                        timeout=60)
    for _ in range(2):
        assert sorted(i for b in loader for i in _exact(b)) == list(range(24))


@needs_reads
def test_held_device_cpu():
    loader = DataLoader(Blobs(), batch_size=4, num_workers=2, collate_fn=lambda b: b, device="cpu")
    for _ in range(2):
        assert sorted(i for b in loader for i in _exact(b)) == list(range(48))
    for k, b in enumerate(loader):
        _exact(b)
        if k == 1:
            break
    assert sorted(i for b in loader for i in _exact(b)) == list(range(48))


def ident(batch):
    return batch


def _write(tmp_path, n=300):
    sizes = [0, 511, 512, 3000, 100_000, 1_500_000]
    samples = {f"k{i:05d}": payload(50_000 + i, sizes[i % len(sizes)] + (i % 3)) for i in range(n)}
    write_keyed(str(tmp_path / "s-%04d.tar"), samples, max_count=40)
    return samples


@needs_reads
@pytest.mark.parametrize("persistent", [False, True])
def test_held_shardstream_shuffled_resume_mid_epoch_exact(tmp_path, persistent):
    samples = _write(tmp_path)

    def make():
        return DataLoader(ShardStream(str(tmp_path), shuffle=True, seed=7), batch_size=8, num_workers=2,
                          collate_fn=ident, persistent_workers=persistent)

    loader = make()
    it = iter(loader)
    head = [next(it) for _ in range(7)]
    state = loader.state_dict()
    blob = io.BytesIO()
    torch.save(head, blob)
    del it
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    blob.seek(0)
    got = {}
    for b in torch.load(blob, weights_only=False) + rest:
        for s in b:
            assert s["__key__"] not in got
            got[s["__key__"]] = s["bin"]
    assert got.keys() == samples.keys()
    assert all(got[k] == v for k, v in samples.items())
    again = {s["__key__"]: s["bin"] for b in resumed for s in b}  # the next epoch, whole
    assert again == samples


@needs_reads
def test_held_shardstream_slow_steps_uneven_shards(tmp_path):
    """The same as a ShardStream job meets it: shards split unevenly over the workers, so one worker's share ends
    first, and each training step is slow."""
    samples = {}
    rng = np.random.default_rng(3)
    with ShardWriter(str(tmp_path / "s-%04d.tar"), max_count=48) as w:
        for i in range(48 * 3):
            v = rng.integers(0, 256, 20_000 + i, dtype=np.uint8).tobytes()
            samples[f"k{i:05d}"] = v
            w.write({"__key__": f"k{i:05d}", "bin": v})
    loader = DataLoader(ShardStream(str(tmp_path)), batch_size=16, num_workers=2, collate_fn=ident,
                        prefetch_factor=4)
    got = {}
    for batch in loader:
        time.sleep(0.4)  # a training step
        got.update((s["__key__"], s["bin"]) for s in batch)
    assert got == samples


@needs_reads
def test_held_pin_memory_on_cpu_and_reads_happen(monkeypatch):
    reads = []
    real = vmread.reading
    monkeypatch.setattr(vmread, "reading", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    loader = DataLoader(Blobs(), batch_size=4, num_workers=2, collate_fn=ident, pin_memory=True)
    for _ in range(2):
        assert sorted(i for b in loader for i in _exact(b)) == list(range(48))
    assert reads and os.getpid() not in reads  # the scenarios above do go through process_vm_readv
