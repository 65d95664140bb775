"""loaders.images.index_files: DALI index files made once for shards without them, said when slow, pruned when
long unused."""
import logging
import os
import time

from datapipe import ShardWriter
from loaders.images import index_files


def _shards(directory, n=2):
    os.makedirs(directory, exist_ok=True)
    with ShardWriter(os.path.join(directory, "s-%03d.tar"), max_count=3) as w:
        for i in range(3 * n):
            w.write({"__key__": f"k{i}", "jpg": b"x" * 10, "cls": str(i)})
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".tar"))


def test_index_files_are_made_once_and_a_slow_making_is_logged(tmp_path, monkeypatch, caplog):
    paths = _shards(tmp_path)
    monkeypatch.setattr(index_files, "INDEX_NOTE_S", -1.0)  # every making counts as slow
    with caplog.at_level(logging.INFO, logger="loaders.images"):
        first = index_files.index_paths(paths, str(tmp_path / "idx"))
    assert [os.path.dirname(p) for p in first] == [str(tmp_path / "idx")] * 2 and all(map(os.path.exists, first))
    assert "made DALI index files for 2 shards" in caplog.text and "datapipe shard --index" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loaders.images"):
        assert index_files.index_paths(paths, str(tmp_path / "idx")) == first  # reused: none made, nothing said
    assert "made DALI index" not in caplog.text


def _age(path, days):
    t = time.time() - days * 86400
    os.utime(path, (t, t))


def test_a_making_prunes_files_long_unused_and_a_use_keeps_a_file(tmp_path):
    folder = tmp_path / "idx"
    old_paths = _shards(tmp_path / "old")
    old = index_files.index_paths(old_paths, str(folder))
    kept = index_files.index_paths(old_paths[:1], str(folder))  # the same file, used again
    assert kept == old[:1]
    for p in old:
        _age(p, index_files.UNUSED_DAYS + 1)
    stray = folder / "not-an-index.txt"
    stray.write_text("x")
    _age(stray, 30)
    assert index_files.index_paths(old_paths[:1], str(folder)) == old[:1]  # a use refreshes it; nothing made
    assert os.path.getmtime(old[0]) > time.time() - 60 and os.path.exists(old[1])
    new_paths = _shards(tmp_path / "new", n=1)
    new = index_files.index_paths(new_paths, str(folder))  # a making prunes what was left unused
    assert os.path.exists(new[0]) and os.path.exists(old[0]) and not os.path.exists(old[1])
    assert stray.exists()  # only index files are removed


def test_an_index_file_removed_under_a_reader_is_made_again(tmp_path):
    paths = _shards(tmp_path, n=1)
    first = index_files.index_paths(paths, str(tmp_path / "idx"))
    os.remove(first[0])
    assert index_files.index_paths(paths, str(tmp_path / "idx")) == first and os.path.exists(first[0])
