"""A probe feed for bench/ceiling.py (``--rows config/nvimg``): JPEGs decoded by the hardware decoder through
nvImageCodec directly, with the rest of the work on one CUDA stream of the feed's own.

The question it answers: does the hardware JPEG decoder keep up beside a training step on the driver's 8 hardware
queues when it is not behind DALI's ~24 streams? Everything after the decode is batched (one padded batch, one
``grid_sample`` at twice the size and a 2x2 average for antialiasing, flip and normalise), so a batch costs the host
a few dozen launches, on a stream of high priority (``prio0``: normal). Output: ImageLoader's format, float32
NCHW normalised with the ImageNet mean/std, and int64 labels, on the device.

Options (``nvimg@...``): ``gpu`` decodes with nvJPEG's CUDA decoder instead (``BackendKind.GPU_ONLY``),
``hw<share>`` splits each batch between the hardware decoder (``share``) and the CUDA decoder, ``prio0`` runs the
stream at normal priority, ``q<depth>`` batches made ahead (default 3), ``stream`` reads the shards the way
ImageLoader's stream reader does (a ``ShardStream`` with its 2,000-sample shuffle buffer, batched into encoded
batches in a thread of its own) instead of drawing from every JPEG held in memory.
"""
from __future__ import annotations

import math
import queue
import random
import tarfile
import threading
import time
import warnings

import torch
import torch.nn.functional as F

NEXT_TIMEOUT_S = 120.0  # next() raises after this long without a batch (the thread alive but stuck)
CLOSE_TIMEOUT_S = 30.0  # close() leaves a stuck thread behind after this long
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def read_samples(urls: list[str]) -> tuple[list[bytes], list[int]]:
    """Every (jpeg, label) of local WebDataset shards, in memory (the page cache's copy, read once)."""
    jpegs, labels = [], []
    for url in urls:
        pending: dict[str, dict] = {}
        with tarfile.open(url) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, _, ext = member.name.rpartition(".")
                pending.setdefault(key, {})[ext.lower()] = tar.extractfile(member).read()
        for parts in pending.values():
            jpg = parts.get("jpg") or parts.get("jpeg")
            if jpg is not None and "cls" in parts:
                jpegs.append(jpg)
                labels.append(int(parts["cls"]))
    if not jpegs:
        raise ValueError("nvimg feed: no .jpg/.cls samples in the shards")
    return jpegs, labels


def random_crop(rng: random.Random, height: int, width: int) -> tuple[int, int, int, int]:
    """A random-resized-crop box (y0, x0, h, w): 8-100% of the area, aspect 3/4-4/3 (ten tries), else the centre
    of the image clamped to that aspect range (torchvision's ``RandomResizedCrop`` rule)."""
    area = height * width
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    h, w = height, width
    if width / height < 3 / 4:
        h = int(round(width / (3 / 4)))
    elif width / height > 4 / 3:
        w = int(round(height * 4 / 3))
    return (height - h) // 2, (width - w) // 2, h, w


def resize_batch(images: list[torch.Tensor], boxes: list[tuple[int, int, int, int]], size: int) -> torch.Tensor:
    """(B, 3, size, size) float32 of each HWC uint8 image's box, bilinear at 2x then a 2x2 average (antialiased
    enough for the downscales of a random crop), in a few batched kernels on the current stream."""
    device = images[0].device
    heights = [t.shape[0] for t in images]
    widths = [t.shape[1] for t in images]
    hmax, wmax = max(heights), max(widths)
    if len(set(heights)) == 1 and len(set(widths)) == 1:
        padded = torch.stack(images)
    else:  # a smaller image gets its last row and column once more: a box's taps at its edge never read zeros
        padded = torch.zeros(len(images), hmax, wmax, 3, dtype=torch.uint8, device=device)
        for i, t in enumerate(images):
            h, w = t.shape[0], t.shape[1]
            padded[i, :h, :w] = t
            if h < hmax:
                padded[i, h, :w] = t[h - 1]
            if w < wmax:
                padded[i, :h, w] = t[:, w - 1]
            if h < hmax and w < wmax:
                padded[i, h, w] = t[h - 1, w - 1]
    x = padded.permute(0, 3, 1, 2).float()  # channels_last strides (fp16 grids lose a quarter pixel at 500 px)
    # the affine map from the output grid ([-1, 1]) to each box in the padded image's normalised coordinates
    b = torch.tensor(boxes, dtype=torch.float32)  # y0, x0, h, w
    theta = torch.zeros(len(images), 2, 3)
    theta[:, 0, 0] = b[:, 3] / wmax
    theta[:, 0, 2] = (2 * b[:, 1] + b[:, 3]) / wmax - 1
    theta[:, 1, 1] = b[:, 2] / hmax
    theta[:, 1, 2] = (2 * b[:, 0] + b[:, 2]) / hmax - 1
    theta = (theta.pin_memory() if device.type == "cuda" else theta).to(device, non_blocking=True)
    grid = F.affine_grid(theta, [len(images), 3, 2 * size, 2 * size], align_corners=False)
    big = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return F.avg_pool2d(big, 2)


class NvImgFeed:
    """Batches without end (random draws with a seed, or the shards read in a shuffled stream), made by a thread of
    the feed's own; ``close()`` stops it."""

    def __init__(self, urls: list[str], *, batch_size: int, image_size: int, device: torch.device, opts: dict,
                 seed: int = 0):
        from nvidia import nvimgcodec

        self.nv = nvimgcodec
        self.urls = urls
        self.from_stream = bool(opts.get("stream"))
        self.jpegs, self.labels = ([], []) if self.from_stream else read_samples(urls)
        self.batch_size, self.size, self.device, self.seed = batch_size, image_size, device, seed
        share = opts.get("hw", 0.0 if opts.get("gpu") else 1.0)
        backends = []
        if share > 0:
            backends.append(nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY, load_hint=share))
        if share < 1:
            backends.append(nvimgcodec.Backend(nvimgcodec.BackendKind.GPU_ONLY))
        self.decoder = make_decoder(nvimgcodec, device.index or 0, backends, batch_size)
        self.stream = torch.cuda.Stream(device, priority=0 if opts.get("prio0") else -1)
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
        self.ready: queue.Queue = queue.Queue(maxsize=opts.get("depth", 3))  # >= 1 (nvimg_options)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="nvimg-feed", daemon=True)
        self.thread.start()

    def _encoded(self, rng: random.Random):
        """(encoded images, labels) of each batch without end: random draws from memory, or read from the shards."""
        if not self.from_stream:
            while True:
                idx = [rng.randrange(len(self.jpegs)) for _ in range(self.batch_size)]
                yield [self.jpegs[i] for i in idx], [self.labels[i] for i in idx]
        from datapipe import ShardStream
        from datapipe.device.handoff import threaded
        from loaders.images.encoded import iter_raw_batches, parse_label
        from loaders.images.options import IMAGE_ENTRIES

        stream = ShardStream(self.urls, shuffle=True, shuffle_buffer=2000, seed=self.seed).replace(zero_copy=True)

        def raw_batches():
            epoch = 0
            while True:
                stream.set_epoch(epoch)
                yield from iter_raw_batches(iter(stream), batch_size=self.batch_size, drop_last=True,
                                            image_exts=IMAGE_ENTRIES, label_key="cls", label_decoder=parse_label,
                                            on_error=stream.on_error)
                epoch += 1

        reader = threaded(raw_batches(), depth=4, name="nvimg-reader")
        try:
            for raw in reader:
                yield raw.arrays, raw.labels
        finally:
            reader.close()  # its thread stops with the feed

    def _batch(self, rng: random.Random, encoded, labels, reuse):
        streams = [self.nv.CodeStream(data) for data in encoded]
        with torch.cuda.stream(self.stream):
            decoded = self.decoder.decode(streams, images=reuse, cuda_stream=self.stream.cuda_stream)
            if any(im is None for im in decoded):
                raise RuntimeError(f"nvimg feed: {sum(im is None for im in decoded)} of {len(decoded)} JPEGs "
                                   "could not be decoded")
            tensors = [torch.from_dlpack(im) for im in decoded]  # stream-ordered on this stream, no copy
            # boxes from the decoded sizes (EXIF orientation applied), not the stored ones
            boxes = [random_crop(rng, t.shape[0], t.shape[1]) for t in tensors]
            flips = torch.tensor([rng.random() < 0.5 for _ in encoded])
            out = resize_batch(tensors, boxes, self.size)
            flips = flips.pin_memory().to(self.device, non_blocking=True)
            out = torch.where(flips.view(-1, 1, 1, 1), out.flip(-1), out)
            out = (out - self.mean) / self.std
            labels = torch.tensor(labels).pin_memory().to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return decoded, (out, labels, done)

    def _run(self) -> None:
        rng = random.Random(self.seed)
        slots: list = [None] * (self.ready.maxsize + 2)  # decoded images reused, ring-wise (no allocation per batch)
        batches = self._encoded(rng)
        try:
            k = 0
            while not self.stopping.is_set():
                encoded, labels = next(batches)
                slots[k % len(slots)], item = self._batch(rng, encoded, labels, slots[k % len(slots)])
                k += 1
                while not self.stopping.is_set():
                    try:
                        self.ready.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self.ready.put(e)
        finally:
            batches.close()

    def __iter__(self):
        return self

    def __next__(self):
        deadline = time.monotonic() + NEXT_TIMEOUT_S
        while True:
            try:
                item = self.ready.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.thread.is_alive():
                    raise RuntimeError("nvimg feed: its thread ended") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nvimg feed: no batch in {NEXT_TIMEOUT_S:.0f} s") from None
        if isinstance(item, BaseException):
            raise item
        out, labels, done = item
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        out.record_stream(current)
        labels.record_stream(current)
        return out, labels

    def close(self) -> None:
        """Stop the thread; one stuck (in a decode, or waiting on the reader) is left behind after
        :data:`CLOSE_TIMEOUT_S` with a warning (a daemon: it cannot hold the run)."""
        self.stopping.set()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while self.thread.is_alive() and time.monotonic() < deadline:
            try:
                self.ready.get(timeout=0.1)
            except queue.Empty:
                pass
        if self.thread.is_alive():
            warnings.warn(f"nvimg feed: its thread did not stop in {CLOSE_TIMEOUT_S:.0f} s; left behind")


def make_decoder(nvimgcodec, device_id: int, backends: list, batch_size: int):
    """An ``nvimgcodec.Decoder`` whose hardware decoder preallocates for a batch of ~600 px images (else nvJPEG
    grows its buffers with ``cudaFree``, which waits for the whole device); without those options where this
    nvImageCodec does not take them."""
    hints = (f"nvjpeg_hw_decoder:preallocate_batch_size={batch_size} nvjpeg_hw_decoder:preallocate_width_hint=600 "
             "nvjpeg_hw_decoder:preallocate_height_hint=600")
    try:
        return nvimgcodec.Decoder(device_id=device_id, backends=backends, options=hints)
    except Exception as e:  # noqa: BLE001 - a probe: say so, and decode without the hints
        warnings.warn(f"nvimg feed: the decoder refused the preallocation hints ({e}); without them")
        return nvimgcodec.Decoder(device_id=device_id, backends=backends)


def nvimg_options(spec: str) -> dict:
    """``gpu+hw0.5+prio0+q4+stream`` -> options of the probe (see the module's docstring)."""
    opts: dict = {}
    for part in filter(None, spec.split("+")):
        if part in ("gpu", "prio0", "stream"):
            opts[part] = True
        elif part.startswith("hw"):
            opts["hw"] = float(part[2:])
        elif part.startswith("q") and part[1:].isdigit() and int(part[1:]) >= 1:
            opts["depth"] = int(part[1:])
        else:
            raise ValueError(f"nvimg: unknown option {part!r} (use gpu, hw<share>, prio0, q<depth>, stream)")
    return opts
