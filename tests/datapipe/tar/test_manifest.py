"""manifest.json read as columns (a chunk of entries at a time), and its compact local copy."""
import json

import pytest

from datapipe import DataError
from datapipe.read.shards import fingerprint
from datapipe.storage.shard_list import ShardList
from datapipe.tar import manifest, manifest_cache
from datapipe.tar.manifest import make_manifest, read_columns, read_manifest, write_manifest


def _entries(n, *, sha=True):
    return [{"name": f"shard-{i:06d}.tar", "count": i % 5, "bytes": 100 + i,
             "sha256": (f"{i:064x}" if sha and i % 3 else "")} for i in range(n)]


def _same(columns, whole):
    shards = whole["shards"]
    names = ShardList("d", columns.names, columns.starts)
    assert list(names.iter_names()) == [s["name"] for s in shards]
    assert columns.counts == [s["count"] for s in shards]
    want = [s.get("sha256") or "" for s in shards]
    assert (columns.checksums is None and not any(want)) or list(columns.checksums[0:len(want)]) == want
    assert {k: v for k, v in columns.head.items() if k != "shards"} == {k: v for k, v in whole.items()
                                                                        if k != "shards"}


@pytest.mark.parametrize("chunk", [64, 1000, 4 << 20])
@pytest.mark.parametrize("layout", ["writer", "compact", "shards_first", "nested"])
def test_columns_match_the_whole_manifest_at_any_chunk_size(tmp_path, monkeypatch, chunk, layout):
    monkeypatch.setattr(manifest, "CHUNK", chunk)
    doc = make_manifest(_entries(300), source={"note": "}, ], {", "deep": {"a": [1, {"b": 2}]}})
    if layout == "shards_first":
        doc = {"shards": doc["shards"], **{k: v for k, v in doc.items() if k != "shards"}}
    if layout == "nested":  # entries holding objects and names holding the cut characters
        for i, s in enumerate(doc["shards"]):
            s["meta"] = {"keys": {"x": i}, "tags": ["}", "]"]}
            s["name"] = f"we}}ird, ]{i:04d}.tar"
    (tmp_path / "manifest.json").write_text(json.dumps(doc, indent=None if layout == "compact" else 1))
    columns, whole = read_columns(str(tmp_path)), read_manifest(str(tmp_path))
    assert len(columns.counts) == len(whole["shards"]) == 300
    _same(columns, whole)  # names, counts and every other key, asserted there


def test_an_empty_or_missing_manifest(tmp_path):
    assert read_columns(str(tmp_path)) is None
    write_manifest(str(tmp_path), make_manifest([]))
    assert read_columns(str(tmp_path)).counts == []


@pytest.mark.parametrize("text", ['{"shards": [{"name": "a.tar"}]}', '{"shards": [{"count": 1}]}', '[1, 2]',
                                  '{"shards": [{"name": "a.tar", "count": 1}', "not json"])
def test_a_broken_manifest_is_a_data_error_naming_it(tmp_path, text):
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(DataError, match="manifest .*manifest.json"):
        read_columns(str(tmp_path))


def test_a_large_manifest_is_read_from_its_copy_until_it_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_cache, "MIN_BYTES", 1)
    cache = str(tmp_path / "cache")
    (tmp_path / "d").mkdir()
    write_manifest(str(tmp_path / "d"), make_manifest(_entries(50)))
    first = read_columns(str(tmp_path / "d"), cache_dir=cache)
    parse = manifest._parse_columns
    monkeypatch.setattr(manifest, "_parse_columns", lambda f: pytest.fail("parsed although a copy is kept"))
    again = read_columns(str(tmp_path / "d"), cache_dir=cache)
    assert (again.names, again.counts, list(again.checksums[0:50])) == (first.names, first.counts,
                                                                        list(first.checksums[0:50]))
    monkeypatch.setattr(manifest, "_parse_columns", parse)
    changed = _entries(51)
    changed[0]["count"] = 99
    write_manifest(str(tmp_path / "d"), make_manifest(changed))
    assert read_columns(str(tmp_path / "d"), cache_dir=cache).counts[0] == 99


def test_a_copy_that_cannot_be_written_or_read_only_means_parsing(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_cache, "MIN_BYTES", 1)
    (tmp_path / "ro").write_text("a file, not a folder")
    (tmp_path / "d").mkdir()
    write_manifest(str(tmp_path / "d"), make_manifest(_entries(20)))
    assert read_columns(str(tmp_path / "d"), cache_dir=str(tmp_path / "ro")).counts[:3] == [0, 1, 2]
    cache = tmp_path / "c"
    read_columns(str(tmp_path / "d"), cache_dir=str(cache))
    for f in cache.iterdir():
        f.write_bytes(b"garbage")
    assert read_columns(str(tmp_path / "d"), cache_dir=str(cache)).counts[:3] == [0, 1, 2]


def test_a_shard_list_reads_like_the_list_of_its_urls():
    names = ["a.tar", "b\nc.tar", "d.tar"]  # a name may hold a newline
    urls = ShardList.of("s3://b/p", names, counts=[1, 2, 3])
    want = ["s3://b/p/a.tar", "s3://b/p/b\nc.tar", "s3://b/p/d.tar"]
    assert urls == want and list(urls) == want and urls[-1] == want[-1] and urls[1:] == want[1:]
    assert len(urls) == 3 and urls != want[:2] and urls != "s3://b/p/a.tar"
    with pytest.raises(IndexError):
        urls[3]


@pytest.mark.parametrize("sha", [True, False])
def test_a_shard_lists_fingerprint_is_the_lists(tmp_path, monkeypatch, sha):
    from datapipe import ShardStream

    monkeypatch.setattr(manifest_cache, "DEFAULT_DIR", str(tmp_path / "cache"))  # a large manifest: copied

    entries = _entries(70_000 if sha else 300, sha=sha)  # more than one block
    write_manifest(str(tmp_path), make_manifest(entries))
    columns = read_columns(str(tmp_path))
    urls = ShardList(str(tmp_path), columns.names, columns.starts, counts=columns.counts,
                     checksums=columns.checksums)
    want = fingerprint([str(tmp_path / e["name"]) for e in entries], [e["count"] for e in entries],
                       [e["sha256"] or None for e in entries])
    assert urls.fingerprint(columns.counts) == want
    assert want in ShardStream(str(tmp_path)).state_dict()["shards"]


def test_the_copy_keeps_the_fingerprint(tmp_path, monkeypatch):
    from datapipe import ShardStream
    from datapipe.storage.urls import shard_urls

    monkeypatch.setattr(manifest_cache, "MIN_BYTES", 1)
    monkeypatch.setattr(manifest_cache, "DEFAULT_DIR", str(tmp_path / "cache"))
    write_manifest(str(tmp_path), make_manifest(_entries(40)))
    want = ShardStream(str(tmp_path)).state_dict()["shards"]  # parsed, and copied
    urls = shard_urls(str(tmp_path))
    assert urls.known_fingerprint is not None and urls.known_fingerprint in want
    assert ShardStream(str(tmp_path)).state_dict()["shards"] == want
    assert ShardStream(f"{tmp_path}/shard-{{000000..000039}}.tar").state_dict()["shards"] == want  # its pattern


def test_only_the_most_recently_used_copies_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_cache, "MIN_BYTES", 1)
    monkeypatch.setattr(manifest_cache, "KEEP", 2)
    cache = str(tmp_path / "cache")
    for i in range(4):
        (tmp_path / f"d{i}").mkdir()
        write_manifest(str(tmp_path / f"d{i}"), make_manifest(_entries(5)))
    read_columns(str(tmp_path / "d0"), cache_dir=cache)
    read_columns(str(tmp_path / "d1"), cache_dir=cache)
    import os
    import time

    os.utime(next((tmp_path / "cache").iterdir()), (time.time() - 100, time.time() - 100))
    read_columns(str(tmp_path / "d0"), cache_dir=cache)  # a hit: d0's copy is the newest again
    read_columns(str(tmp_path / "d2"), cache_dir=cache)
    kept = {manifest_cache._path(str(tmp_path / f"d{i}" / "manifest.json"), cache) for i in range(4)}
    have = {str(p) for p in (tmp_path / "cache").iterdir()}
    assert have <= kept
    assert have == {manifest_cache._path(str(tmp_path / f"d{i}" / "manifest.json"), cache) for i in (0, 2)}


def test_urls_of_one_folder_are_counted_from_its_columns(tmp_path, monkeypatch):
    from datapipe import ShardStream
    from datapipe.tar.manifest import listed
    from tests.shards import write_shards

    urls, samples = write_shards(tmp_path / "s", [2, 3, 1, 4])
    monkeypatch.setattr("datapipe.read.shards.read_manifest", lambda *a, **k: pytest.fail("whole manifest read"))
    assert listed(urls)[0] == [2, 3, 1, 4] and listed(urls)[2] is None  # a small manifest: no copy
    assert listed([urls[3], urls[1]])[0] == [4, 3] and listed([urls[0], str(tmp_path / "s" / "x.tar")])[0] == [2, None]
    assert listed([urls[0], str(tmp_path / "other" / "y.tar")]) is None  # two folders: not this path
    pattern = f"{tmp_path}/s/shard-{{000003..000003}}.tar::{tmp_path}/s/shard-{{000000..000001}}.tar"
    stream = ShardStream(pattern)
    assert stream.counts == [4, 2, 3]
    assert [s["__key__"] for s in stream] == [s["__key__"] for s in samples[6:] + samples[:5]]
    assert fingerprint([urls[3], urls[0], urls[1]], [4, 2, 3]) in stream.state_dict()["shards"]


def test_a_large_manifests_first_read_takes_the_columns_written_beside_it(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_cache, "MIN_BYTES", 1)
    d = tmp_path / "d"
    d.mkdir()
    entries = _entries(60)
    write_manifest(str(d), make_manifest(entries, note="kept"))
    assert (d / manifest.SIDECAR_NAME).exists()
    whole = read_manifest(str(d))
    parse = manifest._parse_columns
    monkeypatch.setattr(manifest, "_parse_columns", lambda f: pytest.fail("parsed although its columns are beside it"))
    columns = read_columns(str(d), cache_dir=str(tmp_path / "fresh-cache"))  # no copy yet: a first open
    _same(columns, whole)
    want = fingerprint([str(d / e["name"]) for e in entries], [e["count"] for e in entries],
                       [e["sha256"] or None for e in entries])
    assert columns.fingerprint == want
    monkeypatch.setattr(manifest, "_parse_columns", parse)
    text = (d / "manifest.json").read_text()  # edited by hand, same size: the sidecar no longer matches
    (d / "manifest.json").write_text(text.replace('"count": 1,', '"count": 7,', 1))
    assert read_columns(str(d), cache_dir=str(tmp_path / "other-cache")).counts[1] == 7


def test_a_small_manifest_has_no_sidecar_and_drops_an_old_one(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_cache, "MIN_BYTES", 1)
    write_manifest(str(tmp_path), make_manifest(_entries(30)))
    assert (tmp_path / manifest.SIDECAR_NAME).exists()
    monkeypatch.setattr(manifest_cache, "MIN_BYTES", 1 << 30)
    write_manifest(str(tmp_path), make_manifest(_entries(5)))
    assert not (tmp_path / manifest.SIDECAR_NAME).exists()
    assert read_columns(str(tmp_path)).counts == [0, 1, 2, 3, 4]


def test_a_sidecar_that_is_garbage_only_means_parsing(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_cache, "MIN_BYTES", 1)
    write_manifest(str(tmp_path), make_manifest(_entries(30)))
    (tmp_path / manifest.SIDECAR_NAME).write_bytes(b"garbage")
    assert read_columns(str(tmp_path), cache_dir=str(tmp_path / "c")).counts[:3] == [0, 1, 2]


@pytest.mark.parametrize("names", [[f"shard-{i:06d}.tar" for i in range(40)], ["ä-0.tar", "b.tar", "ü/ß.tar"]])
def test_a_columns_file_reads_back_what_was_written(tmp_path, monkeypatch, names):
    monkeypatch.setattr(manifest_cache, "_WRITE_BLOCK", 7)  # the ASCII names written in many blocks
    entries = [{"name": n, "count": i, "bytes": 1, "sha256": f"{i:064x}"} for i, n in enumerate(names)]
    columns = manifest._columns_of(make_manifest(entries, note="ü"))
    with open(tmp_path / "c.npz", "wb") as f:
        assert manifest_cache.write_file(f, {"url": "ü"}, columns)
    with open(tmp_path / "c.npz", "rb") as f:
        meta, back = manifest_cache.read_file(f)
    assert meta["url"] == "ü" and back.head["note"] == "ü" and back.counts == columns.counts
    assert back.names == columns.names and list(back.starts) == list(columns.starts)
    assert list(back.checksums[0:len(names)]) == [e["sha256"] for e in sorted(entries, key=lambda e: e["name"])]
