"""Host cost per batch of the DALI reader's delivered record (elastic resume), on the CPU.

Per batch of 256: ``SampleNumbers.lookup`` (padded ``source_info`` rows -> one dict lookup per
sample), the epoch's global numbers, and the bitmap update done when the batch is handed out;
against the baseline of the labels' parse in the same batch (``parse_ascii_ints``). The
``source_info`` rows are synthetic but of DALI's format and length (ImageNet-sized index).

    PYTHONPATH=. python bench/dali_source_info.py
"""
from __future__ import annotations

import time

import numpy as np

from bench.common import write_result
from loaders.images.dali_reader import SampleNumbers
from loaders.images.encoded import parse_ascii_ints


def main(batch: int = 256, shards: int = 1024, per_shard: int = 1251, reps: int = 2000) -> dict:
    numbers = SampleNumbers.__new__(SampleNumbers)  # the table as the index files would fill it
    numbers.counts = [per_shard] * shards
    keys = [f"/data/imagenet/train-{s:06d}.tar:{1536 + 110000 * j}:{s * per_shard + j:09d}.jpg".encode()
            for s in range(shards) for j in range(per_shard)]
    numbers.table = {k: i for i, k in enumerate(keys)}
    rng = np.random.default_rng(0)
    to_global = numbers.to_global(list(rng.permutation(shards)))
    delivered = np.zeros(len(keys), dtype=bool)
    pick = rng.integers(0, len(keys), size=(reps, batch))
    width = max(len(k) for k in keys)
    rows = []
    for p in pick[:64]:
        a = np.zeros((batch, width), dtype=np.uint8)
        for i, j in enumerate(p):
            a[i, :len(keys[j])] = np.frombuffer(keys[j], dtype=np.uint8)
        rows.append(a)
    labels = np.zeros((batch, 4), dtype=np.uint8)
    labels[:, :3] = np.frombuffer(b"123", dtype=np.uint8)
    t0 = time.perf_counter()
    for r in range(reps):
        delivered[to_global[numbers.lookup(rows[r % 64], batch)]] = True
    record = (time.perf_counter() - t0) / reps * 1e6
    t0 = time.perf_counter()
    for r in range(reps):
        parse_ascii_ints(labels)
    parse = (time.perf_counter() - t0) / reps * 1e6
    t0 = time.perf_counter()
    for _ in range(50):
        packed = np.packbits(delivered).tobytes()
    pack = (time.perf_counter() - t0) / 50 * 1e6
    result = {"batch": batch, "samples": len(keys), "record_us_per_batch": round(record, 1),
              "baseline_label_parse_us_per_batch": round(parse, 1),
              "state_pack_us (per state_dict)": round(pack, 1), "state_bytes": len(packed)}
    print(result)
    write_result("dali_source_info", result)
    return result


if __name__ == "__main__":
    main()
