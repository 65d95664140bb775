"""Reader throughput in one process: raw sequential read vs webdataset.WebDataset vs ShardStream.

Local shards of ImageNet-like samples (a ~110 KB JPEG-sized payload + a class label), read from
the page cache (each pass is preceded by a warm-up read). Writes bench/results/read_throughput.json.

    python bench/read_throughput.py [--samples 20000] [--data DIR]
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.common import table, write_result  # noqa: E402


def make_shards(directory: str, samples: int, *, mean_kb: float = 110.0, per_shard: int = 1000, seed: int = 0):
    """Shards whose payload sizes follow ImageNet's JPEG sizes (log-normal, mean ~110 KB)."""
    from datapipe import ShardWriter

    urls = sorted(glob.glob(os.path.join(directory, "shard-*.tar")))
    if urls and os.path.exists(os.path.join(directory, "manifest.json")):
        return urls
    rng = np.random.default_rng(seed)
    sigma = 0.5
    sizes = rng.lognormal(np.log(mean_kb * 1024) - sigma**2 / 2, sigma, samples).astype(int).clip(2000, 2_000_000)
    pool = rng.integers(0, 256, int(sizes.max()) + 4096, dtype=np.uint8).tobytes()
    with ShardWriter(os.path.join(directory, "shard-%06d.tar"), max_count=per_shard) as writer:
        for i, size in enumerate(sizes):
            off = int(rng.integers(0, 4096))
            writer.write({"__key__": f"{i:08d}", "jpg": pool[off:off + size], "cls": str(i % 1000).encode()})
    return sorted(glob.glob(os.path.join(directory, "shard-*.tar")))


def raw_read(urls, block=8 << 20):
    total = 0
    start = time.perf_counter()
    for url in urls:
        with open(url, "rb", buffering=0) as f:
            while True:
                chunk = f.read(block)
                if not chunk:
                    break
                total += len(chunk)
    return total, time.perf_counter() - start


def timed(iterable):
    n = nbytes = 0
    start = time.perf_counter()
    for sample in iterable:
        n += 1
        nbytes += len(sample["jpg"])
    return n, nbytes, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--data", default="/tmp/datapipe-bench-read")
    parser.add_argument("--repeats", type=int, default=3, help="passes per reader; the best is reported")
    parser.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = parser.parse_args(argv)

    import webdataset

    from datapipe import ShardStream

    os.makedirs(args.data, exist_ok=True)
    urls = make_shards(args.data, args.samples)
    total_bytes, _ = raw_read(urls)  # warm the page cache
    rows = []

    best = min(raw_read(urls)[1] for _ in range(args.repeats))
    raw_gbs = total_bytes / best / 1e9
    rows.append({"reader": "raw sequential read", "samples/s": "", "GB/s": f"{raw_gbs:.2f}", "vs raw": "100%"})

    def run(name, make):
        results = [timed(make()) for _ in range(args.repeats)]
        n, nbytes, secs = min(results, key=lambda r: r[2])
        gbs = total_bytes / secs / 1e9
        rows.append({"reader": name, "samples/s": f"{n / secs:,.0f}", "GB/s": f"{gbs:.2f}",
                     "vs raw": f"{gbs / raw_gbs:.0%}", "_sps": n / secs, "_n": n})

    run("webdataset.WebDataset", lambda: webdataset.WebDataset(urls, shardshuffle=False))
    run("datapipe.ShardStream", lambda: ShardStream(urls))
    run("datapipe.ShardStream (zero_copy)", lambda: ShardStream(urls, zero_copy=True))
    run("datapipe.ShardStream (shuffle, buffer 1000)",
        lambda: ShardStream(urls, shuffle=True, shuffle_buffer=1000))
    wds_sps = rows[1]["_sps"]
    for row in rows[1:]:
        row["vs webdataset"] = f"{row['_sps'] / wds_sps:.1f}x"
    result = {
        "samples": args.samples, "bytes": total_bytes, "shards": len(urls),
        "mean_sample_kb": total_bytes / args.samples / 1024,
        "raw_read_gb_per_s": raw_gbs,
        "readers": [{k.lstrip("_"): v for k, v in r.items()} for r in rows],
        "targets": {"vs_webdataset": ">= 10x", "vs_raw": ">= 25%"},
    }
    path = write_result("read_throughput", result, args.out)
    print(table(rows, ["reader", "samples/s", "GB/s", "vs raw", "vs webdataset"]))
    print(f"\nwrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
