import hashlib
import json
import os

import pytest
import webdataset

from datapipe import ShardStream, ShardWriter


def samples(n, size=100):
    return [{"__key__": f"k{i:04d}", "bin": bytes([i % 256]) * (size + i), "cls": str(i)} for i in range(n)]


def test_limits_manifest_and_checksums(tmp_path):
    with ShardWriter(str(tmp_path / "s-%03d.tar"), max_count=4) as w:
        for s in samples(10):
            w.write(s)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["count"] for s in manifest["shards"]] == [4, 4, 2] and manifest["num_samples"] == 10
    for entry in manifest["shards"]:
        data = (tmp_path / entry["name"]).read_bytes()
        assert entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def test_max_bytes(tmp_path):
    with ShardWriter(str(tmp_path / "s-%03d.tar"), max_bytes=20_000, max_count=1000) as w:
        for s in samples(30, size=2000):
            w.write(s)
    sizes = [os.path.getsize(tmp_path / n) for n in sorted(os.listdir(tmp_path)) if n.endswith(".tar")]
    assert len(sizes) > 1 and all(s <= 20_000 + 10_240 for s in sizes)


def test_readable_by_webdataset_and_shardstream(tmp_path):
    written = samples(7)
    with ShardWriter(str(tmp_path / "s-%03d.tar"), max_count=3) as w:
        for s in written:
            w.write(s)
    spec = str(tmp_path / "s-{000..002}.tar")
    theirs = list(webdataset.WebDataset(spec, shardshuffle=False))
    ours = list(ShardStream(spec))
    assert [s["__key__"] for s in theirs] == [s["__key__"] for s in ours] == [s["__key__"] for s in written]
    assert all(a["bin"] == b["bin"] and a["cls"] == b"%d" % i for i, (a, b) in enumerate(zip(ours, written)))


def test_error_inside_the_block_leaves_no_partial_shard(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardWriter(str(tmp_path / "s-%03d.tar"), max_count=3) as w:
            for s in samples(5):
                w.write(s)
            raise RuntimeError("job died")
    names = sorted(os.listdir(tmp_path))
    assert names == ["s-000.tar"], names  # the finished shard only; no temp file, no partial shard


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="placeholder"):
        ShardWriter(str(tmp_path / "s.tar"))
    with ShardWriter(str(tmp_path / "s-%03d.tar")) as w:
        with pytest.raises(ValueError, match="__key__"):
            w.write({"bin": b"x"})


def test_bytes_identical_to_webdataset_tarwriter(tmp_path):
    """The one-pass writer lays out tars exactly as webdataset's TarWriter (mtime 0), long keys and encodables too,
    up to its member table (the last member); then come the end-of-archive blocks, as webdataset's."""
    import io
    import tarfile

    from datapipe.tar.member_table import NAME

    written = samples(9) + [{"__key__": "x" * 150, "txt": "héllo"}, {"__key__": "d/é", "json": {"a": 1}, "cls": 3},
                            {"__key__": "empty", "bin": b""}]
    ref = io.BytesIO()
    tw = webdataset.TarWriter(ref, mtime=0)
    for s in written:
        tw.write(s)
    tw.close()
    with ShardWriter(str(tmp_path / "s-%03d.tar")) as w:
        for s in written:
            w.write(s)
    data = (tmp_path / "s-000.tar").read_bytes()
    with tarfile.open(tmp_path / "s-000.tar") as tf:
        table = tf.getmember(NAME)
    members, rest = ref.getvalue()[:table.offset], ref.getvalue()[table.offset:]
    assert data[:table.offset] == members and not rest.strip(b"\0")
    assert len(data) % tarfile.RECORDSIZE == 0 and not data[table.offset_data + table.size:].strip(b"\0")
    assert w.shards[0]["sha256"] == hashlib.sha256(data).hexdigest() and w.shards[0]["bytes"] == len(data)


def test_member_headers_are_tarfiles_byte_for_byte():
    """The template-built header equals tarfile's for short, 100-character, non-ASCII and long names, all sizes."""
    import tarfile

    from datapipe.tar.writer import _member_header

    names = ["a.b", "k0001.jpg", "d/sub/x.cls", "n" * 96 + ".jpg", "é.txt", "x" * 150 + ".bin"]
    for name in names:
        for size in (0, 1, 511, 512, 513, 107_000, 8 ** 11 - 1, 8 ** 11):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uname, info.gname = size, 0, 0o444, "bigdata", "bigdata"
            short = len(name) <= 100 and name.isascii()
            try:
                ref = info.tobuf(tarfile.USTAR_FORMAT if short else tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
            except ValueError:  # ustar's size field overflows: refused the same way
                with pytest.raises(ValueError):
                    _member_header(name, size)
                continue
            assert _member_header(name, size) == ref, (name, size)


def test_a_dropped_shard_stops_its_hash_thread(tmp_path):
    import threading

    with pytest.raises(RuntimeError):
        with ShardWriter(str(tmp_path / "s-%03d.tar")) as w:
            for s in samples(3):
                w.write(s)
            raise RuntimeError("stop")
    assert not [t for t in threading.enumerate() if t.name == "datapipe-shard-sha256"]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("sample, words", [
    ({"__key__": "a", "j\x00g": b"1"}, "NUL"),  # the member's name would end at the NUL: 'a.j'
    ({"__key__": "a\x00b", "jpg": b"1"}, "NUL"),
    ({"__key__": "a", "x/y.z": b"1"}, "slash"),  # 'a.x/y.z' reads as key 'a.x/y', extension 'z'
    ({"__key__": "a", "/q/.r": b"1"}, "slash"),  # 'a./q/.r': a hidden file to readers, skipped
])
def test_names_readers_would_not_read_back_are_refused_before_anything_is_written(tmp_path, sample, words):
    with ShardWriter(str(tmp_path / "s-%03d.tar")) as w:
        w.write({"__key__": "ok", "jpg": b"0"})
        with pytest.raises(ValueError, match=words):
            w.write(sample)
        w.write({"__key__": "b", "jpg": b"3"})
    got = [{k: v for k, v in s.items() if k != "__url__"} for s in ShardStream(str(tmp_path / "s-000.tar"))]
    assert got == [{"__key__": "ok", "jpg": b"0"}, {"__key__": "b", "jpg": b"3"}]
