"""Timed reads of shards (datapipe/tools/bench/storage_reads.py)."""
import os

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
