"""bench/worker_shm.py: its CPU variants run and report a rate per case (the H200 run is on the device)."""
import json

from bench.worker_shm import Frames, main


def test_frames_are_copies_marked_with_their_index():
    ds = Frames(4, 8)
    a, la = ds[1]
    b, lb = ds[2]
    assert (la, lb) == (1, 2) and int(a.view(-1)[0]) == 1 and int(b.view(-1)[0]) == 2
    assert torch_equal_rest(a, b) and a.data_ptr() != b.data_ptr()


def torch_equal_rest(a, b):
    return bool((a.view(-1)[1:] == b.view(-1)[1:]).all())


def test_quick_run_reports_both_cpu_variants(tmp_path):
    result = main(["--quick", "--workers", "2", "--out", str(tmp_path)])
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"torch", "recycled"} and rows["torch"]["vs_torch"] == 1.0
    assert all(r["batches_per_s"] > 0 for r in rows.values())
    saved = json.loads((tmp_path / "worker_shm.json").read_text())
    assert saved["environment"]["cpu_count"] and saved["rows"] == result["rows"]


def test_raw_samples_are_shaped_like_a_shardstreams_and_split_over_workers():
    from bench.worker_shm import RawSamples

    ds = RawSamples(10, 3000)
    samples = list(ds)
    assert [s["__key__"] for s in samples] == [f"{i:08d}" for i in range(10)]
    assert all(type(s["jpg"]) is bytes and len(s["jpg"]) == 3000 - i % 997 for i, s in enumerate(samples))
    assert samples[1]["jpg"] == ds.blob[1:1 + 2999] and samples[3]["cls"] == b"3"


def test_quick_raw_run_reports_torch_and_ours_per_collate(tmp_path):
    result = main(["--quick", "--mode", "raw", "--workers", "2", "--out", str(tmp_path)])
    assert result["rows"] == []
    rows = {(r["collate"], r["variant"]): r for r in result["raw_rows"]}
    assert set(rows) == {(c, v) for c in ("list", "default", "tensors") for v in ("torch", "ours")}
    assert all(r["samples_per_s"] > 0 for r in rows.values()) and rows[("list", "torch")]["vs_torch"] == 1.0
    assert all(r["main_cpu_us_per_sample"] > 0 for r in rows.values())  # the main process's share of the work
