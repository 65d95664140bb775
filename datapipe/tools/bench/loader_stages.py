"""``datapipe bench loader``'s per-stage rates: read, parse, decode, augment, collate and copy, each alone, and
the stage that bounds the rest."""
from __future__ import annotations

import io
import time

import numpy as np
import torch

from datapipe.device.autotune import usable_cores
from datapipe.device.prefetch import first_tensor
from datapipe.tools.bench.baselines import PilEval, decode_image, image_bytes
from datapipe.tools.bench.storage_reads import Store, measure_reads, measure_stream
from datapipe.words import counted

__all__ = ["bottleneck", "consume", "measure_stages"]


def consume(batch, device: str):
    """Host-to-device copy (non-blocking when pinned) and a reduction on the device: a stand-in model step."""
    t = first_tensor(batch)
    if t is None:
        return None
    if device == "cuda" and t.device.type != "cuda":
        t = t.to("cuda", non_blocking=t.is_pinned())
    return t.float().sum()


def _first_samples(urls: list[str], n: int) -> list[dict]:
    from datapipe.stream import ShardStream

    out = []
    for sample in ShardStream(urls, rank=0, world_size=1):
        out.append(sample)
        if len(out) >= n:
            break
    return out


def _decodes(fn) -> bool:
    try:
        fn()
        return True
    except Exception:  # PIL raises many types for damaged files
        return False


def _rate(fn, items, seconds: float) -> float:
    """Items per second of ``fn`` over ``items`` (cycled until ``seconds`` pass, at least one pass)."""
    n, start = 0, time.perf_counter()
    while True:
        for item in items:
            fn(item)
            n += 1
        if time.perf_counter() - start >= seconds:
            break
    return n / (time.perf_counter() - start)


def measure_stages(urls: list[str], *, kind: str, cfg: dict, sample_bytes: float, seconds: float) -> list[dict]:
    """Each stage on its own: fetch (raw read), parse (ShardStream), decode (or pack), H2D, consume."""

    par = max(1, min(cfg["workers"], usable_cores()))
    store = Store(urls)
    sizes = [store.size(u) for u in urls]
    fetch = measure_reads(store, sizes, block=4 << 20, concurrency=1, seconds=seconds)
    stages = [{"stage": "fetch", "samples_per_s": fetch["mb_per_s"] * 1e6 / sample_bytes, "parallel": 1,
               "note": f"raw read, {fetch['mb_per_s']:.0f} MB/s (page cache as it is)"}]
    parse = measure_stream(urls, seconds=seconds)
    stages.append({"stage": "parse", "samples_per_s": parse["samples_per_s"] * par, "parallel": par,
                   "one_core": parse["samples_per_s"], "note": "ShardStream, per core x workers"})
    samples = _first_samples(urls, 16)
    bs = cfg["batch_size"]
    if kind == "images":
        transform = PilEval(cfg["image_size"])
        data = [d for d in (image_bytes(s) for s in samples) if _decodes(lambda: transform(decode_image(d)))]
        note = "PIL decode + resize/crop/normalise, per core x workers"
        if len(data) < len(samples):
            note += f" ({len(samples) - len(data)} of the first {len(samples)} images left out: PIL cannot decode them)"
        one = _rate(lambda d: transform(decode_image(d)), data, seconds) if data else None
        stages.append({"stage": "decode", "samples_per_s": one * par if data else None, "parallel": par,
                       "one_core": one, "note": note})
        batch = torch.zeros(bs, 3, cfg["image_size"], cfg["image_size"])
    else:
        from packing import Packer

        docs = [np.load(io.BytesIO(bytes(s["npy"])), allow_pickle=False) for s in samples]
        one = _rate(lambda s: np.load(io.BytesIO(bytes(s["npy"])), allow_pickle=False), samples, seconds / 2)
        stages.append({"stage": "decode", "samples_per_s": one * par, "parallel": par, "one_core": one,
                       "note": "np.load of npy documents"})
        many = docs * max(1, (8 * bs) // max(1, len(docs)))
        t0 = time.perf_counter()
        rows = sum(len(b["input_ids"]) for b in Packer(cfg["seq_len"], buffer_size=256).batches(many, bs))
        dt = time.perf_counter() - t0
        stages.append({"stage": "pack", "samples_per_s": len(many) / dt, "parallel": 1, "one_core": len(many) / dt,
                       "note": f"packing.Packer ({counted(rows, 'row')} of {cfg['seq_len']})"})
        mean_len = max(1, int(np.mean([len(d) for d in docs])))
        batch = torch.zeros(bs, min(cfg["seq_len"], mean_len * 4), dtype=torch.int64)
    if cfg["device"] == "cuda" and torch.cuda.is_available():
        pinned = batch.pin_memory()
        gpu = torch.empty_like(pinned, device="cuda")
        torch.cuda.synchronize()
        reps, t0 = 20, time.perf_counter()
        for _ in range(reps):
            gpu.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        stages.append({"stage": "host-to-device", "samples_per_s": reps * bs / (time.perf_counter() - t0),
                       "parallel": 1, "note": f"pinned copy of a [{', '.join(map(str, batch.shape))}] batch"})
        batch = gpu
    else:
        stages.append({"stage": "host-to-device", "samples_per_s": None, "parallel": 1, "note": "n/a on CPU"})
    dev = cfg["device"]
    rate = _rate(lambda b: consume(b, dev), [batch], seconds / 2) * bs
    if dev == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()
    stages.append({"stage": "consume", "samples_per_s": rate, "parallel": 1,
                   "note": "the stand-in step (reduction over the batch)"})
    for s in stages:
        if s["samples_per_s"] is not None:
            s["samples_per_s"] = round(s["samples_per_s"], 1)
    return stages


def bottleneck(stages: list[dict]) -> dict:
    timed = sorted((s for s in stages if s["samples_per_s"]), key=lambda s: s["samples_per_s"])
    worst = timed[0]
    text = f"{worst['samples_per_s']:.0f} samples/s"
    if worst.get("parallel", 1) > 1:
        text += f" with {worst['parallel']} workers"
    if len(timed) > 1:
        text += f", {timed[1]['samples_per_s'] / worst['samples_per_s']:.1f}x below the next slowest ({timed[1]['stage']})"
    return {"stage": worst["stage"], "samples_per_s": worst["samples_per_s"], "text": text}
