"""loaders.images.dali_reader.index_paths: DALI index files made once for shards without them, and said when slow."""
import logging
import os

from datapipe import ShardWriter
from loaders.images import dali_reader


def _shards(directory, n=2):
    with ShardWriter(os.path.join(directory, "s-%03d.tar"), max_count=3) as w:
        for i in range(3 * n):
            w.write({"__key__": f"k{i}", "jpg": b"x" * 10, "cls": str(i)})
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".tar"))


def test_index_files_are_made_once_and_a_slow_making_is_logged(tmp_path, monkeypatch, caplog):
    paths = _shards(tmp_path)
    monkeypatch.setattr(dali_reader, "INDEX_NOTE_S", -1.0)  # every making counts as slow
    with caplog.at_level(logging.INFO, logger="loaders.images"):
        first = dali_reader.index_paths(paths, str(tmp_path / "idx"))
    assert [os.path.dirname(p) for p in first] == [str(tmp_path / "idx")] * 2 and all(map(os.path.exists, first))
    assert "made DALI index files for 2 shards" in caplog.text and "datapipe shard --index" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loaders.images"):
        assert dali_reader.index_paths(paths, str(tmp_path / "idx")) == first  # reused: none made, nothing said
    assert "made DALI index" not in caplog.text
