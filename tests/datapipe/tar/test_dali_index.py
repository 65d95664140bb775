import io
import logging
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import webdataset

from datapipe.cli import main as cli_main
from datapipe.tar.dali_index import default_index_path, index_command, write_dali_index
from datapipe.errors import DataError

pytest.importorskip("nvidia.dali")


def _write_tar(path, samples):
    with webdataset.TarWriter(str(path)) as w:
        for s in samples:
            w.write(s)
    return str(path)


def _samples(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"__key__": f"k{i:04d}", "jpg": rng.bytes(int(rng.integers(1, 3000))), "cls": str(i % 5).encode(),
             "meta.json": b'{"i": %d}' % i} for i in range(n)]


def _reference_index(tar_path, tmp_path):
    """What DALI's own tools/wds2idx.py writes for this tar."""
    wds2idx = pytest.importorskip("wds2idx")
    ref = tmp_path / "ref.idx"
    with wds2idx.IndexCreator(tar_path, str(ref), verbose=False) as creator:
        creator.create_index()
    return ref.read_text()


def test_index_matches_dalis_wds2idx(tmp_path):
    tar = _write_tar(tmp_path / "shard-000000.tar", _samples(25))
    path = write_dali_index(tar)
    assert path == str(tmp_path / "shard-000000.idx") == default_index_path(tar)
    text = open(path).read()
    assert text == _reference_index(tar, tmp_path)
    lines = text.splitlines()
    assert lines[0] == "v1.2 25" and len(lines) == 26
    # offsets point at the member data
    data = open(tar, "rb").read()
    fields = lines[1].split()
    for ext, off, size, name in zip(*[iter(fields)] * 4):
        assert data[int(off): int(off) + int(size)] == _samples(25)[0][ext]


def test_index_skips_directories_and_hidden_files_like_wds2idx(tmp_path):
    tar = str(tmp_path / "odd.tar")
    with tarfile.open(tar, "w") as t:
        for name, payload in [("dir/", None), ("dir/a.jpg", b"x" * 10), ("dir/a.cls", b"1"), (".hidden.txt", b"h"),
                              ("dir/.b.jpg", b"y"), ("c.tar.gz", b"zz"), ("c.cls", b"2"), ("d" * 120 + ".jpg", b"w")]:
            info = tarfile.TarInfo(name.rstrip("/"))
            if payload is None:
                info.type = tarfile.DIRTYPE
                t.addfile(info)
            else:
                info.size = len(payload)
                t.addfile(info, io.BytesIO(payload))
    out = write_dali_index(tar, str(tmp_path / "idx" / "odd.idx"))
    assert open(out).read() == _reference_index(tar, tmp_path)


def _dali_read(paths, index_paths=None):
    from nvidia.dali import fn
    from nvidia.dali.pipeline import Pipeline

    pipe = Pipeline(batch_size=7, num_threads=1, device_id=None, seed=0)
    with pipe:
        jpg, cls = fn.readers.webdataset(paths=paths, index_paths=index_paths, ext=["jpg", "cls"], name="R",
                                         pad_last_batch=False)
        pipe.set_outputs(jpg, cls)
    pipe.build()
    total = pipe.epoch_size("R")
    out = []
    while len(out) < total:
        jpgs, clss = pipe.run()
        for i in range(len(jpgs)):
            out.append((np.asarray(jpgs.at(i)).tobytes(), np.asarray(clss.at(i)).tobytes()))
    return out[:total]


def test_dali_reader_reads_the_same_samples_with_our_index(tmp_path):
    tars = [_write_tar(tmp_path / f"shard-{i:06d}.tar", _samples(n, seed=i)) for i, n in enumerate([9, 13])]
    index_paths = [write_dali_index(t, str(tmp_path / "cache" / f"{i}.idx")) for i, t in enumerate(tars)]
    with_index = _dali_read(tars, index_paths)
    without_index = _dali_read(tars)
    expected = [(s["jpg"], s["cls"]) for s in webdataset.WebDataset(tars, shardshuffle=False)]
    assert len(expected) == 22
    assert with_index == expected
    assert without_index == expected


def test_unreadable_or_empty_shard_raises_data_error(tmp_path):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"this is not a tar file" * 50)
    with pytest.raises(DataError) as e:
        write_dali_index(str(bad))
    assert "bad.tar" in str(e.value)
    empty = tmp_path / "empty.tar"
    with tarfile.open(empty, "w"):
        pass
    with pytest.raises(DataError):
        write_dali_index(str(empty))
    assert not os.path.exists(tmp_path / "empty.idx")


def test_index_command_and_cli(tmp_path, caplog):
    for i in range(3):
        _write_tar(tmp_path / f"shard-{i:06d}.tar", _samples(4, seed=i))
    pattern = str(tmp_path / "shard-{000000..000002}.tar")
    assert cli_main(["index", pattern, "--index-dir", str(tmp_path / "ix")]) == 0
    assert sorted(os.listdir(tmp_path / "ix")) == [f"shard-{i:06d}.idx" for i in range(3)]
    before = os.path.getmtime(tmp_path / "ix" / "shard-000000.idx")
    assert index_command([pattern], index_dir=str(tmp_path / "ix"), skip_existing=True) == 0
    assert os.path.getmtime(tmp_path / "ix" / "shard-000000.idx") == before
    (tmp_path / "broken.tar").write_bytes(b"\x00garbage" * 10)
    with caplog.at_level(logging.ERROR):
        assert index_command([str(tmp_path / "shard-000000.tar"), str(tmp_path / "broken.tar")]) == 1
    assert "broken.tar" in caplog.text
    assert os.path.exists(tmp_path / "shard-000000.idx")


def test_index_stores_counts_so_streams_no_longer_count(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    from datapipe import ShardStream

    for i in range(2):
        _write_tar(tmp_path / f"shard-{i:06d}.tar", _samples(3 + i, seed=i))
    pattern = str(tmp_path / "shard-{000000..000001}.tar")
    assert cli_main(["index", pattern]) == 0
    assert os.path.exists(tmp_path / ".datapipe-counts.json")
    with caplog.at_level(logging.WARNING):
        stream = ShardStream(pattern)
        assert stream.counts == [3, 4] and len(list(stream)) == 7
    assert "counting" not in caplog.text
    (tmp_path / "shard-000001.tar").write_bytes((tmp_path / "shard-000000.tar").read_bytes())  # changed: recounted
    with caplog.at_level(logging.WARNING):
        assert ShardStream(pattern).counts == [3, 3]
    assert "counting their samples once" in caplog.text


def test_index_dir_that_is_a_file_is_one_line_error(tmp_path, capsys):
    _write_tar(tmp_path / "shard-000000.tar", _samples(2, seed=0))
    (tmp_path / "afile").write_text("x")
    out = subprocess.run([sys.executable, "-m", "datapipe", "index", str(tmp_path / "shard-000000.tar"),
                          "--index-dir", str(tmp_path / "afile")], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "is a file, not a directory" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_index_takes_a_folder(tmp_path):
    from tests.shards import write_shards

    urls, _ = write_shards(tmp_path / "shards", [2, 3], manifest=False)
    assert index_command([str(tmp_path / "shards")]) == 0
    assert all(os.path.exists(default_index_path(u)) for u in urls)


def test_indexing_a_file_that_is_no_tar_says_what_it_looks_like(tmp_path):
    from datapipe.errors import DataError
    from datapipe.tar.dali_index import write_dali_index

    import gzip

    jpeg = tmp_path / "0001.jpg"
    jpeg.write_bytes(b"\xff\xd8\xff\xe0" + bytes(2000))
    with pytest.raises(DataError, match="not a tar file: it starts like a JPEG image") as e:
        write_dali_index(str(jpeg))
    assert "checksum" not in str(e.value) and e.value.url == str(jpeg)
    cases = {"a.png": (b"\x89PNG\r\n\x1a\n" + bytes(2000), "it starts like a PNG image"),
             "s.tar.gz": (gzip.compress(bytes(4096)), "it starts like gzip-compressed data (DALI's reader and its index need "
                                                       "uncompressed tars)"),
             "d.jsonl": (b'{"text": "hi"}\n', "15 bytes, shorter than one tar header"),
             "t.txt": (b"hello world\n" * 100, "it starts like a text file")}
    for name, (data, words) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError) as e:
            write_dali_index(str(tmp_path / name))
        assert f"not a tar file: {words}" in str(e.value), (name, str(e.value))


def _gnu_sparse_tar(path, *, real_size=1 << 20):
    """A tar whose ``k001.bin`` is a GNU sparse member (typeflag 'S': 1024 bytes of data stored for a file of
    ``real_size`` bytes), between two regular samples. tarfile cannot write one: its header is patched."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for name, payload in [("k000.cls", b"0"), ("k001.bin", b"s" * 1024), ("k002.cls", b"2")]:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            t.addfile(info, io.BytesIO(payload))
    data = bytearray(buf.getvalue())
    at = next(m.offset for m in tarfile.open(fileobj=io.BytesIO(bytes(data))) if m.name == "k001.bin")
    header = bytearray(data[at:at + 512])
    header[156:157] = b"S"
    header[386:398] = b"%011o\0" % 0          # sparse map, entry 0: offset 0,
    header[398:410] = b"%011o\0" % 1024       # 1024 bytes
    header[482] = 0                           # no extension blocks
    header[483:495] = b"%011o\0" % real_size  # the file's real size
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    data[at:at + 512] = header
    with open(path, "wb") as f:
        f.write(data)
    assert [m.issparse() for m in tarfile.open(path)] == [False, True, False], "the crafted member reads as sparse"
    return str(path)


def test_index_refuses_a_gnu_sparse_member_by_name_as_shardstream_does(tmp_path, caplog):
    from datapipe import ShardStream

    tar = _gnu_sparse_tar(tmp_path / "shard-000000.tar")
    with pytest.raises(DataError, match=r"sparse tar members are not supported \(member 'k001\.bin'\)") as e:
        write_dali_index(tar)
    assert "shard-000000.tar" in str(e.value)
    assert not os.path.exists(default_index_path(tar))
    with pytest.raises(DataError, match=r"sparse tar members are not supported \(member 'k001\.bin'\)"):
        list(ShardStream(tar))  # the same words
    for extra in ([], ["--no-counts"]):
        with caplog.at_level(logging.ERROR):
            assert cli_main(["index", tar, *extra]) != 0
        assert "k001.bin" in caplog.text and not os.path.exists(default_index_path(tar))
        caplog.clear()


NON_REGULAR = {
    "symlink": (tarfile.SYMTYPE, "a symbolic link", {"linkname": "k000.jpg"}),
    "hardlink": (tarfile.LNKTYPE, "a hard link", {"linkname": "k000.jpg"}),
    "chardev": (tarfile.CHRTYPE, "a character device", {}),
    "blockdev": (tarfile.BLKTYPE, "a block device", {}),
    "fifo": (tarfile.FIFOTYPE, "a FIFO", {}),
    "dir_with_data": (tarfile.DIRTYPE, "a directory", {"size": 512, "payload": b"d" * 512}),
}


@pytest.mark.parametrize("kind", sorted(NON_REGULAR))
def test_index_refuses_non_regular_members_by_name(tmp_path, kind):
    info_type, words, extra = NON_REGULAR[kind]
    tar = str(tmp_path / "shard-000000.tar")
    with tarfile.open(tar, "w") as t:
        for name, payload in [("k000.jpg", b"j" * 10), ("k000.cls", b"0")]:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            t.addfile(info, io.BytesIO(payload))
        info = tarfile.TarInfo("k001.jpg")
        info.type, info.linkname, info.size = info_type, extra.get("linkname", ""), extra.get("size", 0)
        t.addfile(info, io.BytesIO(extra["payload"]) if "payload" in extra else None)
        info = tarfile.TarInfo("k001.cls")
        info.size = 1
        t.addfile(info, io.BytesIO(b"1"))
    with pytest.raises(DataError, match=f"member 'k001.jpg' is {words}, not a regular file") as e:
        write_dali_index(tar)
    assert "shard-000000.tar" in str(e.value)
    assert index_command([tar], counts=False) == 1 and not os.path.exists(default_index_path(tar))


def test_index_refuses_a_member_that_runs_past_the_end_of_the_shard(tmp_path):
    tar = _write_tar(tmp_path / "shard-000000.tar", _samples(3))
    data = open(tar, "rb").read()
    cut = tmp_path / "cut.tar"
    last = [m for m in tarfile.open(tar)][-1]
    cut.write_bytes(data[:last.offset_data + last.size // 2])
    with pytest.raises(DataError, match=f"member '{last.name}' of {last.size} bytes .* runs past the end") as e:
        write_dali_index(str(cut))
    assert "cut.tar" in str(e.value)


def test_first_incomplete_names_the_first_sample_without_a_wanted_entry(tmp_path):
    from datapipe.tar.dali_index import first_incomplete

    good = tmp_path / "a.idx"
    good.write_text("v1.2 2\ncls 512 1 a/0.cls jpg 1536 10 a/0.jpg\ncls 2048 1 a/1.cls png 3072 10 a/1.png\n")
    bad = tmp_path / "b.idx"
    bad.write_text("v1.2 3\ncls 512 1 b/0.cls jpg 1536 10 b/0.jpg\njpg 2048 10 b/1.jpg\ntxt 4096 3 b/2.txt\n")
    exts = ["jpg;png", "cls"]
    assert first_incomplete([str(good)], exts) is None
    assert first_incomplete([str(good), str(bad)], exts) == (1, "b/1", ["cls"])
    assert first_incomplete([str(tmp_path / "missing.idx"), str(bad)], ["txt"]) == (1, "b/0", ["txt"])
