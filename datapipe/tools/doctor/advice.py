"""The doctor's advice: what a batch holds (:func:`inspect_batch`) and the rules that turn the report's
measurements into advice (:func:`advise`), each item with the number that triggered it."""
from __future__ import annotations

import sys
from typing import Any, Iterator

from datapipe.device.queues import WIDE_QUEUES  # CUDA_DEVICE_MAX_CONNECTIONS advised for DALI beside training

WAIT_HIGH = 0.10  # above this share of wall time the input pipeline is a bottleneck
WAIT_LOW = 0.02  # below it, input is not the bottleneck
PADDING_HIGH = 0.20
CEILING_LOW = 0.98  # below this share of the data-free ceiling the loader costs the step visibly
HYBRID_DECODE_CORES = 12  # DecodeOptions(hw_decoder_load="auto") starts on the CUDA decoder from 12 cores (decoder_choice)


def _torch():
    return sys.modules.get("torch")


# ---- batch inspection -------------------------------------------------------------------------------
def _leaves(batch, depth: int = 0) -> Iterator:
    if depth > 4:
        return
    if isinstance(batch, dict):
        for v in batch.values():
            yield from _leaves(v, depth + 1)
    elif isinstance(batch, (list, tuple)):
        if len(batch) and all(isinstance(x, (bytes, bytearray, memoryview)) for x in batch[:4]):
            yield from batch[:4]
        else:
            for v in batch[:64]:
                yield from _leaves(v, depth + 1)
    else:
        yield batch


def inspect_batch(batch) -> dict[str, Any]:
    """What the advice needs from a batch: size, devices, pinning, images on the host, JPEG bytes, padding."""
    torch = _torch()
    info: dict[str, Any] = {"batch_size": None, "devices": set(), "host_tensors": 0, "unpinned_host_tensors": 0,
                            "images_on_host": None, "jpeg_bytes": False, "pad": 0, "positions": 0}
    for leaf in _leaves(batch):
        if torch is not None and torch.is_tensor(leaf):
            if info["batch_size"] is None and leaf.dim() > 0:
                info["batch_size"] = int(leaf.shape[0])
            info["devices"].add(leaf.device.type)
            if leaf.device.type == "cpu":
                info["host_tensors"] += 1
                try:
                    pinned = leaf.is_pinned()
                except Exception:
                    pinned = False
                info["unpinned_host_tensors"] += 0 if pinned else 1
                if leaf.dim() == 4 and (leaf.shape[1] in (1, 3) or leaf.shape[3] in (1, 3)) and min(leaf.shape[-2:]) > 8:
                    info["images_on_host"] = list(leaf.shape)
        elif isinstance(leaf, (bytes, bytearray, memoryview)):
            info["jpeg_bytes"] |= bytes(leaf[:3]) == b"\xff\xd8\xff"
        elif hasattr(leaf, "dtype") and hasattr(leaf, "tobytes") and getattr(leaf, "ndim", 0) == 1:
            info["jpeg_bytes"] |= leaf.dtype.itemsize == 1 and bytes(leaf[:3].tobytes()) == b"\xff\xd8\xff"
    if isinstance(batch, dict) and torch is not None:
        mask, labels = batch.get("attention_mask"), batch.get("labels")
        if torch.is_tensor(mask):
            info["pad"], info["positions"] = int((mask == 0).sum()), int(mask.numel())
            info["padding_source"] = "attention_mask == 0"
        elif torch.is_tensor(labels) and labels.dtype in (torch.int64, torch.int32):
            info["pad"], info["positions"] = int((labels == -100).sum()), int(labels.numel())
            info["padding_source"] = "labels == -100"
    info["devices"] = sorted(info["devices"])
    return info


# ---- advice -----------------------------------------------------------------------------------------
def _startup_split(m: dict[str, Any]) -> tuple[float, float | None]:
    """Seconds the loop waited for each pass's first batch (start-up), and the wait share of the rest of the
    run (None when the report does not tell)."""
    loaders = m.get("loaders") or ([m["loader"]] if m.get("loader") else [])
    startup = sum(e.get("startup_wait_s") or 0.0 for e in loaders)
    wall, total = m.get("wall_s"), m.get("wait_s")
    if len(loaders) == 1 and loaders[0].get("steady_wait_fraction") is not None:  # as the report's loader line
        return startup, loaders[0]["steady_wait_fraction"]
    if startup and wall and total is not None and wall > startup:
        return startup, max(0.0, total - startup) / (wall - startup)
    return startup, None


def _startup_advice(m: dict[str, Any], wait: float, startup: float, steady: float, workers) -> str:
    """The wait is start-up: say so, and what shortens it (or that a longer run amortises it)."""
    loaders = m.get("loaders") or [m.get("loader") or {}]
    passes = sum(e.get("iterations") or 0 for e in loaders)
    fresh = [e for e in loaders if (e.get("num_workers") or 0) > 0 and not e.get("persistent_workers")]
    text = (f"the loop waited for data {wait:.0%} of the time, but {startup:.2f} s of it was start-up (the first "
            f"batch of each pass{f', {passes} passes' if passes else ''}: starting workers, opening the first shards, "
            f"building the pipeline); after it the loop waited {steady:.1%}, so the input keeps up and neither more "
            "workers nor faster decoding would help. ")
    if fresh:
        text += (f"The workers started anew in each of the {passes} passes: " if passes > 1 else "With several "
                 "epochs, ") + "persistent_workers=True in the DataLoader starts them once for all epochs"
    else:
        text += "Start-up is paid once per pass and no setting shortens it much"
    wall = m.get("wall_s")
    run = f" ({wall:.1f} s)" if wall else ""
    return text + f"; in a run longer than this one{run} its share shrinks"
def advise(m: dict[str, Any]) -> list[dict[str, Any]]:
    """Advice from measurements ``m`` (the report's fields); each item states the number that triggered it.

    Keys used: ``wait_fraction``, ``cores``, ``cuda``, ``cuda_device_max_connections`` (the environment's
    setting, None when unset), ``ceiling_ratio``, ``loader`` (the loader
    waited on most: ``type``, ``num_workers``, ``hw_decoder_load``), ``batch``
    (``batch_size``, ``host_tensors``, ``unpinned_host_tensors``, ``images_on_host``, ``jpeg_bytes``,
    ``padding_fraction``), ``rates`` (``capacity_batches_per_s``, ``consumption_batches_per_s``).
    """
    out = []
    wait = m["wait_fraction"]
    cores = m.get("cores") or 1
    cuda = bool(m.get("cuda"))
    workers = (m.get("loader") or {}).get("num_workers")
    kind = (m.get("loader") or {}).get("type") or ""
    batch = m.get("batch") or {}
    rates = m.get("rates") or {}

    def add(key, text, **trigger):
        out.append({"id": key, "advice": text, "trigger": trigger})

    if m.get("steps") == 0:  # the report counts them; measurements without the key are advised on
        add("no_steps", "no training steps were measured: the script iterated no DataLoader, datapipe loader or "
                        "ShardStream (or stopped before its first batch); nothing to advise on", steps=0)
        return out
    startup, steady = _startup_split(m)
    after = ""
    if wait > WAIT_HIGH and startup > 0 and steady is not None and steady <= WAIT_HIGH:
        add("startup", _startup_advice(m, wait, startup, steady, workers), wait_fraction=wait,
            startup_wait_s=startup, steady_wait_fraction=steady)
        wait, after = steady, " after start-up"  # the rules below are about the steady state, which keeps up
    if wait < WAIT_LOW:
        add("not_bottleneck", f"input is not the bottleneck: the loop waited for data {wait:.1%} of the time{after} "
                              f"(< {WAIT_LOW:.0%}); speed up the model step instead", wait_fraction=wait)
    if wait > WAIT_HIGH and isinstance(workers, int) and workers < cores:
        add("more_workers", f"the loop waited for data {wait:.0%} of the time with num_workers={workers} on {cores} "
                            f"cores: raise num_workers (towards {cores}), or use loaders.DataLoader(num_workers='auto')",
            wait_fraction=wait, num_workers=workers, cores=cores)
    elif wait > WAIT_HIGH and isinstance(workers, int):
        off = (("move work off the CPU (GPU decode with loaders.ImageLoader, pre-decoded data, or smaller images: "
                "`datapipe shard --resize SHORT_SIDE`)") if cuda
               else "more workers cannot help without more cores, and there is no CUDA GPU to decode on: make the "
                    "per-sample work cheaper (shard smaller images: `datapipe shard --resize SHORT_SIDE`; "
                    "lighter transforms; pre-decoded data) or run on more cores")
        add("cpu_bound", f"the loop waited for data {wait:.0%} of the time although num_workers={workers} already "
                         f"uses all {cores} cores: {off}", wait_fraction=wait, num_workers=workers, cores=cores)
    elif wait > WAIT_HIGH and kind.endswith(".ImageLoader"):
        gpu_way = (f", or the GPU's hardware JPEG decoder with CUDA_DEVICE_MAX_CONNECTIONS={WIDE_QUEUES} set before "
                   "CUDA starts (docs/performance.md)") if cuda else (f" (up to the {cores} cores); without a CUDA GPU "
                                                                      "decoding stays on the CPU: shard smaller "
                                                                      "images (`datapipe shard --resize "
                                                                      "SHORT_SIDE`) or lower image_size")
        add("input_bound", f"the loop waited for data {wait:.0%} of the time: ImageLoader is the bottleneck; give "
                           f"DALI more CPU threads (ImageLoader(..., decode=DecodeOptions(num_threads=...))){gpu_way}",
            wait_fraction=wait)
    elif wait > WAIT_HIGH:
        add("input_bound", f"the loop waited for data {wait:.0%} of the time: the input pipeline is the bottleneck "
                           "(its worker count is unknown to the doctor: wrap the DataLoader itself to see it)",
            wait_fraction=wait)
    cap, need = rates.get("capacity_batches_per_s"), rates.get("consumption_batches_per_s")
    if cap and need:
        if cap < need:
            add("capacity", f"the input pipeline delivers {cap:.1f} batches/s on its own but the model could consume "
                            f"{need:.1f} batches/s: input capacity is {cap / need:.0%} of demand",
                capacity_batches_per_s=cap, consumption_batches_per_s=need)
        elif wait > WAIT_HIGH:
            add("prefetch", f"the input pipeline can deliver {cap:.1f} batches/s, more than the {need:.1f} the model "
                            f"consumes, yet the loop waited {wait:.0%} of the time: batches arrive late; prefetch more "
                            "(prefetch_factor, DevicePrefetcher depth) or keep workers alive (persistent_workers=True)",
                capacity_batches_per_s=cap, consumption_batches_per_s=need, wait_fraction=wait)
    ratio = m.get("ceiling_ratio")
    hw = (m.get("loader") or {}).get("hw_decoder_load")
    auto = (m.get("loader") or {}).get("hw_decoder_auto")  # "auto" already: it chose the hardware decoder itself
    spare = cores >= HYBRID_DECODE_CORES
    if cuda and hw and not auto and ratio is not None and ratio < CEILING_LOW and wait < WAIT_LOW and spare:
        add("hybrid_decode", f"the loop runs at {ratio:.1%} of its data-free ceiling yet waits for data only "
                             f"{wait:.1%} of the time: the loader slows the step itself (its kernels, and its CUDA calls "
                             f"beside the step's launches). With {cores} cores, try "
                             "ImageLoader(..., decode=DecodeOptions(hw_decoder_load=\"auto\")): "
                             "nvJPEG's CUDA decoder with the Huffman stage on the CPU instead of the hardware "
                             "decoder while it keeps up, the hardware decoder once the loop waits",
            ceiling_ratio=ratio, wait_fraction=wait, hw_decoder_load=hw, cores=cores)
    connections = m.get("cuda_device_max_connections")
    slowed = ratio is not None and ratio < CEILING_LOW
    if (cuda and kind.endswith(".ImageLoader") and (wait >= WAIT_LOW or slowed)
            and not (isinstance(connections, int) and connections >= WIDE_QUEUES)):
        why = f"waits for data {wait:.1%} of the time" if wait >= WAIT_LOW else \
            f"runs at {ratio:.1%} of its data-free ceiling"
        add("cuda_connections", f"the loop {why} while ImageLoader's GPU work (decode, augmentation) runs beside "
                                f"the training step on CUDA's hardware work queues ({connections or 8}, the "
                                f"default 8 unless set): set CUDA_DEVICE_MAX_CONNECTIONS={WIDE_QUEUES} in the "
                                f"environment before CUDA starts, e.g. `CUDA_DEVICE_MAX_CONNECTIONS={WIDE_QUEUES} "
                                "python train.py` (set inside the script it works only before torch first uses "
                                "CUDA; datapipe does not set it for you)",
            wait_fraction=wait, ceiling_ratio=ratio, cuda_device_max_connections=connections, loader=kind)
    if (cuda and wait > WAIT_HIGH and isinstance(workers, int) and workers > 0 and batch.get("host_tensors")
            and kind.startswith("torch.utils.data")):
        add("recycled_workers", f"the loop waited for data {wait:.0%} of the time on torch's DataLoader with "
                                f"{workers} workers: each batch travels through new shared memory, which the main "
                                "process maps, copies into pinned memory and unmaps again; loaders.DataLoader "
                                "takes the same arguments and recycles that memory (with device='cuda' it copies "
                                "to the GPU straight from it)", wait_fraction=wait, num_workers=workers, loader=kind)
    unpinned = batch.get("unpinned_host_tensors") or 0
    if cuda and unpinned:
        add("pin_memory", f"{unpinned} tensor(s) per batch arrive in pageable host memory while a CUDA device is "
                          "used: pin them (pin_memory=True) and copy ahead on a side stream with "
                          "datapipe.DevicePrefetcher (or loaders.DataLoader(device='cuda'))", unpinned_tensors=unpinned)
    decoded = batch.get("images_on_host")
    if cuda and (decoded or batch.get("jpeg_bytes")) and wait >= WAIT_LOW:
        what = (f"image batches {decoded} arrive decoded on the host" if decoded
                else "batches carry JPEG bytes to decode on the CPU")
        add("gpu_decode", f"{what} while the loop waits for data {wait:.0%} of the time{after} and a GPU is present: decode "
                          "on the GPU with loaders.ImageLoader (DALI, hardware JPEG decoder)",
            wait_fraction=wait, images_on_host=decoded, jpeg_bytes=bool(batch.get("jpeg_bytes")))
    bs = batch.get("batch_size")
    if cuda and isinstance(bs, int) and bs > 8 and bs % 8:
        lo, hi = bs - bs % 8, bs - bs % 8 + 8
        add("round_batch", f"batch size {bs} is not a multiple of 8: use {hi} (or {lo}) for tensor-core friendly "
                           "shapes", batch_size=bs)
    pad = batch.get("padding_fraction")
    if pad is not None and pad > PADDING_HIGH:
        add("packing", f"{pad:.0%} of token positions are padding ({batch.get('padding_source')}): pack documents "
                       "into dense rows with loaders.TokenLoader (packing.Packer)", padding_fraction=pad)
    return out
