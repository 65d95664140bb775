import json
import os

import pytest

import datapipe.jobs.shard.commit as commit
from datapipe.jobs.shard.commit import existing_outputs, remove_outputs
from tests.datapipe.jobs.shard.test_job import run_shard, images  # noqa: F401 (fixture)


def test_commit_is_resumable(images, tmp_path, monkeypatch):
    """A crash in the middle of the final renames: the re-run completes with the same shards."""
    root, _ = images
    run_shard(root, str(tmp_path / "ref"), max_count=4, partition_size=6, workers=1, progress=False)
    real_move, calls = commit._move, []

    def flaky(fs, src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError("simulated crash")
        real_move(fs, src, dst)

    monkeypatch.setattr(commit, "_move", flaky)
    with pytest.raises(OSError):
        run_shard(root, str(tmp_path / "out"), max_count=4, partition_size=6, workers=1, progress=False)
    monkeypatch.setattr(commit, "_move", real_move)
    assert not os.path.exists(tmp_path / "out" / "manifest.json")
    report = run_shard(root, str(tmp_path / "out"), max_count=4, partition_size=6, workers=1, progress=False)
    assert report["resumed_partitions"] == report["partitions"]
    ref = json.load(open(tmp_path / "ref" / "manifest.json"))["shards"]
    assert json.load(open(tmp_path / "out" / "manifest.json"))["shards"] == ref




def test_existing_and_removed_outputs(tmp_path):
    out = tmp_path / "out"
    (out / ".datapipe-job" / "done").mkdir(parents=True)
    for name in ("shard-000000.tar", "shard-000000.idx", "shard-000001.tar", "manifest.json", "report.json",
                 "classes.json", "manifest.columns.npz", "notes.txt"):
        (out / name).write_text("x")
    found = [os.path.basename(p) for p in existing_outputs(str(out), "shard-%06d.tar", {})]
    assert found == ["manifest.json", "shard-000000.tar", "shard-000001.tar"]
    remove_outputs(str(out), "shard-%06d.tar", {})
    assert os.listdir(out) == ["notes.txt"]  # what the job did not write stays
    assert existing_outputs(str(tmp_path / "missing"), "shard-%06d.tar", {}) == []


def test_brace_pattern_and_full_shards():
    assert commit.brace_pattern("shard-%06d.tar", 5) == "shard-{000000..000004}.tar"
    assert commit.brace_pattern("p%d.tar", 12) == "p{0..11}.tar" and commit.brace_pattern("p%03d.tar", 1) == "p000.tar"
    assert commit.full({"count": 10, "bytes": 50}, max_count=10, max_bytes=1000)
    assert not commit.full({"count": 9, "bytes": 50}, max_count=10, max_bytes=1000)
    assert commit.full({"count": 9, "bytes": 950}, max_count=10, max_bytes=1000)  # one more mean sample passes it
    assert not commit.full({"count": 9, "bytes": 850}, max_count=10, max_bytes=1000)
