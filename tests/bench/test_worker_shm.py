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
