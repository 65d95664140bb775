"""bench/row_stats.py: ceiling rows pooled by variant, with a confidence interval of the mean."""
import math

import pytest

from bench.row_stats import difference, known_variants, main, pool, summary, variant_key


def test_a_repeat_mark_goes_and_suffixes_stay():
    known = known_variants()
    assert variant_key("imageloader2", known) == "imageloader"
    assert variant_key("imageloader2_nommap", known) == "imageloader_nommap"
    assert variant_key("imageloader_legacy_sync10", known) == "imageloader_legacy_sync10"
    assert variant_key("il_hw075c", known) == "il_hw075"
    assert variant_key("il_hw09", known) == "il_hw09"  # a variant of its own, not il_hw0 repeated
    assert variant_key("dl_ours2", known) == "dl_ours"


def test_summary_gives_the_t_interval_of_the_mean():
    s = summary([0.97, 0.98, 0.99])
    assert s["n"] == 3 and s["mean"] == pytest.approx(0.98) and s["sd"] == pytest.approx(0.01)
    assert s["ci95"] == pytest.approx(4.303 * 0.01 / math.sqrt(3), abs=1e-4)
    one = summary([0.5])
    assert one["sd"] is None and one["ci95"] is None


def test_pool_gathers_rows_of_a_variant_across_files_and_skips_other_entries():
    files = [{"imageloader": {"ceiling_ratio": 0.97}, "imageloader2": {"ceiling_ratio": 0.99},
              "ceiling_history": [1, 2], "standalone": {"imageloader": {"rate": 1.0}}},
             {"imageloader": {"ceiling_ratio": 0.98}, "dali_hand": {"ceiling_ratio": 0.96}}]
    pooled = pool(files)
    assert pooled["imageloader"]["n"] == 3 and pooled["imageloader"]["mean"] == pytest.approx(0.98)
    assert set(pooled) == {"imageloader", "dali_hand"}
    assert set(pool(files, only={"dali_hand"})) == {"dali_hand"}


def test_difference_is_welchs_interval_and_says_whether_it_clears_zero():
    base, better = [0.976, 0.978, 0.980, 0.977], [0.984, 0.986, 0.985, 0.987]
    d = difference(base, better)
    assert d["diff"] == pytest.approx(0.00775, abs=1e-4) and d["clears"] and not d["below"]
    assert 0 < d["ci95"] < d["diff"] and 3 <= d["df"] <= 6
    overlap = difference(base, [0.975, 0.985, 0.979, 0.981])
    assert not overlap["clears"] and not overlap["below"] and overlap["ci95"] > abs(overlap["diff"])
    assert difference(better, base)["below"]
    assert difference([0.9], base)["diff"] is None  # one row: no interval


def test_main_compares_every_variant_against_one(tmp_path):
    import json

    path = tmp_path / "ceiling.json"
    path.write_text(json.dumps({"results": {
        "imageloader": {"ceiling_ratio": 0.976}, "imageloader2": {"ceiling_ratio": 0.978},
        "imageloader3": {"ceiling_ratio": 0.977}, "il_auto": {"ceiling_ratio": 0.985},
        "il_autob": {"ceiling_ratio": 0.986}, "il_autoc": {"ceiling_ratio": 0.984}}}))
    pooled = main([str(path), "--against", "imageloader"])
    assert pooled["il_auto"]["vs"]["imageloader"]["clears"] and "vs" not in pooled["imageloader"]
    with pytest.raises(SystemExit):
        main([str(path), "--against", "dali_hand"])


def test_a_files_variants_can_be_renamed_before_pooling(tmp_path):
    import json

    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": {"imageloader": {"ceiling_ratio": 0.97},
                                           "imageloader_hostready": {"ceiling_ratio": 0.99}}}))
    new = tmp_path / "new.json"  # made after the default changed: its plain rows are the host ones
    new.write_text(json.dumps({"results": {"imageloader": {"ceiling_ratio": 0.98},
                                           "imageloader_eventready": {"ceiling_ratio": 0.96}}}))
    spec = f"{new}::imageloader=imageloader_hostready,imageloader_eventready=imageloader"
    pooled = main([str(old), spec])
    assert pooled["imageloader_hostready"]["n"] == 2 and pooled["imageloader_hostready"]["mean"] == pytest.approx(0.985)
    assert pooled["imageloader"]["n"] == 2 and pooled["imageloader"]["mean"] == pytest.approx(0.965)
    assert "imageloader_eventready" not in pooled
    with pytest.raises(SystemExit):
        main([f"{new}::imageloader"])
