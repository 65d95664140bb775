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
