import json

import pytest

from datapipe.jobs.shard.readers import iter_partition
from datapipe.jobs.shard.sources import open_source


def test_shuffled_text_is_a_seeded_permutation(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": str(i)}) + "\n" for i in range(50)))

    def order(seed, shuffle=True):
        src = open_source(str(path), kind="text", shuffle=shuffle, seed=seed, partition_bytes=100)
        return [r.sample["txt"] for p in src.partitions for r in iter_partition(p, shuffle_buffer=8)]

    plain = order(0, shuffle=False)
    a, b, c = order(1), order(1), order(2)
    assert a == b != c and sorted(a, key=int) == plain == [str(i) for i in range(50)] and a != plain


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        open_source(".", kind="video")
    with pytest.raises(ValueError, match="does not exist"):
        open_source("/no/such/dir", kind="images")


def test_ignored_files_and_missing_inputs(tmp_path):
    (tmp_path / "tars").mkdir()
    (tmp_path / "tars" / "s-0.tar").write_bytes(bytes(1024))
    for name in ("notes.txt", "manifest.json", "manifest.columns.npz", "s-0.idx"):
        (tmp_path / "tars" / name).write_text("x")
    src = open_source(str(tmp_path / "tars"))
    assert src.kind == "tar" and src.ignored == ["notes.txt"]  # companions of shards are not reported
    with pytest.raises(ValueError, match="does not exist"):
        open_source(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no file matches"):
        open_source(str(tmp_path / "tars" / "x-{0..3}.tar"))
    assert len(open_source(str(tmp_path / "tars" / "s-{0..3}.tar")).partitions) == 4  # some exist: the rest are skipped
