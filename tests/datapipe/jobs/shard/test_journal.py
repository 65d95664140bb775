import fsspec

from datapipe.jobs.shard.journal import clean_partition, join_url, marker_url, part_pattern, read_json, write_json


def test_json_files_are_written_whole_and_read_back():
    url = "memory://journal-test/job/config.json"
    assert read_json(url, {}) is None
    write_json(url, {"config": {"seed": 3}, "complete": False}, {})
    assert read_json(url, {}) == {"config": {"seed": 3}, "complete": False}
    assert fsspec.filesystem("memory").ls("/journal-test/job", detail=False) == ["/journal-test/job/config.json"]


def test_layout_and_cleaning_a_partition(tmp_path):
    job = {"job_dir": join_url(str(tmp_path), ".datapipe-job/"), "storage_options": {}}
    assert marker_url(job, 7) == str(tmp_path / ".datapipe-job" / "done" / "p000007.json")
    assert part_pattern(job, 7) % 2 == str(tmp_path / ".datapipe-job" / "parts" / "part-000007-000002.tar")
    parts = tmp_path / ".datapipe-job" / "parts"
    parts.mkdir(parents=True)
    for name in ("part-000007-000000.tar", "part-000007-000001.tar.tmp-9", "part-000008-000000.tar"):
        (parts / name).write_bytes(b"x")
    clean_partition(job, 7)
    assert [p.name for p in parts.iterdir()] == ["part-000008-000000.tar"]
