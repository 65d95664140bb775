"""bench/peers.py --quick: the CI smoke rows of every installed peer on tiny data (no timing asserted)."""
import json
import pathlib

import pytest

from datapipe.tools.bench import peers

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
INSTALLED = [s for s in peers.SYSTEMS if peers.version(s) is not None]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quick_run_measures_every_row_of_every_installed_system(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from bench import peers as script

    res = script.main(["--quick", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
                       "--systems", ",".join(INSTALLED)])
    assert list(res["systems"]) == INSTALLED and res["source"]["images"] == 24
    assert res["settings"]["workers"] == [0, 2] and res["settings"]["resume_workers"] == 2
    assert res["settings"]["decode_workers"] == 2
    for system, entry in res["systems"].items():
        assert "error" not in entry, (system, entry)
        assert entry["how"]["format"] and entry["how"]["0 workers"] and entry["how"]["2 workers"], entry["how"]
        rows = [entry["write"], entry["raw"]["0"], entry["raw"]["2"], entry["decode"]] + (
            [entry["resume"], entry["resume"]["saved"]] if system in peers.RESUMABLE else [])
        for row in rows:  # no installed peer's row failed (the H200 run's Grain worker rows did)
            assert "error" not in row, (system, row)
        for w in ("0", "2"):  # ... and no row reads 0 (the H200 run's Energon epoch 2 with workers did)
            raw = entry["raw"][w]
            assert raw["epoch1"]["samples"] == raw["epoch2"]["samples"] == 24, (system, w, raw)
            assert raw["epoch1"]["samples_per_s"] > 0 and raw["epoch2"]["samples_per_s"] > 0, (system, w, raw)
            assert raw["did"] == peers.describe(system, int(w))
        assert entry["decode"]["steady_samples"] > 0 and entry["decode"]["steady_samples_per_s"] > 0, (system, entry)
        if system in peers.RESUMABLE:
            assert entry["resume"]["resumed_samples"] > 0, (system, entry["resume"])
        if system in peers.RESUMABLE:
            assert entry["resume"]["same_order"] is True, (system, entry["resume"])
            assert entry["resume"]["exact"] is (None if system in peers.ENDLESS else True), (system, entry["resume"])
        else:
            assert entry["resume"] == {"error": "no mid-epoch resume"}
    saved = json.loads((tmp_path / "out" / "peers.json").read_text())
    assert saved["command"].startswith("python bench/peers.py --quick") and "partial" not in saved
    assert not list((tmp_path / "out").glob("*.partial.json"))


def test_the_peers_the_brief_names_are_all_there():
    assert set(peers.SYSTEMS) == {"torch", "webdataset", "datapipe", "litdata", "mosaicml", "spdl", "grain",
                                  "energon"}

