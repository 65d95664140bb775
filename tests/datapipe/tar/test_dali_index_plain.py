"""datapipe.tar.dali_index from plain headers alone: the same index as the tar walk gives, made without reading
the data, or None (then the walk makes it)."""
import io
import os
import random
import tarfile

import pytest

from datapipe import ShardWriter
from datapipe.errors import DataError
from datapipe.tar import dali_index
from datapipe.tar.dali_index import index_lines, plain_index_lines, write_dali_index


def _write(directory, samples):
    with ShardWriter(os.path.join(directory, "s-%03d.tar")) as w:
        for s in samples:
            w.write(s)
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".tar"))


def _tar(path, members, **kw):
    with tarfile.open(path, "w", **kw) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def _walked(path):
    with open(path, "rb") as f:
        return index_lines(io.BytesIO(f.read()), size=os.path.getsize(path))


def _plain(n, seed=0):
    rnd = random.Random(seed)
    return [{"__key__": f"k{i:05d}", "jpg": rnd.randbytes(rnd.randrange(0, 3000)), "cls": str(i % 7),
             "Meta.JSON": b"{}"} for i in range(n)]


def test_a_shardwriter_shard_is_indexed_from_its_headers_as_the_walk_indexes_it(tmp_path):
    (path,) = _write(tmp_path, _plain(50) + [{"__key__": "dir.v2/a", "jpg": b"1"}, {"__key__": "e", "bin": b""}])
    lines = plain_index_lines(path)
    assert lines is not None and lines == _walked(path)
    assert lines[0] == "v1.2 52" and "k00000.Meta.JSON" in lines[1]  # the names as written, extension case kept


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tars_other_writers_made_are_indexed_from_their_headers_too(tmp_path, fmt):
    members = [("a.jpg", b"12"), ("a.cls", b"1"), ("__meta__", b"m"), (".hidden", b"h"), ("d/.x", b""),
               ("b.jpg", b"3" * 700), ("b.txt", b"")]
    path = _tar(tmp_path / "t.tar", members, format=fmt)
    assert plain_index_lines(path) == _walked(path) == ["v1.2 2", "jpg 512 2 a.jpg cls 1536 1 a.cls",
                                                         "jpg 5120 700 b.jpg txt 6656 0 b.txt"]


def test_a_header_that_is_not_plain_leaves_it_to_the_walk(tmp_path):
    (path,) = _write(tmp_path, _plain(3) + [{"__key__": "x" * 150, "txt": "long name"}])  # an extension header
    assert plain_index_lines(path) is None
    assert open(write_dali_index(path, str(tmp_path / "a.idx"))).read().splitlines() == _walked(path)
    with tarfile.open(tmp_path / "dir.tar", "w") as tar:  # a directory entry
        tar.add(tmp_path, arcname="d", recursive=False)
    assert plain_index_lines(str(tmp_path / "dir.tar")) is None


def test_write_dali_index_reads_no_data_where_the_headers_serve(tmp_path, monkeypatch):
    (path,) = _write(tmp_path, _plain(20))
    monkeypatch.setattr(dali_index, "index_lines", lambda *a, **k: (_ for _ in ()).throw(AssertionError("walked")))
    out = write_dali_index(path, str(tmp_path / "t.idx"))
    assert open(out).read().splitlines() == plain_index_lines(path)


def test_a_value_whose_name_the_walk_takes_for_a_hidden_file_is_skipped_as_the_walk_skips_it(tmp_path, monkeypatch):
    # an extension with slashes: "a./q/.r" has a last part starting with a dot, which the walk (and DALI's wds2idx)
    # skips as a hidden file. ShardWriter now refuses such an extension; a shard an earlier version wrote may hold one.
    from datapipe.tar import writer

    monkeypatch.setattr(writer, "_check_extension", lambda key, ext: None)
    (path,) = _write(tmp_path, [{"__key__": "a", "/q/.r": b"1"}, {"__key__": "b", "jpg": b"2"}])
    assert plain_index_lines(path) == _walked(path) == ["v1.2 1", "jpg 1536 1 b.jpg"]


def test_a_damaged_header_is_left_to_the_walk_which_says_where(tmp_path):
    (path,) = _write(tmp_path, [{"__key__": "a", "jpg": b"1"}, {"__key__": "__m__/a", "jpg": b"2"},
                                {"__key__": "b", "jpg": b"3"}])
    data = bytearray(open(path, "rb").read())
    data[data.find(b"__m__/a.jpg") + 2] ^= 0x40
    open(path, "wb").write(bytes(data))
    assert plain_index_lines(path) is None
    with pytest.raises(ValueError, match="cannot be read past byte 1024"):  # the walk no longer stops silently
        _walked(path)


def test_a_damaged_header_in_the_middle_is_an_error_not_a_shorter_index(tmp_path):
    raw = bytearray(open(_tar(tmp_path / "t.tar", [(n, b"x" * 700) for n in ("a.jpg", "b.jpg", "c.jpg")]),
                         "rb").read())
    assert len(index_lines(io.BytesIO(bytes(raw)), size=len(raw))) == 4  # sound: the header line and 3 samples
    raw[1536 + 5] ^= 0xFF  # b.jpg's header (a.jpg: header at 0, data 512..1536)
    with pytest.raises(ValueError, match="cannot be read past byte 1536.*1 sample before it"):
        index_lines(io.BytesIO(bytes(raw)), size=len(raw))
    path = tmp_path / "damaged.tar"
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="cannot index shard: the tar cannot be read past byte 1536"):
        write_dali_index(str(path), str(tmp_path / "d.idx"))


def test_a_shard_cut_inside_a_value_is_left_to_the_walk_which_says_so(tmp_path):
    path = _tar(tmp_path / "t.tar", [("a.jpg", b"1"), ("b.jpg", b"x" * 5000)])
    with open(path, "r+b") as f:
        f.truncate(1024 + 512 + 1000)
    assert plain_index_lines(path) is None
    with pytest.raises(DataError, match="truncated"):
        write_dali_index(path, str(tmp_path / "c.idx"))


def test_webdatasets_pax_timestamps_pass_and_any_other_pax_record_leaves_it_to_the_walk(tmp_path):
    import webdataset

    path = str(tmp_path / "w.tar")
    with webdataset.TarWriter(path) as w:  # a pax header with 'mtime' before every member
        for s in _plain(30):
            w.write(s)
    assert open(path, "rb").read(512)[156:157] == b"x"
    lines = plain_index_lines(path)
    assert lines is not None and lines == _walked(path) and lines[0] == "v1.2 30"
    named = _tar(tmp_path / "p.tar", [("a.jpg", b"1"), ("é.jpg", b"2")], format=tarfile.PAX_FORMAT)  # pax 'path'
    assert plain_index_lines(named) is None and _walked(named)[0] == "v1.2 2"


@pytest.mark.parametrize("cut", [100, 511, 512, 600])
def test_a_tail_the_walk_would_not_take_as_the_end_leaves_it_to_the_walk(tmp_path, cut):
    import webdataset

    path = str(tmp_path / "w.tar")
    with webdataset.TarWriter(path) as w:
        for s in _plain(3):
            w.write(s)
    raw = open(path, "rb").read()
    end = raw.rstrip(b"\0")
    end += bytes(-len(end) % 512)  # the members, without the end-of-archive blocks
    with open(path, "wb") as f:  # then a pax header (or part of one) with no member after it
        f.write(end + raw[:cut])
    try:
        walked = _walked(path)
    except (ValueError, tarfile.TarError):
        walked = None
    assert plain_index_lines(path) in (None, walked)
    assert plain_index_lines(path) is None or walked is not None
