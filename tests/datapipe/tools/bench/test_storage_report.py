"""The storage advice of datapipe bench storage (datapipe/tools/bench/storage_report.py)."""
from datapipe.tools.bench.storage_report import recommend


def _sweep_result(rates, *, shards=16, storage="s3", nbytes=2 << 30, cold_seconds=None):
    """A run_storage-shaped result with the given {(concurrency, block): MB/s}."""
    sweep = [{"mode": "threads", "concurrency": c, "block_size": b, "cache": "remote", "mb_per_s": v,
              "seconds": 2.0} for (c, b), v in rates.items()]
    sequential = {"remote": {"mb_per_s": 50.0, "seconds": 2.0}}
    if cold_seconds is not None:
        sequential = {"cold": {"mb_per_s": 50.0, "seconds": cold_seconds}}
    return {"sweep": sweep, "sequential": sequential, "stream": {"copy": {"mb_per_s": 40.0}}, "shards": shards,
            "storage": storage, "bytes": nbytes, "page_cache": {"cold_possible": cold_seconds is not None}}


def _named_options(text):
    import re

    return set(re.findall(r"\b([a-z_]+)=", text))


def test_storage_advice_names_loader_options_that_exist():
    import inspect

    from datapipe import ShardStream
    from loaders import DataLoader

    res = _sweep_result({(1, 1 << 20): 100.0, (4, 1 << 20): 380.0, (8, 1 << 20): 390.0})
    rec = recommend(res)
    assert rec["concurrency"] == 8 and rec["num_workers"] == 8
    assert "num_workers=8" in rec["text"] and "concurrency" not in rec["text"]
    known = set(inspect.signature(DataLoader).parameters) | set(inspect.signature(ShardStream).parameters)
    assert _named_options(rec["text"]) <= known, rec["text"]
    assert rec["warning"] is None


def test_storage_advice_when_parallel_reads_do_not_help_and_when_shards_are_too_few():
    flat = recommend(_sweep_result({(1, 1 << 20): 100.0, (4, 1 << 20): 105.0}))
    assert flat["num_workers"] is None and "one reader already gets 100 MB/s" in flat["text"]
    few = recommend(_sweep_result({(1, 1 << 20): 100.0, (8, 1 << 20): 600.0}, shards=3))
    assert "with 3 shards at most 3 readers are busy" in few["text"]


def test_storage_advice_reports_a_better_block_size_as_a_fact_not_a_setting():
    from datapipe.storage.files import REMOTE_BLOCK

    rec = recommend(_sweep_result({(1, REMOTE_BLOCK): 100.0, (1, 4 * REMOTE_BLOCK): 200.0}))
    assert "(fixed)" in rec["text"] and "2.0x faster" in rec["text"]
    local = recommend(_sweep_result({(1, REMOTE_BLOCK): 100.0, (1, 4 * REMOTE_BLOCK): 200.0}, storage="local"))
    assert "fixed" not in local["text"]  # local shards are mapped or read whole: no request size to speak of


def test_storage_warns_when_the_data_set_is_too_small():
    small = recommend(_sweep_result({(1, 1 << 20): 100.0}, nbytes=53_000_000))["warning"]
    assert "the data set is 53.0 MB" in small and "at least 256 MB" in small
    blink = recommend(_sweep_result({(1, 1 << 20): 100.0}, cold_seconds=0.05))["warning"]
    assert "cold pass over it took 50 ms" in blink


def _with_stream(copy, zero_copy):
    res = _sweep_result({(1, 1 << 20): 100.0}, storage="local")
    res["stream"] = {"copy": {"mb_per_s": copy}, "zero_copy": {"mb_per_s": zero_copy}}
    return recommend(res)["text"]


def test_zero_copy_is_advised_only_where_this_run_measured_it_faster():
    """Issue #44: zero_copy read 992-1013 MB/s against 1248-1508 MB/s for the copy, yet was advised."""
    for copy, zc in ((1248.0, 1013.0), (1508.0, 992.0), (1000.0, 1050.0)):  # slower, or within noise
        text = _with_stream(copy, zc)
        assert "StorageOptions(zero_copy=True)" not in text, text
        assert f"parses {copy:.0f} MB/s" in text and "as fast or faster here" in text
    faster = _with_stream(1000.0, 1500.0)
    assert "parses 1500 MB/s in one process with storage=StorageOptions(zero_copy=True)" in faster
    assert "1.50x the copy's 1000 MB/s" in faster
