"""Worker batches whose raw values a worker names in their shard files (datapipe.read.origins), read out of the
files in the main process (loaders.dataloader.filereads): the same batches as copied ones, or a clear error."""
import os

import numpy as np
import pytest

import loaders.dataloader.loader as loader_module
from datapipe import ShardStream, ShardWriter
from datapipe.read import origins
from loaders import DataLoader
from loaders.dataloader.filereads import FileChanged, FileReads
from loaders.dataloader.rawshm import Packed, RawCopies, pack_raw
from loaders.dataloader.shm import SegmentPool, recycling_available

pytestmark = pytest.mark.skipif(not (recycling_available() and origins.available()),
                                reason="needs torch's file_descriptor sharing and /proc/self/fd")


def payload(i: int) -> bytes:
    return bytes((i * 13 + j) % 251 for j in range(97)) * (200 + i % 50)  # ~19-24 KB


@pytest.fixture
def shards(tmp_path):
    with ShardWriter(str(tmp_path / "s-%04d.tar"), max_count=40) as w:
        for i in range(150):
            w.write({"__key__": f"k{i:05d}", "bin": payload(i), "cls": i % 7})
    return str(tmp_path)


@pytest.fixture(autouse=True)
def off():
    origins.enable(False)
    yield
    origins.enable(False)


def as_tuples(samples):
    return [s["__key__"] for s in samples], [s["bin"] for s in samples], [s["cls"] for s in samples]


def passes(data, names, *, workers=2, persistent=False, epochs=2, fn=None, monkeypatch):
    monkeypatch.setattr(loader_module, "names_files", lambda: names)
    stream = ShardStream(data, shuffle=True, shuffle_buffer=20, seed=3)
    if fn is not None:
        stream = stream.map(fn)
    dl = DataLoader(stream, batch_size=32, num_workers=workers, collate_fn=as_tuples,
                    persistent_workers=persistent and workers > 0)
    got = []
    for epoch in range(epochs):
        for keys, values, labels in dl:
            assert all(type(v) is bytes for v in values)
            got.append((keys, values, labels))
    return got, dl._raw.files.reads if dl._raw is not None else 0


@pytest.mark.parametrize("persistent", [False, True])
def test_named_values_give_the_batches_copies_give(shards, persistent, monkeypatch):
    copied, reads_off = passes(shards, False, persistent=persistent, monkeypatch=monkeypatch)
    named, reads_on = passes(shards, True, persistent=persistent, monkeypatch=monkeypatch)
    assert named == copied and sum(len(b[0]) for b in named) == 300
    assert reads_off == 0 and reads_on > 0  # the values did travel as file spans
    want = {f"k{i:05d}": payload(i) for i in range(150)}
    assert all(want[k] == v for keys, values, _ in named for k, v in zip(keys, values))


def test_values_the_users_code_replaced_travel_as_copies(shards, monkeypatch):
    def reverse(sample):
        return {**sample, "bin": sample["bin"][::-1]}

    named, reads = passes(shards, True, fn=reverse, monkeypatch=monkeypatch)
    assert reads == 0
    want = {f"k{i:05d}": payload(i)[::-1] for i in range(150)}
    assert all(want[k] == v for keys, values, _ in named for k, v in zip(keys, values))


def test_without_workers_nothing_is_noted(shards, monkeypatch):
    got, reads = passes(shards, True, workers=0, epochs=1, monkeypatch=monkeypatch)
    assert reads == 0 and not origins.enabled() and sum(len(b[0]) for b in got) == 150


def noted_batch(path, n=20, size=20_000, extra=None):
    """A batch of ``n`` values read from ``path`` and noted, as a worker makes it (``extra``: a leaf beside)."""
    origins.enable()
    fd = os.open(path, os.O_RDONLY)
    number = origins.file_of(fd)
    values = []
    for i in range(n):
        v = os.pread(fd, size, i * size)
        origins.note(v, number, i * size)
        values.append(v)
    os.close(fd)
    return {"values": values, **({"extra": extra} if extra is not None else {})}


@pytest.mark.parametrize("extra", [None, b"q" * 300_000, np.arange(100_000, dtype=np.int32)])
def test_a_packed_batch_names_its_values_and_comes_out_equal(tmp_path, extra):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(500_000))
    batch = noted_batch(path, extra=extra)
    packed = pack_raw(batch, SegmentPool(b"namesmk!", cap=2), files=True)
    assert type(packed) is Packed and packed[3].count("s") == 20
    copies = RawCopies(b"namesmk!", workers=1, batches=2)
    out = copies.unpack(packed)
    assert out["values"] == batch["values"] and all(type(v) is bytes for v in out["values"])
    if extra is not None:
        assert np.array_equal(out["extra"], extra) and type(out["extra"]) is type(extra)
    assert copies.files.reads == 20
    copies.clear()


def test_a_file_changed_after_the_worker_read_it_is_an_error_not_other_bytes(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(500_000))
    packed = pack_raw(noted_batch(path), SegmentPool(b"namesmk!", cap=2), files=True)
    with open(path, "r+b") as f:  # rewritten in place, one byte
        f.seek(30_000)
        f.write(b"!")
    os.utime(path, ns=(0, 1))
    with pytest.raises(FileChanged, match="changed while it was being read"):
        RawCopies(b"namesmk!", workers=1, batches=2).unpack(packed)


def test_a_file_replaced_by_a_shorter_one_is_an_error(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(500_000))
    packed = pack_raw(noted_batch(path), SegmentPool(b"namesmk!", cap=2), files=True)
    os.unlink(path)
    path.write_bytes(b"short")
    with pytest.raises(FileChanged):
        RawCopies(b"namesmk!", workers=1, batches=2).unpack(packed)


def test_file_reads_close_their_files(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"a" * 1000)
    st = os.stat(path)
    reads = FileReads()
    fd = reads.fd((str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    reads.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_at_most_max_open_files_stay_open(tmp_path, monkeypatch):
    from loaders.dataloader import filereads

    monkeypatch.setattr(filereads, "MAX_OPEN", 3)
    reads, files = FileReads(), []
    for i in range(6):
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(bytes([i]) * 1000)
        st = os.stat(path)
        files.append((str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        values, readings = reads.start([(files[-1], 10, 100), (files[0], 0, 50)], threads=1)
        reads.finish(readings)
        assert values == [bytes([i]) * 100, b"\0" * 50]
        assert len(reads.fds) <= 3 and files[0] in reads.fds  # the file read each time stays open
    reads.close()


def test_a_cached_remote_shard_evicted_while_its_values_travel_is_read_whole(tmp_path, monkeypatch):
    """A remote shard's cached copy is the cache's to evict (cache_limit; another process of the node): the
    workers' values of it travel whole, never named in a file the main process may no longer open."""
    from tests.servers import http_server

    web, cache = tmp_path / "web", str(tmp_path / "cache")
    with ShardWriter(str(web / "s-%04d.tar"), max_count=40) as w:
        for i in range(150):
            w.write({"__key__": f"k{i:05d}", "bin": payload(i), "cls": i % 7})

    def evicted(sample):  # as another process's commit evicts the cached copies (LRU) meanwhile
        for name in os.listdir(cache):
            if name.endswith(".tar"):
                try:
                    os.remove(os.path.join(cache, name))
                except FileNotFoundError:
                    pass
        return sample

    monkeypatch.setattr(loader_module, "names_files", lambda: True)
    with http_server(str(web)) as (base, _):
        urls = [f"{base}/s-{i:04d}.tar" for i in range(4)]
        assert len(list(ShardStream(urls, cache_dir=cache))) == 150  # cached
        dl = DataLoader(ShardStream(urls, cache_dir=cache).map(evicted), batch_size=32, num_workers=2,
                        collate_fn=as_tuples)
        got = {k: v for keys, values, _ in dl for k, v in zip(keys, values)}
    assert got == {f"k{i:05d}": payload(i) for i in range(150)}


def shard_files_open(root) -> int:
    """Descriptors of this process open on files under ``root``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(root))
        except OSError:
            pass
    return n


@pytest.mark.parametrize("persistent", [False, True])
def test_the_shard_files_read_are_closed_with_their_pass_or_loader(shards, persistent, monkeypatch):
    import gc

    monkeypatch.setattr(loader_module, "names_files", lambda: True)
    dl = DataLoader(ShardStream(shards), batch_size=32, num_workers=2, collate_fn=as_tuples,
                    persistent_workers=persistent)
    for _ in range(3):
        assert sum(len(keys) for keys, _, _ in dl) == 150
        gc.collect()
        assert dl._raw.files.reads > 0 and shard_files_open(shards) <= (4 if persistent else 0)
    del dl
    gc.collect()
    assert shard_files_open(shards) == 0


def test_values_are_read_one_by_one_where_preadv_fails_and_the_file_is_whole(tmp_path, monkeypatch):
    """A sandbox that refuses ``preadv`` (ENOSYS, EPERM) or a read that fails for another reason is not a file
    that changed: the values are read again with ``pread``, and only a file that no longer holds them is an error."""
    import ctypes
    import errno

    from datapipe.read import spans

    lib = spans._functions()
    if lib is None:
        pytest.skip("no preadv here")

    def refused(fd, iov, count, offset):
        ctypes.set_errno(errno.ENOSYS)
        return -1

    path = tmp_path / "f.bin"
    data = os.urandom(500_000)
    path.write_bytes(data)
    st = os.stat(path)
    file = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    monkeypatch.setattr(spans, "_lib", (refused, *lib[1:]))
    reads = FileReads()
    values, readings = reads.start([(file, 1_000, 40_000), (file, 100_000, 30_000)], threads=1)
    reads.finish(readings)
    assert values == [data[1_000:41_000], data[100_000:130_000]]
    reads.close()


def test_naming_is_off_by_default_even_with_cores_to_spare(monkeypatch):
    from loaders.dataloader import copyout, filereads

    monkeypatch.setattr(copyout, "read_threads", lambda: 8)
    assert not filereads.names_files()
    monkeypatch.setattr(filereads, "ENABLED", True)
    assert filereads.names_files()
