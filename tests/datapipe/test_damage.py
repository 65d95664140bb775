"""Damaged shards, systematically: shards from webdataset, GNU tar and tarfile (PAX, GNU) cut at every
512-byte boundary and inside headers, data, padding and the end-of-archive blocks, with and without a
manifest, local and over HTTP. ``raise`` raises ``DataError``; ``skip`` delivers exactly the samples a
reference reading of the uncut shard says are complete before the cut.

A sample is complete before a cut once the header of the member after it (the next sample's first
member, extension headers included) or the first end-of-archive block lies wholly before the cut:
only then can any reader tell that no further member of it follows.
"""
import bz2
import gzip
import io
import lzma
import os
import random
import shutil
import subprocess
import tarfile
import tempfile

import pytest
import webdataset

from datapipe import DataError, ShardStream
from datapipe.tar.manifest import make_manifest, write_manifest
from datapipe.tar.headers import split_key
from tests.servers import http_server

NAMES = ["a000", "a001", "b/long-" + "x" * 110 + "-002", "a003", "a004"]  # one name needs a long-name header


def _samples():
    rnd = random.Random(7)
    return [{"__key__": key, "cls": str(i).encode(), "bin": rnd.randbytes((10, 700, 1500, 512, 3)[i])}
            for i, key in enumerate(NAMES)]


def _members():
    return [(f"{s['__key__']}.{ext}", s[ext]) for s in _samples() for ext in ("cls", "bin")]


def by_webdataset(tmp) -> bytes:
    path = os.path.join(tmp, "wds.tar")
    with webdataset.TarWriter(path) as w:
        for s in _samples():
            w.write(s)
    return open(path, "rb").read()


def by_tarfile(fmt):
    def make(tmp) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            for name, data in _members():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()
    return make


def by_gnu_tar(tmp) -> bytes:
    if shutil.which("tar") is None:
        pytest.skip("GNU tar is not on PATH")
    src = os.path.join(tmp, "src")
    names = []
    for name, data in _members():
        os.makedirs(os.path.join(src, os.path.dirname(name)), exist_ok=True)
        with open(os.path.join(src, name), "wb") as f:
            f.write(data)
        names.append(name)
    out = os.path.join(tmp, "gnu.tar")
    subprocess.run(["tar", "--format=gnu", "--no-recursion", "-cf", out, "-C", src, *names], check=True)
    return open(out, "rb").read()


BUILDERS = {"webdataset": by_webdataset, "tarfile-pax": by_tarfile(tarfile.PAX_FORMAT),
            "tarfile-gnu": by_tarfile(tarfile.GNU_FORMAT), "gnu-tar": by_gnu_tar}


def reference(data: bytes):
    """``(keys in order, first_header_end per sample, end-of-archive offset)`` from tarfile on the uncut shard."""
    keys, header_ends, end = [], [], 0
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar:
            key = split_key(m.name)[0]
            if not keys or keys[-1] != key:
                keys.append(key)
                header_ends.append(m.offset_data)
            end = m.offset_data + -(-m.size // 512) * 512
    return keys, header_ends, end


def complete_before(cut: int, ref) -> list[str]:
    keys, header_ends, end = ref
    bounds = header_ends[1:] + [end + 512]
    return [k for k, b in zip(keys, bounds) if b <= cut]


def offsets(data: bytes, ref) -> list[int]:
    """Every 512-byte boundary up to the end of the archive, and offsets inside headers, data, padding
    and the end-of-archive blocks."""
    _, _, end = ref
    cuts = set(range(0, end + 1024, 512))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar:
            cuts.update({m.offset + 1, m.offset + 100, m.offset + 511, m.offset_data - 1})
            if m.size:
                cuts.update({m.offset_data + 1, m.offset_data + m.size // 2, m.offset_data + m.size - 1})
            if m.size % 512:
                cuts.add(m.offset_data + m.size + 1)  # inside the padding
    cuts.update({end + 1, end + 511, end + 512 + 200, end + 1023})
    return sorted(c for c in cuts if 0 <= c < end + 1024)


@pytest.fixture(autouse=True)
def _own_count_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the count cache of remote shards goes under ~/.cache


def _write_case(directory, data: bytes, cut: int, manifest_count: int | None) -> list[str]:
    """The cut shard plus a whole one after it (its samples must always come through)."""
    os.makedirs(directory)
    with open(os.path.join(directory, "shard-000000.tar"), "wb") as f:
        f.write(data[:cut])
    with open(os.path.join(directory, "shard-000001.tar"), "wb") as f:
        f.write(_renamed())
    if manifest_count is not None:
        write_manifest(directory, make_manifest([
            {"name": "shard-000000.tar", "count": manifest_count, "bytes": cut, "sha256": ""},
            {"name": "shard-000001.tar", "count": len(NAMES), "bytes": 0, "sha256": ""}]))
    return ["shard-000000.tar", "shard-000001.tar"]


def _renamed() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(len(NAMES)):
            info = tarfile.TarInfo(f"z{i:03d}.cls")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))
    return buf.getvalue()


WHOLE = [f"z{i:03d}" for i in range(len(NAMES))]


def check_cut(urls, cut, ref, *, intact: bool):
    want = complete_before(cut, ref)
    if intact:
        assert [s["__key__"] for s in ShardStream(urls, on_error="raise")] == ref[0] + WHOLE
        return
    with pytest.raises(DataError, match=r"byte \d+") as info:
        list(ShardStream(urls, on_error="raise"))
    assert "shard-000000.tar" in str(info.value), str(info.value)
    stream = ShardStream(urls, on_error="skip")
    got = [s["__key__"] for s in stream]
    assert got == want + WHOLE, f"cut at {cut}: {got} != {want + WHOLE}"
    stats = stream.stats()
    assert stats["errors"] >= 1, f"cut at {cut}: damage not counted"
    assert any("byte" in e for e in stats["last_errors"]), stats["last_errors"]


def _cases(tmp_path, builder, with_manifest):
    data = BUILDERS[builder](str(tmp_path))
    return data, reference(data)


@pytest.mark.parametrize("with_manifest", [False, True], ids=["no-manifest", "manifest"])
@pytest.mark.parametrize("builder", list(BUILDERS))
def test_every_cut_local(tmp_path, builder, with_manifest):
    data, ref = _cases(tmp_path, builder, with_manifest)
    cuts = offsets(data, ref)
    assert len(cuts) > 40
    for i, cut in enumerate(cuts + [len(data)]):
        directory = str(tmp_path / f"case{i}")
        names = _write_case(directory, data, cut, len(ref[0]) if with_manifest else None)
        check_cut([os.path.join(directory, n) for n in names], cut, ref, intact=cut >= ref[2] + 1024)


@pytest.mark.parametrize("with_manifest", [False, True], ids=["no-manifest", "manifest"])
@pytest.mark.parametrize("builder", ["webdataset", "tarfile-pax"])
def test_representative_cuts_over_http(tmp_path, builder, with_manifest):
    data, ref = _cases(tmp_path, builder, with_manifest)
    _, header_ends, end = ref
    chosen = sorted({0, 100, 512, header_ends[1] - 1, header_ends[1], header_ends[2] + 1, (end // 1024) * 512 + 3,
                     end, end + 512, end + 600, len(data)})
    root = tmp_path / "web"
    for i, cut in enumerate(chosen):
        _write_case(str(root / f"case{i}"), data, cut, len(ref[0]) if with_manifest else None)
    with http_server(str(root)) as (base, _):
        for i, cut in enumerate(chosen):
            urls = [f"{base}/case{i}/shard-00000{j}.tar" for j in range(2)]
            check_cut(urls, cut, ref, intact=cut >= end + 1024)


@pytest.mark.parametrize("content", [b"", b"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n",
                                     b"a one-line text file\n", b"<html>" + b"x" * 2000])
def test_files_that_are_not_tars(tmp_path, content):
    path = tmp_path / "shard-000000.tar"
    path.write_bytes(content)
    with pytest.raises(DataError, match="byte 0|not a tar"):
        list(ShardStream(str(path), on_error="raise"))
    stream = ShardStream(str(path), on_error="skip")
    assert list(stream) == [] and stream.stats()["errors"] >= 1


def test_damage_counted_without_manifest_is_cached_and_still_reported(tmp_path):
    data = by_webdataset(str(tmp_path))
    ref = reference(data)
    cut = ref[1][3] + 50  # inside the fourth sample's first member
    directory = str(tmp_path / "d")
    names = _write_case(directory, data, cut, None)
    urls = [os.path.join(directory, n) for n in names]
    for _ in range(2):  # counted, then from the cache: the same samples and the same report
        stream = ShardStream(urls, on_error="skip")
        assert [s["__key__"] for s in stream] == complete_before(cut, ref) + WHOLE
        stats = stream.stats()
        assert stats["errors"] == 1 and any("byte" in e for e in stats["last_errors"]), stats
    assert os.path.exists(os.path.join(directory, ".datapipe-counts.json"))


def test_ddp_ranks_stay_equal_when_a_shard_is_shorter_than_its_manifest(tmp_path):
    data = by_webdataset(str(tmp_path))
    ref = reference(data)
    directory = str(tmp_path / "d")
    names = _write_case(directory, data, ref[1][2] + 10, len(ref[0]))
    urls = [os.path.join(directory, n) for n in names]
    lengths, delivered, padded = [], set(), 0
    for rank in range(3):
        stream = ShardStream(urls, on_error="skip", rank=rank, world_size=3)
        got = [s["__key__"] for s in stream]
        lengths.append(len(got))
        delivered |= set(got)
        padded += stream.stats()["padded"]
        assert len(got) == len(stream)
    assert len(set(lengths)) == 1
    assert delivered == set(ref[0][:2] + WHOLE)
    assert padded >= len(ref[0]) - 2  # the lost samples were replaced by counted repeats


# ---- formats and damage a reader must not pass over in silence ------------------------------------

def _one_member_samples(names_and_data, directory, *, manifest_count=None, name="shard-000000.tar"):
    os.makedirs(directory, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data in names_and_data:
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    if manifest_count is not None:
        write_manifest(str(directory), make_manifest([{"name": name, "count": manifest_count,
                                                       "bytes": len(buf.getvalue()), "sha256": ""}]))
    return path, buf.getvalue()


SPARSE_FORMATS = ["gnu", "oldgnu", "posix --sparse-version=1.0", "posix --sparse-version=0.1",
                  "posix --sparse-version=0.0"]


@pytest.mark.parametrize("fmt", SPARSE_FORMATS)
def test_sparse_members_are_refused_by_name_and_counted(tmp_path, fmt):
    if shutil.which("tar") is None:
        pytest.skip("GNU tar is not on PATH")
    src = tmp_path / "src"
    src.mkdir()
    (src / "k000.bin").write_bytes(b"zero")
    with open(src / "k001.bin", "wb") as f:  # seven islands of data: the GNU sparse map needs an extension block
        for i in range(7):
            f.seek(i << 20)
            f.write(b"island %d" % i)
    (src / "k002.bin").write_bytes(b"two")
    out = tmp_path / "d" / "shard-000000.tar"
    out.parent.mkdir()
    subprocess.run(["tar", *f"--format={fmt}".split(), "-S", "-cf", str(out), "-C", str(src),
                    "k000.bin", "k001.bin", "k002.bin"], check=True)
    if not any(m.issparse() for m in tarfile.open(out)):
        pytest.skip("this file system keeps no holes: tar wrote no sparse member")
    with pytest.raises(DataError, match=r"sparse tar members are not supported \(member 'k001\.bin'\)") as info:
        list(ShardStream(str(out)))
    assert "shard-000000.tar" in str(info.value)
    stream = ShardStream(str(out), on_error="skip")
    keys = [s["__key__"] for s in stream]
    assert keys == ["k000", "k002"]
    assert stream.stats()["skipped"] == 1 and stream.stats()["errors"] == 1
    assert "sparse" in stream.stats()["last_errors"][0]


def test_damaged_header_mid_shard_resyncs_to_the_next_header(tmp_path):
    members = [(f"k{i:03d}.{ext}", b"1" if ext == "cls" else bytes([i]) * 700) for i in range(6) for ext in ("cls", "bin")]
    for with_manifest in (False, True):
        directory = tmp_path / f"m{with_manifest}"
        path, data = _one_member_samples(members, directory, manifest_count=6 if with_manifest else None)
        offset = next(m.offset for m in tarfile.open(path) if m.name == "k002.cls")
        damaged = bytearray(data)
        damaged[offset + 148] ^= 0x11  # the checksum field
        open(path, "wb").write(bytes(damaged))
        with pytest.raises(DataError, match="checksum"):
            list(ShardStream(path))
        stream = ShardStream(path, on_error="skip")
        assert [s["__key__"] for s in stream] == ["k000", "k001", "k003", "k004", "k005"]
        stats = stream.stats()
        assert (stats["errors"], stats["skipped"]) == (1, 1), stats
        assert "k002" in stats["last_errors"][0]


def test_a_missing_end_of_archive_block_is_one_error_that_blames_no_whole_sample(tmp_path):
    members = [(f"k{i:03d}.cls", b"1") for i in range(4)]
    for with_manifest in (False, True):
        directory = tmp_path / f"m{with_manifest}"
        path, data = _one_member_samples(members, directory, manifest_count=4 if with_manifest else None)
        end = len(data.rstrip(b"\0"))
        end = -(-end // 512) * 512
        open(path, "wb").write(data[:end + 512])  # one end-of-archive block of two
        with pytest.raises(DataError, match="end-of-archive"):
            list(ShardStream(path))
        stream = ShardStream(path, on_error="skip")
        assert [s["__key__"] for s in stream] == ["k000", "k001", "k002", "k003"]
        stats = stream.stats()
        assert (stats["errors"], stats["skipped"]) == (1, 0), stats
        assert "key 'k003'" not in stats["last_errors"][0]


def test_a_jpeg_named_tar_is_not_a_tar_file(tmp_path):
    path = tmp_path / "shard-000000.tar"
    path.write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(range(256)) * 8)
    with pytest.raises(DataError, match="not a tar file: it starts like a JPEG image"):
        list(ShardStream(str(path)))


def _tar_bytes(n):
    return _one_member_samples([(f"k{i:03d}.bin", os.urandom(3000)) for i in range(n)],
                               tempfile.mkdtemp())[1]


@pytest.mark.parametrize("name,compress", [
    ("shard-000000.tar", gzip.compress), ("shard-000000.tar.bz2", bz2.compress), ("shard-000000.tar.xz", lzma.compress),
    ("shard-000000.tgz", lambda b: b), ("shard-000000", gzip.compress)])
def test_compression_is_told_by_content_not_name(tmp_path, name, compress):
    (tmp_path / name).write_bytes(compress(_tar_bytes(5)))
    assert [s["__key__"] for s in ShardStream(str(tmp_path / name))] == [f"k{i:03d}" for i in range(5)]


def test_zstd_shards_are_refused_in_so_many_words(tmp_path):
    (tmp_path / "shard-000000.tar.zst").write_bytes(b"\x28\xb5\x2f\xfd" + bytes(600))
    with pytest.raises(DataError, match="zstd-compressed shards are not supported"):
        list(ShardStream(str(tmp_path / "shard-000000.tar.zst"), counts=[1]))


def _gzip_cases(data):
    packed = gzip.compress(data, compresslevel=1)
    bad_crc = bytearray(packed)
    bad_crc[-8] ^= 0xFF  # the CRC32 of the trailer
    return {"truncated": packed[: len(packed) * 2 // 3], "bad-crc": bytes(bad_crc)}


@pytest.mark.parametrize("case", ["truncated", "bad-crc"])
@pytest.mark.parametrize("with_manifest", [False, True], ids=["no-manifest", "manifest"])
def test_damaged_gzip_is_a_data_error_and_skip_keeps_what_came_before(tmp_path, case, with_manifest):
    n = 60
    data = _tar_bytes(n)
    path = tmp_path / "shard-000000.tar.gz"
    path.write_bytes(_gzip_cases(data)[case])
    if with_manifest:
        write_manifest(str(tmp_path), make_manifest([{"name": path.name, "count": n, "bytes": 0, "sha256": ""}]))
    with pytest.raises(DataError, match=r"EOFError|BadGzipFile|CRC") as info:
        list(ShardStream(str(path)))
    assert "shard-000000.tar.gz" in str(info.value)
    for on_error in ("skip", "warn"):
        stream = ShardStream(str(path), on_error=on_error)
        keys = [s["__key__"] for s in stream]
        assert keys == [f"k{i:03d}" for i in range(len(keys))]
        if case == "truncated":
            assert 10 < len(keys) < n
        stats = stream.stats()
        assert stats["errors"] >= 1
        if with_manifest:
            assert stats["skipped"] == n - len(keys)


def _tar_with(path, members, fmt=tarfile.PAX_FORMAT):
    """A tar made by tarfile from ``(name, data or ("link"|"symlink"|"dir", target))`` members."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if isinstance(data, tuple):
                kind, target = data
                info.type = {"link": tarfile.LNKTYPE, "symlink": tarfile.SYMTYPE, "dir": tarfile.DIRTYPE}[kind]
                info.linkname = target
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return str(path)


LINKS = [("symlink", "a symbolic link"), ("link", "a hard link")]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("kind, words", LINKS)
def test_link_members_are_refused_by_name_and_counted(tmp_path, kind, words, fmt):
    # a link member holds no data: skipping it silently would lose that file of its sample
    members = [("k000.cls", b"0"), ("k000.jpg", b"zero"), ("k001.cls", b"1"), ("k001.jpg", (kind, "k000.jpg")),
               ("k002.cls", b"2"), ("k002.jpg", b"two")]
    for with_manifest in (False, True):
        path = _tar_with(tmp_path / f"m{with_manifest}" / "shard-000000.tar", members, fmt)
        if with_manifest:
            write_manifest(os.path.dirname(path), make_manifest([{"name": "shard-000000.tar", "count": 3,
                                                                  "bytes": os.path.getsize(path), "sha256": ""}]))
        with pytest.raises(DataError, match=rf"member 'k001\.jpg' is {words}") as info:
            list(ShardStream(path))
        assert "shard-000000.tar" in str(info.value) and "k001" in str(info.value)
        for on_error in ("skip", "warn"):
            stream = ShardStream(path, on_error=on_error)
            assert [s["__key__"] for s in stream] == ["k000", "k002"]
            stats = stream.stats()
            assert (stats["skipped"], stats["errors"]) == (1, 1), stats
            assert words in stats["last_errors"][0]


def test_consecutive_link_samples_are_each_counted(tmp_path):
    # every link a sample of its own, back to back: each is one counted loss, the samples after them come through
    members = [("k000.bin", b"0"), ("k001.bin", ("symlink", "k000.bin")), ("k002.bin", ("link", "k000.bin")),
               ("k003.bin", ("symlink", "k000.bin")), ("k004.bin", b"4")]
    path = _tar_with(tmp_path / "shard-000000.tar", members)
    stream = ShardStream(path, on_error="skip")
    assert [s["__key__"] for s in stream] == ["k000", "k004"]
    stats = stream.stats()
    assert (stats["skipped"], stats["errors"]) == (3, 3), stats


def test_directory_entries_and_links_outside_samples_are_skipped(tmp_path):
    # as webdataset (its tar iterator keeps regular files only) and DALI's wds2idx: a directory entry holds no
    # sample data, nor does a link whose name no sample would have (no extension)
    members = [("d", ("dir", "")), ("d/k000.bin", b"0"), ("latest", ("symlink", "d/k000.bin")),
               ("d/k001.bin", b"1")]
    path = _tar_with(tmp_path / "shard-000000.tar", members)
    stream = ShardStream(path)
    assert [s["__key__"] for s in stream] == ["d/k000", "d/k001"]
    assert stream.stats()["errors"] == 0
