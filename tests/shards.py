"""Tiny WebDataset shards for tests, written with the real webdataset writer."""
import os

import webdataset


def make_samples(n, *, prefix="s", size=64, seed=0):
    rnd = __import__("random").Random(seed)
    return [
        {"__key__": f"{prefix}{i:05d}", "bin": rnd.randbytes(rnd.randrange(1, size + 1)), "cls": str(i % 7).encode()}
        for i in range(n)
    ]


def write_shards(directory, counts, *, manifest=True, gzip=False, prefix="s"):
    """Shards of the given sample counts with the real webdataset writer (+ a datapipe manifest)."""
    os.makedirs(directory, exist_ok=True)
    ext = "tar.gz" if gzip else "tar"
    urls, samples = [], []
    entries = []
    for shard, n in enumerate(counts):
        path = os.path.join(directory, f"shard-{shard:06d}.{ext}")
        batch = make_samples(n, prefix=f"{prefix}{shard}-", seed=shard)
        with webdataset.TarWriter(path, compress=gzip) as w:
            for s in batch:
                w.write(s)
        urls.append(path)
        samples += batch
        entries.append({"name": os.path.basename(path), "count": n, "bytes": os.path.getsize(path), "sha256": ""})
    if manifest:
        from datapipe.tar.manifest import make_manifest, write_manifest

        write_manifest(str(directory), make_manifest(entries))
    return urls, samples


def write_keyed(pattern, samples: dict, *, max_count: int) -> None:
    """``{key: bytes}`` as samples ``{"__key__": key, "bin": value}`` in shards of ``max_count`` (datapipe's writer)."""
    from datapipe import ShardWriter

    with ShardWriter(pattern, max_count=max_count) as w:
        for k, v in samples.items():
            w.write({"__key__": k, "bin": v})
