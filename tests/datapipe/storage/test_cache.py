import contextlib
import hashlib
import json
import multiprocessing
import os

import pytest

from datapipe import DataError, ShardStream
from datapipe.storage.cache import INDEX_NAME, ShardCache
from datapipe.tar.manifest import make_manifest, write_manifest
from tests.shards import write_shards
from tests.servers import http_server


def strip(sample):
    return {k: v for k, v in sample.items() if k != "__url__"}


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def serve_dir(tmp_path, counts, *, checksums=False, wrong=()):
    """Shards in tmp_path/web; with ``checksums`` the manifest lists their sha256 (wrong ones for ``wrong``)."""
    urls, samples = write_shards(tmp_path / "web", counts)
    if checksums:
        entries = [{"name": os.path.basename(u), "count": n, "bytes": os.path.getsize(u),
                    "sha256": "0" * 64 if i in wrong else sha(u)} for i, (u, n) in enumerate(zip(urls, counts))]
        write_manifest(str(tmp_path / "web"), make_manifest(entries))
    return urls, samples


@contextlib.contextmanager
def served(tmp_path, counts, *, checksums=False):
    """Shards served on 127.0.0.1: yields ``(remote urls, samples, faults, cache_dir, local urls)``."""
    urls, samples = serve_dir(tmp_path, counts, checksums=checksums)
    with http_server(str(tmp_path / "web")) as (base, faults):
        yield [f"{base}/{os.path.basename(u)}" for u in urls], samples, faults, str(tmp_path / "cache"), urls


def shard_requests(faults, since=0):
    return [p for p in faults.paths[since:] if ".tar" in p]


@pytest.mark.parametrize("checksums", [False, True])
def test_second_epoch_reads_nothing_remote(tmp_path, checksums):
    with served(tmp_path, [5, 4, 6], checksums=checksums) as (remote, samples, faults, cache_dir, urls):
        stream = ShardStream(remote, cache_dir=cache_dir)
        assert [strip(s) for s in stream] == [strip(s) for s in samples]
        assert shard_requests(faults)
        seen = len(faults.paths)
        stream.set_epoch(1)
        assert [strip(s) for s in stream] == [strip(s) for s in samples]
        assert faults.paths[seen:] == []
        assert stream.stats()["cache_hits"] == 3
        # another run (a new process would do the same) reads the manifest, but no shard
        again = ShardStream(remote, cache_dir=cache_dir, shuffle=True, shuffle_buffer=4, seed=3)
        assert sorted(s["__key__"] for s in again) == sorted(s["__key__"] for s in samples)
        assert shard_requests(faults, seen) == []
    cached = ShardCache(cache_dir).read_index()["entries"]
    assert sorted(e["bytes"] for e in cached.values()) == sorted(os.path.getsize(u) for u in urls)
    for name, entry in cached.items():
        assert sha(os.path.join(cache_dir, name)) in {sha(u) for u in urls}
        assert (entry["sha256"] is not None) == checksums


def test_partial_reads_still_cache_whole_shards(tmp_path):
    """Ranks that read parts of a shard (and a gzip shard) still leave whole shards in the cache."""
    import webdataset

    (tmp_path / "web").mkdir()
    urls, samples, rnd = [], [], __import__("random").Random(0)
    for shard, n in enumerate([7, 6]):  # ~100 KB samples: a reader that stops early has not read it all
        urls.append(str(tmp_path / "web" / f"shard-{shard:06d}.tar.gz"))
        with webdataset.TarWriter(urls[-1], compress=True) as w:
            for i in range(n):
                samples.append({"__key__": f"s{shard}-{i}", "bin": rnd.randbytes(100_000)})
                w.write(samples[-1])
    write_manifest(str(tmp_path / "web"), make_manifest([{"name": os.path.basename(u), "count": n, "bytes": 0,
                                                           "sha256": ""} for u, n in zip(urls, [7, 6])]))
    cache_dir = str(tmp_path / "cache")
    with http_server(str(tmp_path / "web")) as (base, faults):
        remote = [f"{base}/{os.path.basename(u)}" for u in urls]
        first = [s["__key__"] for rank in range(3) for s in ShardStream(remote, cache_dir=cache_dir, rank=rank,
                                                                         world_size=3)]
        seen = len(faults.paths)
        second = [s["__key__"] for rank in range(3) for s in ShardStream(remote, cache_dir=cache_dir, rank=rank,
                                                                          world_size=3)]
        assert shard_requests(faults, seen) == []
    assert first == second and set(first) == {s["__key__"] for s in samples}


class Chunky:
    """A remote-like file that returns at most 1000 bytes per read."""

    def __init__(self, data):
        self.data, self.pos, self.size, self.closed = data, 0, len(data), False

    def read(self, n=-1):
        n = min(1000, self.size - self.pos if n < 0 else n)
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out

    def close(self):
        self.closed = True


def test_tee_finish_fetches_the_rest_and_close_without_it_discards(tmp_path):
    data = bytes(range(256)) * 40
    cache = ShardCache(str(tmp_path / "c"))
    f, hit = cache.open("http://h/a.tar", lambda: Chunky(data))
    assert not hit and f.read(1500) == data[:1000]
    f.close()  # abandoned: nothing cached, the partial copy is gone
    assert cache.lookup("http://h/a.tar") is None
    assert [n for n in os.listdir(tmp_path / "c") if not n.endswith(".lock")] == []
    f, _ = cache.open("http://h/a.tar", lambda: Chunky(data))
    f.read(10)
    f.finish()
    f.close()
    with open(cache.lookup("http://h/a.tar"), "rb") as g:
        assert g.read() == data
    f, hit = cache.open("http://h/a.tar", lambda: pytest.fail("a cached shard must not be fetched"))
    assert hit and f.read() == data
    f.close()


def test_checksum_mismatch_is_fetched_once_more(tmp_path):
    urls, samples = serve_dir(tmp_path, [5, 4], checksums=True)
    with http_server(str(tmp_path / "web")) as (base, faults):
        remote = [f"{base}/{os.path.basename(u)}" for u in urls]
        stream = ShardStream(remote, cache_dir=str(tmp_path / "cache"))
        stream.counts
        faults.corruptions = 1  # the first download of the first shard has one byte flipped
        assert [strip(s) for s in stream] == [strip(s) for s in samples]
        gets = [p for p in shard_requests(faults) if p.startswith("GET") and "000000" in p]
        assert len(gets) >= 2


def test_checksum_mismatch_twice_is_a_data_error(tmp_path):
    urls, samples = serve_dir(tmp_path, [5, 4], checksums=True, wrong={1})
    with http_server(str(tmp_path / "web")) as (base, faults):
        remote = [f"{base}/{os.path.basename(u)}" for u in urls]
        with pytest.raises(DataError, match="sha256") as info:
            list(ShardStream(remote, cache_dir=str(tmp_path / "cache")))
        assert "shard-000001" in str(info.value)
        skip = ShardStream(remote, cache_dir=str(tmp_path / "cache"), on_error="skip")
        assert [strip(s) for s in skip] == [strip(s) for s in samples[:5]]
        assert skip.stats()["skipped"] == 4
    assert not [n for n in os.listdir(tmp_path / "cache") if "000001" in n and not n.endswith(".lock")]


def test_eviction_respects_the_limit_and_spares_foreign_files(tmp_path):
    urls, samples = write_shards(tmp_path / "web", [6, 6, 6, 6])
    sizes = [os.path.getsize(u) for u in urls]
    limit = int(max(sizes) * 2.5)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    with http_server(str(tmp_path / "web")) as (base, faults):
        remote = [f"{base}/{os.path.basename(u)}" for u in urls]
        cache = ShardCache(str(cache_dir), limit=limit)
        foreign = {
            "notes.txt": b"mine",
            "shard-000000.tar": open(urls[0], "rb").read(),  # looks like a shard
            cache.name_for(remote[0].replace("000000", "999999")): b"x" * 100,  # looks like a cache file
            cache.name_for(remote[3]): b"y" * 10,  # exactly the name the cache would give shard 3
        }
        for name, data in foreign.items():
            (cache_dir / name).write_bytes(data)

        def owned_bytes():
            skip = set(foreign) | {INDEX_NAME}
            return sum(os.path.getsize(cache_dir / n) for n in os.listdir(cache_dir)
                       if n not in skip and not n.startswith(".") and not n.endswith(".lock"))

        for epoch in range(2):
            stream = ShardStream(remote, cache_dir=str(cache_dir), cache_limit=limit)
            stream.set_epoch(epoch)
            got = []
            for s in stream:
                got.append(strip(s))
                assert owned_bytes() <= limit
            assert got == [strip(s) for s in samples]
        for name, data in foreign.items():
            assert (cache_dir / name).read_bytes() == data, name
        # the cache now holds shards 1 and 2; a hit on 1 makes 2 the least recently used, so 0 evicts 2
        names = set(ShardCache(str(cache_dir)).read_index()["entries"])
        assert names == {cache.name_for(remote[1]), cache.name_for(remote[2])}
        seen = len(faults.paths)
        for i in (1, 0):
            list(ShardStream(remote[i], cache_dir=str(cache_dir), cache_limit=limit))
        names = set(ShardCache(str(cache_dir)).read_index()["entries"])
        assert names == {cache.name_for(remote[1]), cache.name_for(remote[0])}
        assert [p for p in shard_requests(faults, seen) if "000001" in p] == []


def _reader(remote, cache_dir, out, checksums):
    keys = []
    for epoch in range(2):
        stream = ShardStream(remote, cache_dir=cache_dir)
        stream.set_epoch(epoch)
        keys.append([(s["__key__"], hashlib.sha256(s["bin"]).hexdigest()) for s in stream])
    with open(out, "w") as f:
        json.dump(keys, f)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checksums", [False, True])
def test_processes_share_one_cache(tmp_path, checksums):
    urls, samples = serve_dir(tmp_path, [40, 30, 35], checksums=checksums)
    expected = [[s["__key__"], hashlib.sha256(s["bin"]).hexdigest()] for s in samples]
    cache_dir = str(tmp_path / "cache")
    ctx = multiprocessing.get_context("fork")
    with http_server(str(tmp_path / "web")) as (base, faults):
        remote = [f"{base}/{os.path.basename(u)}" for u in urls]
        outs = [str(tmp_path / f"out{i}.json") for i in range(3)]
        procs = [ctx.Process(target=_reader, args=(remote, cache_dir, out, checksums)) for out in outs]
        for p in procs:
            p.start()
        for p in procs:
            p.join(100)
            assert p.exitcode == 0
    for out in outs:
        with open(out) as f:
            assert json.load(f) == [expected, expected]
    entries = ShardCache(cache_dir).read_index()["entries"]
    assert sorted(sha(os.path.join(cache_dir, n)) for n in entries) == sorted(sha(u) for u in urls)
    assert not [n for n in os.listdir(cache_dir) if n.startswith(".datapipe-tmp-")]


def test_bad_cache_arguments(tmp_path):
    with pytest.raises(ValueError, match="cache_dir"):
        ShardStream("x.tar", cache_limit=10)
    with pytest.raises(ValueError, match="cache_limit"):
        ShardStream("x.tar", cache_dir=str(tmp_path), cache_limit=0)
    with pytest.raises(ValueError, match="local"):
        ShardStream("x.tar", cache_dir="s3://bucket/cache")


def _change_in_place(path):
    """Flip one byte in the middle of ``path`` (same size) and move its mtime on, as an edit would."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


@pytest.mark.parametrize("checksums", [False, True])
def test_a_cached_shard_changed_on_disk_is_not_served(tmp_path, checksums):
    with served(tmp_path, [5, 4, 6], checksums=checksums) as (remote, samples, faults, cache_dir, urls):
        stream = ShardStream(remote, cache_dir=cache_dir)
        assert [strip(s) for s in stream] == [strip(s) for s in samples]
        cached = list(ShardCache(cache_dir).read_index()["entries"])
        for name in cached:
            _change_in_place(os.path.join(cache_dir, name))
        stream.set_epoch(1)
        assert [strip(s) for s in stream] == [strip(s) for s in samples]
        assert len(shard_requests(faults)) > 3, "fetched again"
    assert sorted(sha(os.path.join(cache_dir, n)) for n in cached) == sorted(sha(u) for u in urls)


def test_a_cached_shard_only_touched_is_hashed_once_and_served(tmp_path, monkeypatch):
    from datapipe.storage import cache as cache_module

    hashed = []
    real = cache_module._file_sha256
    monkeypatch.setattr(cache_module, "_file_sha256", lambda p: hashed.append(p) or real(p))
    with served(tmp_path, [5, 4], checksums=True) as (remote, samples, faults, cache_dir, _):
        stream = ShardStream(remote, cache_dir=cache_dir)
        list(stream)
        for epoch in (1, 2):  # unchanged: no hashing
            stream.set_epoch(epoch)
            assert [strip(s) for s in stream] == [strip(s) for s in samples]
        assert hashed == []
        name = next(iter(ShardCache(cache_dir).read_index()["entries"]))
        st = os.stat(os.path.join(cache_dir, name))
        os.utime(os.path.join(cache_dir, name), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, same bytes
        seen = len(faults.paths)
        for epoch in (3, 4):
            stream.set_epoch(epoch)
            assert [strip(s) for s in stream] == [strip(s) for s in samples]
        assert len(hashed) == 1 and shard_requests(faults, seen) == []


class _FullDisk:
    """A file open for writing on a full disk: every write fails with ENOSPC."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        import errno

        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("checksums", [False, True])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_cache_on_a_full_disk_costs_only_the_cache_entries(tmp_path, monkeypatch, caplog, checksums, on_error):
    import builtins

    from datapipe.storage import cache as cache_module

    def full_disk_open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return _FullDisk(f) if "w" in mode else f

    monkeypatch.setattr(cache_module, "open", full_disk_open, raising=False)
    with served(tmp_path, [5, 4, 6], checksums=checksums) as (remote, samples, faults, cache_dir, _):
        stream = ShardStream(remote, cache_dir=cache_dir, on_error=on_error)
        with caplog.at_level("WARNING"):
            for epoch in (0, 1):
                stream.set_epoch(epoch)
                assert [strip(s) for s in stream] == [strip(s) for s in samples]
    stats = stream.stats()
    assert stats["cache_failures"] == 6 and stats["errors"] == 0 and stats["cache_hits"] == 0, stats
    assert len([r for r in caplog.records if "cannot keep" in r.getMessage()]) == 1
    assert [n for n in os.listdir(cache_dir) if n.startswith(".datapipe-tmp")] == []
