"""Counting shards that have no manifest: 1,000 small shards over the test HTTP server.

Measures how long ``ShardStream(urls).counts`` takes (a) counted one shard at a time (one thread,
the baseline), (b) counted cold with the thread pool (ranged reads of the headers in parallel),
and (c) from the count cache that (b) left (every entry re-validated by its size and ETag /
modification time). The server (tests/servers.py) runs in this process on 127.0.0.1 and shares the
machine's cores with the client. Writes bench/results/count.json.

    python bench/count.py [--shards 1000] [--samples 10]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import table, write_result  # noqa: E402


def make_shards(directory: str, shards: int, samples: int) -> None:
    import webdataset

    for s in range(shards):
        with webdataset.TarWriter(os.path.join(directory, f"shard-{s:06d}.tar")) as w:
            for i in range(samples):
                w.write({"__key__": f"s{s:06d}-{i:04d}", "bin": os.urandom(1000), "cls": str(i % 10).encode()})


def timed_counts(urls: list[str], cache_dir: str, *, threads: int | None = None) -> tuple[float, int]:
    import datapipe.tar.counts as counts_module
    from datapipe import ShardStream

    saved_threads, saved_home = counts_module.THREADS, os.environ.get("HOME")
    os.environ["HOME"] = cache_dir  # the count cache of remote shards lives under ~/.cache
    if threads is not None:
        counts_module.THREADS = threads
    try:
        t0 = time.perf_counter()
        total = sum(ShardStream(urls).counts)
        return time.perf_counter() - t0, total
    finally:
        counts_module.THREADS = saved_threads
        if saved_home is not None:
            os.environ["HOME"] = saved_home


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=10, help="samples per shard (two members each)")
    parser.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = parser.parse_args(argv)
    from tests.servers import http_server

    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        os.makedirs(data)
        make_shards(data, args.shards, args.samples)
        with http_server(data) as (base, faults):
            urls = [f"{base}/shard-{s:06d}.tar" for s in range(args.shards)]
            rows = []
            serial_s, n = timed_counts(urls, os.path.join(tmp, "home-serial"), threads=1)
            rows.append({"mode": "cold, one thread (baseline)", "seconds": round(serial_s, 2), "samples": n})
            requests_before = faults.requests
            cold_s, n = timed_counts(urls, os.path.join(tmp, "home"))
            cold_requests = faults.requests - requests_before
            rows.append({"mode": "cold, thread pool", "seconds": round(cold_s, 2), "samples": n})
            requests_before = faults.requests
            cached_s, n = timed_counts(urls, os.path.join(tmp, "home"))
            rows.append({"mode": "cached (validated by HEAD)", "seconds": round(cached_s, 2), "samples": n})
            cached_requests = faults.requests - requests_before
    for r in rows:
        r["shards_per_s"] = round(args.shards / r["seconds"], 1)
    print(table(rows, ["mode", "seconds", "shards_per_s", "samples"]))
    path = write_result("count", {
        "shards": args.shards, "samples_per_shard": args.samples, "rows": rows,
        "http_requests": {"cold_thread_pool": cold_requests, "cached": cached_requests},
        "speedup_thread_pool_vs_serial": round(serial_s / cold_s, 2),
        "speedup_cached_vs_cold": round(cold_s / cached_s, 2),
        "note": "HTTP server in this process on 127.0.0.1, sharing the cores with the client",
    }, args.out)
    print(path)


if __name__ == "__main__":
    main()
