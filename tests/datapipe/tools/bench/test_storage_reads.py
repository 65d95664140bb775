"""Timed reads of shards (datapipe/tools/bench/storage_reads.py)."""
import contextlib
import functools
import http.server
import logging
import os
import threading

import pytest

from datapipe.tools.bench.storage_reads import Store, measure_reads, measure_stream


@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_one_pass_of_ranged_reads_reads_every_byte_once(shard_dir, mode):
    urls = sorted(os.path.join(shard_dir, f) for f in os.listdir(shard_dir) if f.endswith(".tar"))
    store = Store(urls)
    sizes = [store.size(u) for u in urls]
    r = measure_reads(store, sizes, block=5000, concurrency=2, seconds=600, mode=mode)
    assert r["bytes"] == sum(sizes) and r["files"] == len(urls)
    assert r["requests"] == sum(-(-s // 5000) for s in sizes)
    with pytest.raises(ValueError, match="mode"):
        measure_reads(store, sizes, block=5000, concurrency=1, seconds=1, mode="fibers")


def test_stream_counts_every_sample_and_shard(shard_dir):
    urls = sorted(os.path.join(shard_dir, f) for f in os.listdir(shard_dir) if f.endswith(".tar"))
    r = measure_stream(urls, seconds=600)
    assert r["samples"] == 110 and r["files"] == 3
    assert 0 < r["bytes"] <= sum(os.path.getsize(u) for u in urls)  # tar bytes parsed (end blocks need no read)
    assert r["latency_ms_is"] == "per sample" and r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]


@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_a_worker_that_starts_after_the_deadline_still_measures_a_read(shard_dir, mode):
    """A loaded machine can start a worker after the timed window closed: it reads once, never reports 0 MB/s."""
    urls = sorted(os.path.join(shard_dir, f) for f in os.listdir(shard_dir) if f.endswith(".tar"))
    store = Store(urls)
    sizes = [store.size(u) for u in urls]
    r = measure_reads(store, sizes, block=5000, concurrency=2, seconds=-10.0, mode=mode)  # closed before it opened
    assert 2 <= r["requests"] and 0 < r["bytes"] <= 2 * 5000


@contextlib.contextmanager
def _plain_http_server(folder):
    """``python -m http.server``'s handler: it ignores Range and sends whole files."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=folder)
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def _range_ignoring_store(shard_dir):
    """``(store, sizes)`` of the shards served by a server that ignores Range headers."""
    names = sorted(f for f in os.listdir(shard_dir) if f.endswith(".tar"))
    with _plain_http_server(shard_dir) as base:
        store = Store([f"{base}/{n}" for n in names])
        yield store, [store.size(u) for u in store.urls]


def test_a_server_that_ignores_range_is_named_and_not_counted_as_bytes_read(shard_dir, caplog):
    with _range_ignoring_store(shard_dir) as (store, sizes):
        with caplog.at_level(logging.WARNING, logger="datapipe.tools.bench.storage_reads"):
            r = measure_reads(store, sizes, block=5000, concurrency=1, seconds=600, mode="threads")
    assert r["bytes"] == sum(sizes)  # whole files came back for every 5000-byte read: not counted
    assert "ignored the Range header" in caplog.text


def test_a_server_that_ignores_range_is_named_once_per_store(shard_dir, caplog):
    """Issue #44: `datapipe bench storage` printed the warning 5 times (once per thread of each measurement)."""
    with _range_ignoring_store(shard_dir) as (store, sizes):
        with caplog.at_level(logging.WARNING, logger="datapipe.tools.bench.storage_reads"):
            for concurrency, mode in [(1, "threads"), (2, "threads"), (4, "threads"), (2, "processes")]:
                measure_reads(store, sizes, block=5000, concurrency=concurrency, seconds=600, mode=mode)
        assert caplog.text.count("ignored the Range header") == 1
        caplog.clear()
        fresh = Store(store.urls)  # told by a worker process only: said in the parent, once
        with caplog.at_level(logging.WARNING, logger="datapipe.tools.bench.storage_reads"):
            for _ in range(2):
                measure_reads(fresh, sizes, block=5000, concurrency=2, seconds=600, mode="processes")
        assert caplog.text.count("ignored the Range header") == 1
