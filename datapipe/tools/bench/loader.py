"""``datapipe bench loader``: one dataset through several input pipelines side by side, plus a per-stage breakdown.

Image shards (``jpg``/``png`` + ``cls``): the baselines of :mod:`datapipe.tools.bench.baselines` in
their eval form, ``torch`` (torch DataLoader over webdataset with PIL decode, resize / center-crop /
normalise), ``webdataset`` (``webdataset.WebLoader``), ``dali`` (the hand-written DALI graph; CPU
operators without a GPU), then ``datapipe-images``
(``loaders.ImageLoader``) and ``datapipe-loader`` (``loaders.DataLoader`` over ShardStream with the
same PIL transform). Token shards (``npy``): ``datapipe-tokens`` (``loaders.TokenLoader``, packed)
and ``naive-pad`` (documents batched in order, padded to the batch's longest).

Per pipeline: samples/s, MB/s (encoded bytes), CPU cores used (process + children CPU time / wall,
from ``resource.getrusage``), time waiting in ``next()``, GPU busy time of the consume step on
CUDA (CUDA events; "n/a" on CPU). Stages are timed separately (fetch -> parse -> decode ->
host-to-device -> consume) so that the slowest one is named. This module imports ``loaders``
lazily: it is the benchmark of the whole stack.

No ``ceiling_ratio`` here: the consume step is a stand-in (a copy and a reduction), not a training
step, so "rate with the loader / rate with a cached batch" would only restate the loader's own
throughput. The figures that make sense without a model are the rate, the wait fraction and the
GPU busy time; the result's ``ceiling`` entry says so and names where the ratio is measured:
``datapipe doctor --ceiling-steps N -- train.py`` (your own step) and ``bench/ceiling.py``.
"""
from __future__ import annotations

import io
import os
import resource
import sys
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.utils.data

from datapipe.device.autotune import usable_cores
from datapipe.device.prefetch import first_tensor
from datapipe.tools.bench.baselines import (IMAGE_EXTS, DaliBaseline, PilEval, decode_image, endless, image_bytes,
                                            torch_loader, webdataset_loader)
from datapipe.tools.bench.loader_stages import _first_samples, bottleneck, consume, measure_stages  # noqa: F401
from datapipe.tools.bench.storage import resolve
from datapipe.tools.bench.storage_reads import Store

IMAGE_PIPELINES = ("torch", "webdataset", "dali", "datapipe-images", "datapipe-loader")
TOKEN_PIPELINES = ("datapipe-tokens", "naive-pad")


class DecodedStream(torch.utils.data.IterableDataset):
    """ShardStream samples -> ``(image tensor, label)`` with :class:`PilEval` (for loaders.DataLoader)."""

    def __init__(self, stream, size: int):
        self.stream = stream
        self.transform = PilEval(size)

    def __iter__(self):
        for sample in self.stream:
            yield self.transform(decode_image(image_bytes(sample))), int(bytes(sample["cls"]))


# ---- pipelines: factories returning an iterable of batches (the baselines evaluate: no augmentation) -----
def make_torch(urls, cfg):
    return torch_loader(urls, batch_size=cfg["batch_size"], image_size=cfg["image_size"], train=False,
                        workers=cfg["workers"], device=cfg["device"])


def make_webdataset(urls, cfg):
    return webdataset_loader(urls, batch_size=cfg["batch_size"], image_size=cfg["image_size"], train=False,
                             workers=cfg["workers"], device=cfg["device"])


def make_dali(urls, cfg):
    from datapipe.tools.bench.dali_check import check_dali_input

    # every batch it may decode: the timed ones, the warmup and DALI's read-ahead
    check_dali_input(urls, limit=(cfg["warmup"] + cfg["steps"] + 4) * cfg["batch_size"])
    return DaliBaseline(urls, batch_size=cfg["batch_size"], image_size=cfg["image_size"], train=False,
                        device=cfg["device"], threads=max(1, cfg["workers"]))


def make_image_loader(urls, cfg):
    from loaders import ImageLoader

    from loaders.images.options import DecodeOptions

    return ImageLoader(urls, batch_size=cfg["batch_size"], image_size=cfg["image_size"], train=False,
                       device=cfg["device"], decode=DecodeOptions(num_threads=max(1, cfg["workers"])))


def make_datapipe_loader(urls, cfg):
    from datapipe.stream import ShardStream
    from loaders import DataLoader

    ds = DecodedStream(ShardStream(urls, rank=0, world_size=1), cfg["image_size"])
    return DataLoader(ds, batch_size=cfg["batch_size"], num_workers=cfg["workers"], device=cfg["device"])


def make_token_loader(urls, cfg):
    from datapipe.stream import ShardStream
    from loaders import TokenLoader

    return TokenLoader(ShardStream(urls, rank=0, world_size=1), seq_len=cfg["seq_len"], batch_size=cfg["batch_size"],
                       device=cfg["device"])


class NaivePad:
    """Documents in shard order, ``batch_size`` at a time, truncated to ``seq_len`` and padded to the longest."""

    def __init__(self, urls, cfg):
        from datapipe.stream import ShardStream

        self.stream = ShardStream(urls, rank=0, world_size=1)
        self.seq_len, self.batch_size = cfg["seq_len"], cfg["batch_size"]

    def __iter__(self):

        docs = []
        for sample in self.stream:
            docs.append(np.load(io.BytesIO(bytes(sample["npy"])), allow_pickle=False)[: self.seq_len])
            if len(docs) == self.batch_size:
                yield self._pad(docs, torch)
                docs = []
        if docs:
            yield self._pad(docs, torch)

    def _pad(self, docs, torch):
        width = max(len(d) for d in docs)
        ids = np.zeros((len(docs), width), dtype=np.int64)
        mask = np.zeros((len(docs), width), dtype=np.int64)
        for i, d in enumerate(docs):
            ids[i, : len(d)] = d
            mask[i, : len(d)] = 1
        labels = np.where(mask == 1, ids, -100)
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
                "labels": torch.from_numpy(labels)}


FACTORIES: dict[str, Callable] = {
    "torch": make_torch, "webdataset": make_webdataset, "dali": make_dali, "datapipe-images": make_image_loader,
    "datapipe-loader": make_datapipe_loader, "datapipe-tokens": make_token_loader, "naive-pad": NaivePad,
}


# ---- measuring --------------------------------------------------------------------------------------
def cpu_seconds() -> float:
    """User + system CPU time of this process and its waited-for children."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def batch_counts(batch, kind: str) -> tuple[int, int, int]:
    """``(samples, real tokens, padded tokens)`` of a batch."""
    if kind == "tokens" and isinstance(batch, dict):
        if "attention_mask" in batch:
            real = int(batch["attention_mask"].sum())
            rows, width = batch["attention_mask"].shape
            docs = rows
        else:
            doc = batch["document_ids"]
            real = int((doc >= 0).sum())
            rows, width = doc.shape
            docs = int(((batch["position_ids"] == 0) & (doc >= 0)).sum())
        return docs, real, rows * width - real
    t = first_tensor(batch)
    return (int(t.shape[0]) if t is not None and t.dim() else 1), 0, 0


def measure_pipeline(name: str, loader, *, kind: str, steps: int, warmup: int, device: str,
                     sample_bytes: float, progress=None) -> dict[str, Any]:
    """Pull ``warmup`` then ``steps`` batches through ``consume``; rates, CPU cores used, wait and GPU time."""

    cuda = device == "cuda" and torch.cuda.is_available()
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    gen = endless(loader)
    for _ in range(warmup):
        consume(next(gen), device)
    if cuda:
        torch.cuda.synchronize()
    samples = real = pad = 0
    wait = 0.0
    events = []
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(gen)
        wait += time.perf_counter() - t0
        n, r, p = batch_counts(batch, kind)
        samples, real, pad = samples + n, real + r, pad + p
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            consume(batch, device)
            e1.record()
            events.append((e0, e1))
        else:
            consume(batch, device)
        if progress is not None:
            progress.update(1)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    gen.close()  # shuts the workers down, so RUSAGE_CHILDREN counts them
    del loader
    wall = time.perf_counter() - wall0
    cpu = cpu_seconds() - cpu0
    out = {"name": name, "steps": steps, "samples": samples, "seconds": round(elapsed, 4),
           "samples_per_s": round(samples / elapsed, 2), "batches_per_s": round(steps / elapsed, 3),
           "mb_per_s": round(samples / elapsed * sample_bytes / 1e6, 3),
           "cpu_cores_used": round(cpu / wall, 2), "wait_fraction": round(wait / elapsed, 4),
           "gpu_busy_fraction": "n/a", "gpu_busy_s": "n/a"}
    if events:
        busy = sum(a.elapsed_time(b) for a, b in events) / 1e3
        out.update(gpu_busy_s=round(busy, 4), gpu_busy_fraction=round(busy / elapsed, 4))
    if kind == "tokens":
        out["tokens_per_s"] = round(real / elapsed, 1)
        out["padding_fraction"] = round(pad / max(1, real + pad), 4)
    return out


# ---- the run -------------------------------------------------------------------------------------------
def detect_kind(urls: list[str]) -> str:
    sample = next(iter(_first_samples(urls, 1)), None)
    if sample is None:
        raise ValueError("the shards hold no samples")
    keys = {k for k in sample if not k.startswith("__")}
    if keys & set(IMAGE_EXTS):
        return "images"
    if "npy" in keys:
        return "tokens"
    raise ValueError(f"samples have {sorted(keys)}: need images ({'/'.join(IMAGE_EXTS)}, with a cls label) or "
                     "token documents (npy)")


def ensure_data(data: str, make_images: int, *, progress: bool) -> None:
    from datapipe.storage.urls import is_local

    if make_images <= 0 or not is_local(data):
        return
    if os.path.isdir(data) and any(f.endswith(".tar") for f in os.listdir(data)):
        return
    from datapipe.tools.synthetic import make_image_dataset

    make_image_dataset(data, num_images=make_images, num_classes=1000, shard_max_count=500, progress=progress,
                       num_workers=max(1, min(4, usable_cores())))


def run_loader(data: str, *, pipelines: list[str] | None = None, batch_size: int = 64, workers: int | None = None,
               device: str = "cpu", steps: int = 20, warmup: int = 2, image_size: int = 224, make_images: int = 0,
               seq_len: int = 2048, stage_seconds: float = 1.0, progress: bool = True) -> dict[str, Any]:
    """Run ``pipelines`` over the shards of ``data``; returns per-pipeline and per-stage figures."""
    from tqdm import tqdm

    if batch_size < 1 or steps < 1 or warmup < 0:
        raise ValueError("batch_size and steps must be >= 1, warmup >= 0")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device: use --device cpu")
    workers = usable_cores() if workers is None else workers
    if workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    ensure_data(data, make_images, progress=progress)
    urls = resolve([data])
    kind = detect_kind(urls)
    fit = IMAGE_PIPELINES if kind == "images" else TOKEN_PIPELINES
    chosen = list(pipelines) if pipelines else list(fit)
    unknown = [p for p in chosen if p not in FACTORIES]
    if unknown:
        raise ValueError(f"unknown pipelines {unknown}: choose from {', '.join(FACTORIES)}")
    wrong = [p for p in chosen if p not in fit]
    if wrong:
        raise ValueError(f"pipelines {wrong} do not read {kind} shards; for {kind} use {', '.join(fit)}")
    from datapipe.tar.manifest import counts_from_manifests

    store = Store(urls)
    total = sum(store.size(u) for u in urls)
    counts = counts_from_manifests(urls)
    n_samples = sum(counts.values()) if len(counts) == len(urls) else None
    if n_samples is None:
        from datapipe.stream import ShardStream

        n_samples = len(ShardStream(urls, rank=0, world_size=1))
    sample_bytes = total / max(1, n_samples)
    cfg = {"batch_size": batch_size, "workers": workers, "device": device, "image_size": image_size,
           "seq_len": seq_len, "steps": steps, "warmup": warmup}
    result: dict[str, Any] = {"data": data, "kind": kind, "shards": len(urls), "samples_in_data": n_samples,
                              "bytes": total, "mean_sample_bytes": round(sample_bytes, 1), "device": device,
                              "config": dict(cfg), "pipelines": []}
    bar = tqdm(total=steps * len(chosen), desc="bench loader", unit="batch", file=sys.stderr,
               disable=None if progress else True)  # None: no bar where stderr is not a terminal
    for name in chosen:
        bar.set_postfix_str(name)
        try:
            loader = FACTORIES[name](urls, cfg)
            r = measure_pipeline(name, loader, kind=kind, steps=steps, warmup=warmup, device=device,
                                 sample_bytes=sample_bytes, progress=bar)
        except Exception as e:  # one broken pipeline (e.g. DALI missing) must not end the comparison
            r = {"name": name, "error": str(e) if hasattr(e, "fields") else f"{type(e).__name__}: {e}",
                 **getattr(e, "fields", {})}
        result["pipelines"].append(r)
    bar.close()
    result["stages"] = measure_stages(urls, kind=kind, cfg=cfg, sample_bytes=sample_bytes, seconds=stage_seconds)
    result["bottleneck"] = bottleneck(result["stages"])
    ok = [p for p in result["pipelines"] if not p.get("error")]
    if ok:
        best = max(ok, key=lambda p: p["samples_per_s"])
        result["fastest"] = {"name": best["name"], "samples_per_s": best["samples_per_s"]}
    result["ceiling"] = {"ceiling_ratio": None, "note": CEILING_NOTE}
    return result


CEILING_NOTE = ("not measured: the consume step is a stand-in reduction, not a training step; "
                "`datapipe doctor --ceiling-steps N -- train.py` reports ceiling_ratio on your own step "
                "(bench/ceiling.py on ResNet-50 and LMs)")

TABLE_COLUMNS = ["pipeline", "samples/s", "MB/s", "tokens/s", "padding", "CPU cores", "wait", "GPU busy", "error"]
STAGE_COLUMNS = ["stage", "samples/s", "parallel", "note"]


def rows_for_table(result: dict) -> list[dict]:
    rows = []
    for p in result["pipelines"]:
        if p.get("error"):
            rows.append({"pipeline": p["name"], "error": " ".join(p["error"].split())[:80]})  # one line
            continue
        gpu = p["gpu_busy_fraction"]
        rows.append({"pipeline": p["name"], "samples/s": f"{p['samples_per_s']:.1f}", "MB/s": f"{p['mb_per_s']:.1f}",
                     "tokens/s": f"{p['tokens_per_s']:.0f}" if "tokens_per_s" in p else "",
                     "padding": f"{p['padding_fraction']:.0%}" if "padding_fraction" in p else "",
                     "CPU cores": f"{p['cpu_cores_used']:.2f}", "wait": f"{p['wait_fraction']:.0%}",
                     "GPU busy": gpu if isinstance(gpu, str) else f"{gpu:.0%}"})
    return rows


def stage_rows(result: dict) -> list[dict]:
    worst = result["bottleneck"]["stage"]
    return [{"stage": s["stage"] + (" <- bottleneck" if s["stage"] == worst else ""),
             "samples/s": "n/a" if s["samples_per_s"] is None else f"{s['samples_per_s']:.0f}",
             "parallel": s.get("parallel", 1), "note": s.get("note", "")} for s in result["stages"]]
