"""Storage throughput: local files vs an HTTP server vs an S3-compatible server (moto), through fsspec.

The script writes ImageNet-like shards (random payloads of ~110 KB per sample), serves them from
an HTTP server (tests/servers.py) and from moto's S3 server, both on 127.0.0.1 in this process, and
runs ``datapipe.tools.bench.storage.run_storage`` on each: a sequential read, ShardStream parsing and a
concurrency x block-size sweep of ranged reads. Local files are read cold (page cache dropped with
posix_fadvise and verified) where possible. The servers share this machine's cores with the
client, so remote figures are a client + server CPU cost on loopback, not a network measurement.
Writes bench/results/storage.json and storage.png.

    python bench/storage.py [--mb 128] [--seconds 2] [--concurrency 1,2,4,8] [--block-size 1M,4M,16M]
    python bench/storage.py --quick
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import table, write_result  # noqa: E402

KEY, SECRET = "AKIAEXAMPLEKEY123456", "bench-secret-key-0000000000000000000000"


def make_shards(directory: str, samples: int, *, mean_kb: float = 110.0, per_shard: int = 1000, seed: int = 0):
    """Shards whose payload sizes follow ImageNet's JPEG sizes (log-normal, mean ~110 KB)."""
    import numpy as np

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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=128, help="size of the shard set in MB (default 128)")
    parser.add_argument("--seconds", type=float, default=2.0, help="cap per measurement")
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--block-size", default="1M,4M,16M")
    parser.add_argument("--storages", default="local,http,s3")
    parser.add_argument("--processes", action="store_true", help="also sweep with processes")
    parser.add_argument("--data", default=None, help="shard directory (default: a temporary one)")
    parser.add_argument("--out", default=None, help="results directory (default bench/results)")
    parser.add_argument("--quick", action="store_true", help="16 MB, 0.5 s per measurement, short sweep")
    args = parser.parse_args(argv)
    if args.quick:
        args.mb, args.seconds, args.concurrency, args.block_size = 16, 0.5, "1,4", "1M,4M"

    from datapipe.tools import plots
    from datapipe.units import format_size, parse_size
    from datapipe.tools.bench.storage import parse_list, run_storage
    from tests.servers import http_server, s3_server

    concurrency = parse_list(args.concurrency)
    blocks = parse_list(args.block_size, parse_size)
    storages = parse_list(args.storages, str)
    tmp = None
    data = args.data
    if data is None:
        tmp = tempfile.TemporaryDirectory(prefix="datapipe-bench-storage-")
        data = tmp.name
    samples = max(100, args.mb * 1_000_000 // 110_000)
    make_shards(data, samples, per_shard=100)
    names = sorted(f for f in os.listdir(data) if f.endswith(".tar"))
    spec_tail = f"shard-{{000000..{len(names) - 1:06d}}}.tar"
    common = dict(concurrency=concurrency, block_sizes=blocks, seconds=args.seconds, processes=args.processes)
    results = {}
    if "local" in storages:
        print("== local", file=sys.stderr)
        results["local"] = run_storage([data], **common)
    if "http" in storages:
        print("== http (127.0.0.1, tests/servers.py)", file=sys.stderr)
        with http_server(data) as (base, _):
            results["http"] = run_storage([f"{base}/{spec_tail}"], **common)
    if "s3" in storages:
        import logging

        import boto3

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request log lines
        print("== s3 (moto server on 127.0.0.1)", file=sys.stderr)
        with s3_server() as endpoint:
            client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                                  region_name="us-east-1")
            client.create_bucket(Bucket="bench")
            for name in names + ["manifest.json"]:
                client.upload_file(os.path.join(data, name), "bench", f"data/{name}")
            options = {"key": KEY, "secret": SECRET,
                       "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
            results["s3"] = run_storage([f"s3://bench/data/{spec_tail}"], storage_options=options, **common)
    rows = []
    for name, r in results.items():
        seq = next(iter(r["sequential"].values()))
        best = r["recommendation"]
        stream = r["stream"].get("copy", {})
        for state, s in r["sequential"].items():
            rows.append({"storage": name, "measurement": f"sequential ({state})", "MB/s": f"{s['mb_per_s']:.0f}",
                         "p50 ms": f"{s['latency_ms']['p50']:.2f}", "p99 ms": f"{s['latency_ms']['p99']:.2f}"})
        rows.append({"storage": name, "measurement": "ShardStream", "MB/s": f"{stream.get('mb_per_s', 0):.0f}",
                     "samples/s": f"{stream.get('samples_per_s', 0):.0f}"})
        b = max(r["sweep"], key=lambda x: x["mb_per_s"])
        rows.append({"storage": name, "measurement": f"best sweep: x{b['concurrency']} {format_size(b['block_size'])} "
                                                     f"({b['cache']})",
                     "MB/s": f"{b['mb_per_s']:.0f}", "p50 ms": f"{b['latency_ms']['p50']:.2f}",
                     "p99 ms": f"{b['latency_ms']['p99']:.2f}",
                     "vs sequential": f"{b['mb_per_s'] / seq['mb_per_s']:.1f}x" if seq["mb_per_s"] else ""})
        print(f"{name}: {best['text']}", file=sys.stderr)
    result = {
        "machine_note": f"{os.cpu_count()} CPU cores, no GPU needed; HTTP and S3 servers run in this process on "
                        "127.0.0.1 and share the cores with the client",
        "data_mb": round(sum(os.path.getsize(os.path.join(data, n)) for n in names) / 1e6, 1),
        "shards": len(names), "settings": {"seconds": args.seconds, "concurrency": concurrency, "block_sizes": blocks},
        "storages": results, "summary": rows,
    }
    path = write_result("storage", result, args.out)
    png = plots.plot_storages(results, os.path.splitext(path)[0] + ".png")
    print(table(rows, ["storage", "measurement", "MB/s", "samples/s", "p50 ms", "p99 ms", "vs sequential"]))
    print(f"\nwrote {path} and {png}", file=sys.stderr)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
