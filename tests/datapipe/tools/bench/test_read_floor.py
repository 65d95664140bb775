"""bench/peers.py --floor (datapipe.tools.bench.read_floor): every way read in its own process, each layer's cost
per sample."""
import json
import time

import pytest

from bench import peers
from datapipe.tools.bench import read_floor


@pytest.mark.slow
def test_quick_run_measures_every_way(tmp_path):
    out = peers.main(["--floor", "--quick", "--out", str(tmp_path), "--data", str(tmp_path / "data")])
    saved = json.loads((tmp_path / "read_floor.json").read_text())
    assert saved["summary"] == out["summary"] and saved["cpu_count"] >= 1 and saved["kernel"]
    assert not [r for r in saved["rows"] if "error" in r]
    assert {(s["way"], s["epoch"]) for s in saved["summary"]} == {(w, e) for w in read_floor.WAYS for e in (1, 2)}
    for s in saved["summary"]:
        assert s["samples_per_s"] > 0 and s["user_us"] >= 0 and s["sys_us"] >= 0 and s["faults"] >= 0
    for r in saved["rows"]:  # the main thread's share of the pass: at most all of it (timer grain aside)
        assert 0 <= r["main_thread_us"] and 0 <= r["main_busy"] <= 1.2
        # the first item comes within the pass, and some come after it
        assert 0 <= r["first_s"] <= r["samples"] / r["samples_per_s"] + 0.01
        assert r["after_first_per_s"] is None or r["after_first_per_s"] > 0
    assert {r["samples"] for r in saved["rows"]} == {600}  # every way reads every image once a pass
    for r in saved["rows"]:  # where each pass ran: a CPU of this machine and, where the kernel says, its node
        assert 0 <= r["cpu"] < (saved["cpu_count"] or 1) * 64 and (r["node"] is None or r["node"] >= 0)
    assert all(s["min_samples_per_s"] <= s["median_samples_per_s"] <= s["samples_per_s"] for s in saved["summary"])


def test_where_a_process_runs_is_read_from_the_kernel():
    where = read_floor._where()
    assert isinstance(where["cpu"], int) and where["cpu"] >= 0
    assert read_floor.numa_nodes() is None or read_floor.numa_nodes() >= 1


def test_unknown_way_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown ways mmap"):
        read_floor.run_floor(str(tmp_path), num_images=10, ways=("pread", "mmap"))


def test_the_cli_runs_the_ways_asked_and_refuses_unknown_ones(tmp_path, capsys):
    out = peers.main(["--floor", "--quick", "--ways", "stream,stream_pread", "--out", str(tmp_path),
                      "--data", str(tmp_path / "data")])
    assert {s["way"] for s in out["summary"]} == {"stream", "stream_pread"}
    with pytest.raises(SystemExit) as exit_:
        peers.main(["--floor", "--ways", "stream,mmap"])
    assert exit_.value.code == 2 and "unknown --ways mmap" in capsys.readouterr().err


@pytest.mark.parametrize("batches", [False, True])
def test_the_first_item_is_timed_apart_from_the_rest(batches):
    def items():  # a slow first item, then three fast ones
        for i in range(4):
            time.sleep(0.2 if i == 0 else 0.01)
            yield ([b"k"] * 10, [b"v"] * 10, [0] * 10) if batches else b"value"

    r = read_floor.timed(items(), batches=batches)
    per = 10 if batches else 1
    assert r["samples"] == 4 * per
    assert 0.19 <= r["first_s"] < 0.5
    assert 0 < r["after_first_per_s"] <= 3 * per / 0.03  # 3 items' samples after the first, each >= 10 ms
    assert r["after_first_per_s"] > r["samples_per_s"]  # the slow start left out


def test_a_pass_with_one_item_has_no_rate_after_it():
    r = read_floor.timed(iter([b"one"]))
    assert r["after_first_per_s"] is None and r["samples"] == 1
