"""bench/scale.py --quick: every step runs in its own process and the result names them all."""
import json
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def test_scale_quick_writes_every_step(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "scale.py"), "--quick", "--root", str(tmp_path / "data"),
                          "--out", str(tmp_path / "results")], capture_output=True, text=True, timeout=600,
                         cwd=BENCH.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "results" / "scale.json").read_text())
    assert [r["shards"] for r in result["rows"]] == [100, 1000]
    for row in result["rows"]:
        for key in ("expand_expand_s", "cold_total_s", "stream_total_s", "pattern_total_s", "stream_peak_rss_mb",
                    "resume_resume_extra_s", "loader_first_batch_s"):
            assert isinstance(row[key], (int, float)), key
    assert "1000/100" in result["growth"] and result["environment"]["cpu_count"]
