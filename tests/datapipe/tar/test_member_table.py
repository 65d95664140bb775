"""The member table ShardWriter leaves as a shard's last member: reads through it equal the header walk's, and
a table that is not sound (cut, edited, appended to) is never used."""
import json
import os
import random
import tarfile

import pytest

from datapipe import DataError, ShardStream, ShardWriter, StorageOptions
from datapipe.read import spans
from datapipe.tar import member_table, read_ahead


def _samples(n, seed=0):
    rnd = random.Random(seed)
    out = [{"__key__": f"k{i:05d}", "jpg": rnd.randbytes(rnd.randrange(0, 3000)), "cls": str(i % 7)} for i in range(n)]
    out += [{"__key__": "x" * 150, "txt": "héllo"}, {"__key__": "d/é", "JSON": b"{}", "cls": 3},
            {"__key__": "empty", "bin": b""}, {"__key__": "dir.v2/a", "jpg": b"1"}]
    return out


def _write(directory, samples, **kw):
    with ShardWriter(os.path.join(directory, "s-%03d.tar"), **kw) as w:
        for s in samples:
            w.write(s)
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".tar"))


def _read(url, walk, monkeypatch, **kw):
    with monkeypatch.context() as m:
        if walk:
            m.setattr(member_table, "load", lambda fd, size: None)
        return [{k: v for k, v in s.items()} for s in ShardStream(url, **kw)]


def _table(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return member_table.load(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def test_a_read_through_the_table_is_the_walks(tmp_path, monkeypatch):
    """Odd keys too: long (pax) names, folders (one with a dot), upper-case extensions, empty values."""
    paths = _write(str(tmp_path), _samples(300), max_count=100)
    assert all(_table(p) is not None for p in paths)
    used = []
    real = member_table.samples
    monkeypatch.setattr(member_table, "samples", lambda *a, **k: used.append(1) or real(*a, **k))
    through_table = _read(str(tmp_path), False, monkeypatch, shuffle=True, seed=3, shuffle_buffer=50)
    assert used, "the table was not used"
    walked = _read(str(tmp_path), True, monkeypatch, shuffle=True, seed=3, shuffle_buffer=50)
    assert through_table == walked and len(walked) == 304
    assert {"x" * 150, "d/é", "dir.v2/a"} <= {s["__key__"] for s in walked}


def _cut_after_the_table_is_read(monkeypatch, path, size):
    real = member_table.load

    def load_then_cut(fd, n):
        table = real(fd, n)
        os.truncate(path, size)
        return table

    monkeypatch.setattr(member_table, "load", load_then_cut)


def test_resume_through_the_table_is_exact(tmp_path, monkeypatch):
    _write(str(tmp_path), _samples(250), max_count=60)
    stream = ShardStream(str(tmp_path), shuffle=True, seed=1, shuffle_buffer=20)
    it = iter(stream)
    head = [next(it)["__key__"] for _ in range(77)]
    state = stream.state_dict()
    rest = [s["__key__"] for s in it]
    again = ShardStream(str(tmp_path), shuffle=True, seed=1, shuffle_buffer=20)
    again.load_state_dict(state)
    assert [s["__key__"] for s in again] == rest and len(head) + len(rest) == 254


def _rewrite_tail(path, edit):
    data = bytearray(open(path, "rb").read())
    with tarfile.open(path) as tf:
        table = tf.getmember(member_table.NAME)
    edit(data, table)
    open(path, "wb").write(bytes(data))


def test_a_damaged_table_is_not_used(tmp_path):
    (path,) = _write(str(tmp_path), _samples(20))
    _rewrite_tail(path, lambda data, t: data.__setitem__(t.offset_data + 40, data[t.offset_data + 40] ^ 1))
    assert _table(path) is None


def test_members_appended_after_the_table_are_not_lost(tmp_path):
    """``tar -r`` appends after the last member: the table no longer ends the archive, so the walk reads the
    shard, and finds the member its manifest does not list."""
    (path,) = _write(str(tmp_path), _samples(20))
    with tarfile.open(path, "a") as tf:
        extra = tmp_path / "late.jpg"
        extra.write_bytes(b"late")
        tf.add(extra, arcname="zz-late.jpg")
    assert _table(path) is None
    with pytest.raises(DataError, match="holds more than the 24 samples"):
        list(ShardStream(path))


def test_a_cut_shard_loses_what_the_walk_loses(tmp_path, monkeypatch):
    (path,) = _write(str(tmp_path), _samples(40))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    assert _table(path) is None
    stream = ShardStream(str(tmp_path), on_error="skip")
    kept = list(stream)
    assert 0 < len(kept) < 44 and stream.stats()["skipped"] == 44 - len(kept)


def test_a_shard_that_shrank_after_its_table_was_read_is_an_error(tmp_path, monkeypatch):
    (path,) = _write(str(tmp_path), _samples(40))
    _cut_after_the_table_is_read(monkeypatch, path, 5000)
    with pytest.raises(DataError, match="ends inside member"):
        list(ShardStream(str(tmp_path)))


def test_a_shard_longer_than_its_manifest_says_is_reported(tmp_path):
    _write(str(tmp_path), _samples(30))
    manifest = json.load(open(tmp_path / "manifest.json"))
    manifest["shards"][0]["count"] -= 1
    manifest["num_samples"] -= 1
    json.dump(manifest, open(tmp_path / "manifest.json", "w"))
    with pytest.raises(DataError, match="holds more than"):
        list(ShardStream(str(tmp_path)))


def test_keys_that_readers_would_split_elsewhere_are_refused(tmp_path):
    with ShardWriter(str(tmp_path / "s-%03d.tar")) as w:
        with pytest.raises(ValueError, match="holds a dot"):
            w.write({"__key__": "a.b", "jpg": b"1"})
        with pytest.raises(ValueError, match="ends in a slash"):
            w.write({"__key__": "a/", "jpg": b"1"})
        w.write({"__key__": "dir.v2/a", "jpg": b"1"})


def test_no_table_where_the_walk_would_see_damage(tmp_path, monkeypatch):
    """A key written twice in a row with the same extension is a duplicate to the walk: no table is written,
    and the walk reports it as before."""
    (path,) = _write(str(tmp_path), [{"__key__": "a", "jpg": b"1"}, {"__key__": "a", "jpg": b"2"},
                                     {"__key__": "b", "jpg": b"3"}])
    assert _table(path) is None
    with tarfile.open(path) as tf:
        assert member_table.NAME not in tf.getnames()


def test_zero_copy_views_through_the_table_are_the_walks(tmp_path, monkeypatch):
    from datapipe import StorageOptions

    _write(str(tmp_path), _samples(60), max_count=25)
    opts = {"storage": StorageOptions(zero_copy=True), "shuffle": True, "seed": 4}
    used = []
    real = member_table.samples
    monkeypatch.setattr(member_table, "samples", lambda *a, **k: used.append(k.get("read")) or real(*a, **k))
    views = _read(str(tmp_path), False, monkeypatch, **opts)
    assert used and all(r is not None for r in used)
    assert any(isinstance(v, memoryview) for s in views for v in s.values())
    as_bytes = [{k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()} for s in views]
    assert as_bytes == _read(str(tmp_path), True, monkeypatch, shuffle=True, seed=4)


def test_shards_without_a_manifest_are_counted_from_their_tables(tmp_path, monkeypatch):
    import datapipe.tar.reader as reader
    from datapipe.tar import counts

    paths = _write(str(tmp_path), _samples(90), max_count=40)
    os.remove(tmp_path / "manifest.json")

    def walk(*args, **kwargs):
        raise AssertionError("a shard with a member table was walked to count it")

    with monkeypatch.context() as m:
        m.setattr(reader, "count_until_damage", walk)
        assert [counts.count_shard(p)["count"] for p in paths] == [40, 40, 14]
    keys = [s["__key__"] for s in ShardStream(paths)]
    assert len(keys) == len(set(keys)) == 94


def test_large_values_are_read_through_the_memory_map(tmp_path, monkeypatch):
    monkeypatch.setattr(member_table, "_MAX_READ", 1000)
    _write(str(tmp_path), _samples(30))
    walked = _read(str(tmp_path), True, monkeypatch)
    assert _read(str(tmp_path), False, monkeypatch) == walked


def test_other_readers_skip_the_table(tmp_path):
    import webdataset

    from datapipe.tar.dali_index import index_lines

    (path,) = _write(str(tmp_path), _samples(10))
    keys = [s["__key__"] for s in webdataset.WebDataset(path, shardshuffle=False, empty_check=False)]
    assert member_table.NAME not in keys and len(keys) == 14
    with open(path, "rb") as f:
        lines = index_lines(f)
    assert lines[0] == "v1.2 14" and member_table.NAME not in "".join(lines)


def test_dali_scanning_a_shard_without_an_index_skips_the_table(tmp_path):
    """DALI's reader over a tar with no index file (it scans the tar itself) sees the samples only: the table's
    hidden-file name is not a sample to it, even where a missing component is an error."""
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn, pipeline_def

    (path,) = _write(str(tmp_path), [{"__key__": f"k{i}", "jpg": b"x" * (i + 1), "cls": str(i)} for i in range(10)])
    assert _table(path) is not None

    @pipeline_def(batch_size=10, num_threads=1, device_id=None)
    def pipe():
        jpg, cls = fn.readers.webdataset(paths=[path], ext=["jpg", "cls"], missing_component_behavior="error")
        return jpg, cls

    p = pipe()
    p.build()
    assert list(p.epoch_size().values()) == [10]
    jpg, _ = p.run()
    assert sorted(jpg.at(i).size for i in range(10)) == list(range(1, 11))


def test_compressed_shards_have_no_table(tmp_path):
    (path,) = [p for p in _write_gz(str(tmp_path))]
    with tarfile.open(path) as tf:
        assert member_table.NAME not in tf.getnames()


def _write_gz(directory):
    with ShardWriter(os.path.join(directory, "s-%03d.tar.gz")) as w:
        for s in _samples(5):
            w.write(s)
    return [os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".gz")]


def test_the_size_limit_counts_the_table(tmp_path):
    paths = _write(str(tmp_path), _samples(400) + [{"__key__": "é" * 120, "txt": "x"}] * 3, max_bytes=100_000)
    assert len(paths) > 3 and all(os.path.getsize(p) <= 100_000 for p in paths)


@pytest.mark.parametrize("threads", [0, 1])
def test_resume_reads_only_the_samples_its_buffer_holds(tmp_path, monkeypatch, threads):
    """Rebuilding the shuffle buffer after a resume reads the samples in its slots; the ones drawn before it,
    between them, are passed over unread (the walk reads and drops them): each value of the rest is read once,
    and no other (one ``pread`` each, or read ahead together)."""
    monkeypatch.setattr(read_ahead.ReadAhead, "MIN_SAMPLE_BYTES", 0)  # read ahead these small values too
    _write(str(tmp_path), [{"__key__": f"k{i:04d}", "jpg": b"x" * 100, "cls": b"1"} for i in range(400)])
    options = StorageOptions(read_threads=threads)
    stream = ShardStream(str(tmp_path), shuffle_buffer=50, seed=2, storage=options)
    it = iter(stream)
    for _ in range(300):
        next(it)
    state = stream.state_dict()
    rest = [s["__key__"] for s in it]
    reads = []
    real, real_spans = os.pread, spans.start_spans
    monkeypatch.setattr(os, "pread", lambda fd, n, off: reads.append(n) or real(fd, n, off))
    monkeypatch.setattr(spans, "start_spans", lambda fd, s, **k: reads.extend(n for _, n in s) or real_spans(fd, s, **k))
    again = ShardStream(str(tmp_path), shuffle_buffer=50, seed=2, storage=options)
    again.load_state_dict(state)
    assert [s["__key__"] for s in again] == rest
    assert sum(1 for n in reads if n in (100, 1)) == 2 * len(rest) == 200
