import io
import tarfile

import pytest

from datapipe.tar.blocks import BlockReader, MmapReader
from datapipe.tar.headers import TarFormatError
from datapipe.tar.reader import count_samples, iter_samples


def make_tar(members, fmt=tarfile.USTAR_FORMAT):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("block_size", [512, 1000, 1 << 20])
def test_block_reader_handles_any_block_size(block_size):
    members = [(f"s{i // 2}.{'a' if i % 2 else 'b'}", bytes([i]) * (i * 97)) for i in range(40)]
    data = make_tar(members)
    events = list(iter_samples(BlockReader(io.BytesIO(data), block_size=block_size), "u"))
    assert [e.key for e in events] == [f"s{i}" for i in range(20)]
    assert events[3].sample["a"] == bytes([7]) * 7 * 97


def test_start_stop_and_count(tmp_path):
    members = [(f"s{i:02d}.{ext}", f"{i}{ext}".encode()) for i in range(12) for ext in ("x", "y")]
    path = tmp_path / "t.tar"
    path.write_bytes(make_tar(members))
    with open(path, "rb", buffering=0) as f:
        assert count_samples(MmapReader(f)) == 12
    with open(path, "rb", buffering=0) as f:
        events = list(iter_samples(MmapReader(f), "u", start=4, stop=7))
    assert [e.ordinal for e in events] == [4, 5, 6]
    assert events[0].sample == {"__key__": "s04", "__url__": "u", "x": b"4x", "y": b"4y"}


def test_zero_copy_views(tmp_path):
    path = tmp_path / "t.tar"
    path.write_bytes(make_tar([("a.bin", b"hello"), ("b.bin", b"world")]))
    with open(path, "rb", buffering=0) as f:
        reader = MmapReader(f)
        values = [e.sample["bin"] for e in iter_samples(reader, "u", zero_copy=True)]
        reader.close()
    assert all(isinstance(v, memoryview) for v in values) and [bytes(v) for v in values] == [b"hello", b"world"]


def test_truncated_member_raises_with_offset():
    data = make_tar([("a.bin", b"x" * 3000), ("b.bin", b"y" * 10)])
    with pytest.raises(TarFormatError, match="ends inside member"):
        list(iter_samples(BlockReader(io.BytesIO(data[:1500])), "u"))


@pytest.mark.parametrize("content, message", [
    (b"", "the file is empty"),
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 123\n", "Git LFS pointer"),
    (b"just one line of text\n", "shorter than one tar header"),
])
def test_short_files_are_not_tars(tmp_path, content, message):
    path = tmp_path / "not.tar"
    path.write_bytes(content)
    for make in (MmapReader, lambda f: BlockReader(f)):
        with open(path, "rb", buffering=0) as f:
            with pytest.raises(TarFormatError, match=message) as info:
                list(iter_samples(make(f), "u", resync=True))
        assert info.value.offset == 0


def test_missing_end_of_archive_is_truncation_but_keeps_the_last_sample():
    data = make_tar([("a.bin", b"x" * 10), ("b.bin", b"y" * 10)])
    end = 4 * 512  # two members, then the end-of-archive blocks
    with pytest.raises(TarFormatError, match="without the end-of-archive"):
        list(iter_samples(BlockReader(io.BytesIO(data[:end])), "u"))
    got = []
    with pytest.raises(TarFormatError, match="inside the end-of-archive") as info:
        for event in iter_samples(BlockReader(io.BytesIO(data[:end + 512])), "u"):
            got.append(event.key)
    assert got == ["a", "b"] and info.value.offset == end + 512
    assert [e.key for e in iter_samples(BlockReader(io.BytesIO(data[:end + 1024])), "u")] == ["a", "b"]


def test_mmap_reader_lets_go_of_read_pages_and_views_stay_whole(tmp_path, monkeypatch):
    """Mapped pages behind the read position are released as the read goes on (values read by copy map
    nothing); values and zero-copy views into released pages are still the shard's bytes."""
    monkeypatch.setattr(MmapReader, "RELEASE_BYTES", 64 << 10)
    members = [(f"s{i:03d}.{ext}", bytes([i, len(ext)]) * (20_000 + i)) for i in range(30) for ext in ("a", "bb")]
    path = tmp_path / "s.tar"
    path.write_bytes(make_tar(members))
    for zero_copy in (False, True):
        with open(path, "rb", buffering=0) as f:
            reader = MmapReader(f)
            samples = [e.sample for e in iter_samples(reader, "u", zero_copy=zero_copy)]
            if zero_copy:
                assert reader._released > len(path.read_bytes()) // 2
            else:
                assert reader._mm is None  # values are pread: nothing of the file is mapped at all
            values = [(s["__key__"], bytes(s["a"]), bytes(s["bb"])) for s in samples]  # views read after release
            reader.close()
        assert values == [(f"s{i:03d}", bytes([i, 1]) * (20_000 + i), bytes([i, 2]) * (20_000 + i))
                          for i in range(30)]


def test_keys_follow_webdatasets_rule_for_every_kind_of_name():
    """Keys and extensions as webdataset's regular expression splits them: at the first dot of the last path
    component, also for dotted folders, a last component that starts with a dot and a newline in a folder."""
    import re

    names = ["a.jpg", "a.b.c", "d/x.jpg", "d.e/x.y.z", "p/q/r.txt", "f/.hidden", "g.h/.x", "n\nl/x.jpg", "m.jpg\n",
             "nodot", "f/nodot"]
    rule = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
    data = make_tar([(name, name.encode()) for name in names], fmt=tarfile.GNU_FORMAT)
    got = {(e.key, ext) for e in iter_samples(BlockReader(io.BytesIO(data)), "u") for ext in e.sample
           if not ext.startswith("__")}
    expected = {(m.group(1), m.group(2).lower()) for m in map(rule.match, names) if m}
    assert got == expected and ("f/", "hidden") in got and ("g", "h/.x") not in got


def test_mmap_reader_reads_a_file_cut_under_it_as_its_end(tmp_path):
    """A local shard cut short after it was opened reads as a truncated shard (no crash on the lost pages)."""
    from datapipe.tar.blocks import TarTruncated

    path = tmp_path / "s.tar"
    path.write_bytes(make_tar([(f"s{i}.bin", bytes([i]) * 50_000) for i in range(6)]))
    with open(path, "rb", buffering=0) as f:
        reader = MmapReader(f)
        with open(path, "r+b") as cut:
            cut.truncate(120_000)
        with pytest.raises(TarTruncated):
            list(iter_samples(reader, "u"))
        reader.close()


def test_mmap_reader_maps_a_shard_only_for_views(tmp_path, monkeypatch):
    """Values read by copy map nothing of the file (no mmap, madvise or munmap per shard); the first
    zero-copy view maps it."""
    import mmap as mmap_module

    path = tmp_path / "s.tar"
    path.write_bytes(make_tar([(f"s{i}.bin", bytes([i]) * 30_000) for i in range(4)]))
    made = []
    real = mmap_module.mmap
    monkeypatch.setattr(mmap_module, "mmap", lambda *a, **k: made.append(a) or real(*a, **k))
    with open(path, "rb", buffering=0) as f:
        reader = MmapReader(f)
        assert [e.sample["bin"] for e in iter_samples(reader, "u")] == [bytes([i]) * 30_000 for i in range(4)]
        reader.close()
    assert made == []
    with open(path, "rb", buffering=0) as f:
        reader = MmapReader(f)
        views = [e.sample["bin"] for e in iter_samples(reader, "u", zero_copy=True)]
        assert len(made) == 1 and [bytes(v) for v in views] == [bytes([i]) * 30_000 for i in range(4)]
        reader.close()


def _count_preads(monkeypatch):
    import os

    calls = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: calls.append(n) or real(fd, n, offset))
    return calls


def test_mmap_reader_reads_a_samples_headers_and_small_values_in_one_call(tmp_path, monkeypatch):
    """A shard of samples with a small and a large member: one system call reads a sample's headers and its small
    value together, one more its large value (two per sample, not one per header and one per value)."""
    members = []
    for i in range(30):
        members += [(f"s{i:03d}.cls", str(i).encode()), (f"s{i:03d}.jpg", bytes([i]) * (40_000 + i))]
    path = tmp_path / "s.tar"
    path.write_bytes(make_tar(members))
    calls = _count_preads(monkeypatch)
    with open(path, "rb", buffering=0) as f:
        reader = MmapReader(f)
        samples = [e.sample for e in iter_samples(reader, "u")]
        reader.close()
    assert [(s["cls"], s["jpg"]) for s in samples] == [(str(i).encode(), bytes([i]) * (40_000 + i)) for i in range(30)]
    assert len(calls) <= 2 * 30 + 2
    assert sorted(calls)[-30:] == sorted(40_000 + i for i in range(30))  # large values: read once, exactly


def test_mmap_reader_reads_shards_of_tiny_samples_in_few_calls(tmp_path, monkeypatch):
    """Tiny samples (three small members each): the read-ahead window grows, so a shard of 2,000 takes a few
    dozen system calls, and every value is what ``tarfile`` reads."""
    members = [(f"k{i:05d}.{ext}", f"{ext}{i}".encode() * (1 + i % 7)) for i in range(2000) for ext in ("a", "b", "c")]
    path = tmp_path / "s.tar"
    path.write_bytes(make_tar(members))
    calls = _count_preads(monkeypatch)
    with open(path, "rb", buffering=0) as f:
        reader = MmapReader(f)
        got = [(e.key, ext, e.sample[ext]) for e in iter_samples(reader, "u") for ext in "abc"]
        reader.close()
    assert got == [(name.split(".")[0], name.split(".")[1], data) for name, data in members]
    assert len(calls) < 100


@pytest.mark.parametrize("sizes", [[0, 1, 511, 512, 513], [1500, 2047, 2048, 2049, 1], [3000, 700, 100_000, 5]])
def test_mmap_reader_values_across_window_edges(tmp_path, sizes):
    """Values that end before, at and past the edge of the read-ahead window, and large ones after small ones,
    read as ``tarfile`` reads them (the same through the block reader)."""
    members = [(f"s{i:03d}.{j}", bytes([(i + j) % 251]) * size) for i in range(12) for j, size in enumerate(sizes)]
    path = tmp_path / "s.tar"
    path.write_bytes(make_tar(members))
    expected = [(name.split(".")[0], name.split(".")[1], data) for name, data in members]
    with open(path, "rb", buffering=0) as f:
        reader = MmapReader(f)
        got = [(e.key, ext, e.sample[ext]) for e in iter_samples(reader, "u") for ext in map(str, range(len(sizes)))]
        reader.close()
    assert got == expected
    blocked = [(e.key, ext, e.sample[ext]) for e in iter_samples(BlockReader(io.BytesIO(path.read_bytes())), "u")
               for ext in map(str, range(len(sizes)))]
    assert blocked == expected


def test_walk_samples_hands_whole_samples_out_as_their_dicts():
    """``walk_samples`` (the stream's hot path): a whole sample comes as its dict, its ordinal and key on the
    grouping while it is handed out; damage still comes as an event; the samples are those of ``iter_samples``."""
    from datapipe.tar.reader import SampleEvent, walk_samples

    members = [(f"s{i:02d}.{ext}", bytes([i]) * (100 + i)) for i in range(8) for ext in ("a", "b")]
    data = bytearray(make_tar(members))
    data[512 * 2 * 5 + 3] ^= 0x55  # break the header of sample 2's first member (each member is 2 blocks)
    expected = list(iter_samples(BlockReader(io.BytesIO(bytes(data))), "u", start=1, stop=6, resync=True))
    g, events = walk_samples(BlockReader(io.BytesIO(bytes(data))), "u", start=1, stop=6, resync=True)
    got = []
    for event in events:
        if type(event) is dict:
            event = SampleEvent(g.ordinal, g.key, event)
        got.append((event.ordinal, event.key, event.sample, type(event.error)))
    assert got == [(e.ordinal, e.key, e.sample, type(e.error)) for e in expected]
    assert [o for o, _, s, _ in got if s is None][:1] == [2] and [o for o, _, s, _ in got if s][:1] == [1]
