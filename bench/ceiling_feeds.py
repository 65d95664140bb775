"""bench/ceiling.py's feeds: each loader of a row, made fresh and fed epoch after epoch, and closed after it."""
from __future__ import annotations

import gc
import os
import time

import torch

from datapipe.tools.bench.baselines import DaliBaseline, close, endless

LOADER_NAMES = ("imageloader", "dali", "dataloader", "torch_dataloader", "tokenloader", "imageloader_cuda", "nvimg")


class Uint8Images(torch.utils.data.Dataset):
    """Map-style uint8 3x224x224 images (copies from a random pool) and int labels: cheap, so workers keep up."""

    def __init__(self, n: int, size: int):
        self.n = n
        self.pool = torch.randint(0, 255, (64, 3, size, size), dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.pool[i % 64].clone(), i % 1000


def torch_idiom(loader, device):
    """torch's usual device feed: ``pin_memory=True`` batches moved with ``.to(device, non_blocking=True)``,
    epoch after epoch (a plain ``for`` over the loader: its persistent workers serve every epoch)."""
    while True:
        for x, y in loader:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def variant(name: str) -> tuple[str, dict]:
    """``imageloader@hw0.5+t14+q4+nohold`` -> ``("imageloader", {"hw": 0.5, "threads": 14, "depth": 4, "hold": False})``:
    a probe's ImageLoader with a fixed hardware decoder share (``hw``), DALI threads (``t``), batches made ahead
    (``q``, ``ReadOptions.prefetch_queue_depth``) and, with ``nohold``, no ``StepHold`` (the loader's own hold for a
    hardware share on few queues). ``e<percent>`` (``imageloader@e15``) keeps the default decoder choice but moves
    early, after the first few judged batches, at that starved share instead of its own early bar (30% on few
    queues). ``s<steps>`` leaves that many steps queued when the hold waits (``StepHold.slack``). ``p<streams>``
    makes that many CUDA streams first (kept open), shifting which hardware queue each of DALI's streams lands on
    (the driver hands queues out in turn as streams are made; run one row a process). A plain name has no
    options."""
    base, _, spec = name.partition("@")
    if base == "nvimg":
        from bench.nvimg_feed import nvimg_options

        return base, nvimg_options(spec)
    opts: dict = {}
    for part in filter(None, spec.split("+")):
        if part == "nohold":
            opts["hold"] = False
        elif part.startswith("hw"):
            opts["hw"] = float(part[2:])
        elif part.startswith("t") and part[1:].isdigit():
            opts["threads"] = int(part[1:])
        elif part.startswith("q") and part[1:].isdigit():
            opts["depth"] = int(part[1:])
        elif part.startswith("e") and part[1:].isdigit():
            opts["early"] = int(part[1:]) / 100
        elif part.startswith("s") and part[1:].isdigit():
            opts["slack"] = int(part[1:])
        elif part.startswith("p") and part[1:].isdigit():
            opts["pad"] = int(part[1:])
        else:
            raise ValueError(f"loader {name!r}: unknown option {part!r} (use hw<share>, t<threads>, q<depth>, "
                             "e<percent>, s<steps>, p<streams>, nohold)")
    if opts and base != "imageloader":
        raise ValueError(f"loader {name!r}: options (@...) are for imageloader only")
    return base, opts


_PADDING: list = []  # streams a probe made before its loader (kept open for the process)


def pad_streams(count: int) -> list[int]:
    """``count`` new non-blocking CUDA streams (their handles), made through the CUDA runtime (torch's pool makes 32
    at once, and its ``cudaStreamCreate`` makes blocking ones)."""
    if count <= 0:
        return []
    import ctypes

    from datapipe.device.host_register import _runtime

    torch.zeros(1, device="cuda")  # the runtime loaded and started
    runtime = _runtime()
    if runtime is None:
        raise RuntimeError("p<streams>: no libcudart.so loaded in this process")
    handles = []
    for _ in range(count):
        handle = ctypes.c_void_p(0)
        err = runtime.cudaStreamCreateWithFlags(ctypes.byref(handle), ctypes.c_uint(1))  # cudaStreamNonBlocking
        if err != 0:
            raise RuntimeError(f"cudaStreamCreateWithFlags failed: {err}")
        handles.append(handle.value)
    return handles


def make_feed(name: str, args, data: dict):
    """(batches, closer) of loader ``name``: a fresh loader, epoch after epoch."""
    dev = args.device
    name, opts = variant(name)
    if name in ("imageloader", "imageloader_cuda"):
        from loaders import DecodeOptions, ImageLoader, ReadOptions

        decode = DecodeOptions(hw_decoder_load=0.0) if name == "imageloader_cuda" else None
        _PADDING.extend(pad_streams(opts.get("pad", 0)))
        if set(opts) - {"early", "slack", "pad"}:
            decode = DecodeOptions(hw_decoder_load=opts.get("hw"), num_threads=opts.get("threads"))
        read = ReadOptions(prefetch_queue_depth=opts["depth"]) if "depth" in opts else None
        loader = ImageLoader(data["images"], batch_size=args.batch_size, image_size=args.image_size, device=dev,
                             decode=decode, read=read)
        if opts.get("hold") is False:
            loader._hold.active = False  # a probe: the hardware share without the hold
        loader._hold.slack = opts.get("slack", 0)
        if "early" in opts:
            loader._decoder.early_threshold = opts["early"]  # a probe: the default choice, an earlier move
        return endless(loader), loader
    if name == "nvimg":
        from bench.nvimg_feed import NvImgFeed

        feed = NvImgFeed(data["images"], batch_size=args.batch_size, image_size=args.image_size, device=dev, opts=opts)
        return feed, feed
    if name == "dali":
        dali = DaliBaseline(data["images"], batch_size=args.batch_size, image_size=args.image_size,
                            device=dev.type, threads=min(8, os.cpu_count() or 1))
        return iter(dali), None
    if name in ("dataloader", "torch_dataloader"):
        ds = Uint8Images(args.batch_size * args.epoch_batches, args.image_size)
        common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True,
                      persistent_workers=True)
        if name == "dataloader":
            from loaders import DataLoader

            loader = DataLoader(ds, device=dev, **common)
            return endless(loader), loader
        loader = torch.utils.data.DataLoader(ds, pin_memory=dev.type == "cuda", **common)
        return torch_idiom(loader, dev), loader
    if name == "tokenloader":
        from loaders import TokenLoader

        loader = TokenLoader(data["tokens"], seq_len=args.seq_len, batch_size=args.token_batch, device=dev)
        return endless(loader), None
    raise ValueError(f"unknown loader {name!r}: use one of {', '.join(LOADER_NAMES)}")


def close_feed(feed, owner) -> None:
    """Stop a feed and its loader's worker processes, and wait until they are gone."""
    if feed is not None:
        close(feed)
    if owner is not None:
        close(getattr(owner, "_iterator", None))  # torch's persistent workers
    gc.collect()
    import multiprocessing

    deadline = time.perf_counter() + 30
    while multiprocessing.active_children() and time.perf_counter() < deadline:
        time.sleep(0.05)
