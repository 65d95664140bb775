"""``ImageLoader``'s rarer options in three frozen groups (as Grain groups its options): decode, augment, read.

``ImageLoader(source, *, batch_size, image_size, train, device, dtype, decode=DecodeOptions(...),
augment=AugmentOptions(...), read=ReadOptions(...))``. Each group checks its own values when it is
made (``ValueError`` naming the option and how to fix it); the order, shuffle, rank and error
settings belong to the source :class:`datapipe.ShardStream`, not here.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real
from typing import Callable

import torch

from datapipe.image_bytes import IMAGE_ENTRIES

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.uint8: "uint8"}
READERS = ("auto", "stream", "dali")


def _int(name: str, value, low: int, *, none: bool = False) -> None:
    if none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise ValueError(f"{name}={value!r}: pass an int >= {low}" + (" or None" if none else ""))


def _pair(name: str, value, low: float, high: float | None) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}: pass two numbers (low, high)") from None
    if not (low < lo <= hi and (high is None or hi <= high)):
        raise ValueError(f"{name}={value!r}: need {low} < low <= high" + (f" <= {high}" if high is not None else ""))
    return lo, hi


@dataclass(frozen=True)
class DecodeOptions:
    """What DALI makes of an encoded image, and where it decodes.

    Args:
        layout: ``"NCHW"`` (default) or ``"NHWC"``.
        mean, std: per-channel normalisation in 0..1 units (ImageNet's by default; ignored for
            ``dtype=torch.uint8``, which gives raw pixels).
        resize_size: eval (``train=False``) resizes the shorter side to this before the center crop
            (default: ``image_size``); must be >= ``image_size``.
        decode_device: ``None`` decodes where ``device`` is (``"gpu"`` on CUDA: nvImageCodec with the
            hardware JPEG decoder where present); ``"cpu"`` decodes, crops and flips on the CPU into
            uint8 and one kernel on ``device`` casts and normalises (keeps the GPU's SMs free).
        num_threads: DALI's CPU threads (default: up to 8; on nvJPEG's CUDA decoder alone 12, at most the
            cores minus 4; with ``decode_device="cpu"`` on CUDA the usable cores minus 2).
        hw_decoder_load: the share of JPEGs for the GPU's hardware decoder (the rest: nvJPEG's CUDA
            decoder). ``None`` (default): the loader chooses by the CUDA hardware queues: 0.75 with
            ``CUDA_DEVICE_MAX_CONNECTIONS=32``, else 0.0 (the CUDA decoder; the hardware decoder's streams
            stall beside training on 8 queues) where the process has 12 cores or more, trying 0.5 once
            if that starves the training loop (taken back only if the loop then runs clearly slower, under 0.95 of
            its rate before; under CUDA graphs 0.1, from a 2% shortfall), else 0.75; ``"auto"`` starts on the
            CUDA decoder (from 12 cores; fewer: 0.75) and tries the same way once the training loop is seen
            starved (0.75 with 32 queues; :mod:`loaders.images.decoder_choice`).
        antialias: DALI's low-pass filter when it shrinks (as torchvision's PIL path); ``False`` costs
            less GPU time, with a little more aliasing.
    """

    layout: str = "NCHW"
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    resize_size: int | None = None
    decode_device: str | None = None
    num_threads: int | None = None
    hw_decoder_load: float | str | None = None
    antialias: bool = True

    def __post_init__(self):
        if self.layout not in ("NCHW", "NHWC"):
            raise ValueError(f"layout={self.layout!r}: use 'NCHW' or 'NHWC'")
        try:
            mean, std = tuple(float(m) for m in self.mean), tuple(float(s) for s in self.std)
        except (TypeError, ValueError):
            raise ValueError("mean and std: pass 3 numbers each (RGB, in 0..1 units)") from None
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise ValueError("mean and std need 3 values (RGB, in 0..1 units), std > 0")
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)
        _int("resize_size", self.resize_size, 1, none=True)
        if self.decode_device not in (None, "gpu", "cpu"):
            raise ValueError(f"decode_device={self.decode_device!r}: use None (where device is), 'gpu' or 'cpu'")
        _int("num_threads", self.num_threads, 1, none=True)
        load = self.hw_decoder_load
        if load is not None and load != "auto":
            if isinstance(load, (str, bool)) or not isinstance(load, Real) or not 0.0 <= load <= 1.0:
                raise ValueError(f"hw_decoder_load={load!r}: use a share in [0, 1], 'auto' or None "
                                 "(the loader's choice)")
            object.__setattr__(self, "hw_decoder_load", float(load))
        object.__setattr__(self, "antialias", bool(self.antialias))


@dataclass(frozen=True)
class AugmentOptions:
    """Training augmentation (``train=True``): random-resized-crop ranges; a random horizontal flip is always on.

    Args:
        random_area: the crop's share of the image area, ``(low, high)`` in (0, 1].
        random_aspect_ratio: the crop's aspect ratio range, ``(low, high)``, > 0.
    """

    random_area: tuple[float, float] = (0.08, 1.0)
    random_aspect_ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def __post_init__(self):
        object.__setattr__(self, "random_area", _pair("random_area", self.random_area, 0.0, 1.0))
        object.__setattr__(self, "random_aspect_ratio", _pair("random_aspect_ratio", self.random_aspect_ratio,
                                                              0.0, None))


@dataclass(frozen=True)
class ReadOptions:
    """How encoded samples reach DALI and are batched: the reader, labels, image entries, read-ahead.

    Args:
        reader: ``"stream"`` reads with the ShardStream (every guarantee of it: any storage,
            ``on_error="skip"``, key labels, decode failures named); ``"dali"`` reads local shards with
            DALI's ``fn.readers.webdataset`` (faster; ``on_error="raise"`` only); ``"auto"`` (default)
            takes DALI's reader where it can (local shards, ``on_error="raise"``, a member label, no
            ``read_workers``, a stream without cache or per-sample steps).
        label_key: the entry holding the label (default ``"cls"``: an ASCII int); ``"__key__"`` with
            ``label_decoder=int`` labels samples by their keys.
        label_decoder: ``bytes -> int`` (default: parse an ASCII int).
        image_exts: the entries that hold the image, in the order they are looked for (the first one
            present is decoded); ``"jpg;png"`` as in webdataset works too. Default: every image type
            ``datapipe shard`` writes (:data:`datapipe.image_bytes.IMAGE_ENTRIES`: JPEG, PNG, WebP, BMP,
            TIFF, GIF, PNM). DALI decodes all but GIF, which the stream reader re-encodes as PNG first.
        read_workers: > 0 reads and batches in that many processes (stream reader).
        prefetch_queue_depth: finished batches made ahead of the training loop.
        drop_last: drop the last partial batch (default ``None``: the loader's ``train``).
        index_dir: where DALI's reader writes index files it is missing (default: a temp folder).
    """

    reader: str = "auto"
    label_key: str = "cls"
    label_decoder: Callable[[bytes], int] | None = None
    image_exts: tuple[str, ...] = IMAGE_ENTRIES
    read_workers: int = 0
    prefetch_queue_depth: int = 2
    drop_last: bool | None = None
    index_dir: str | None = None

    def __post_init__(self):
        if self.reader not in READERS:
            raise ValueError(f"reader={self.reader!r}: use 'auto', 'stream' or 'dali'")
        if not isinstance(self.label_key, str) or not self.label_key:
            raise ValueError(f"label_key={self.label_key!r}: pass the name of a sample entry, e.g. 'cls'")
        if self.label_decoder is not None and not callable(self.label_decoder):
            raise ValueError("label_decoder: pass a callable bytes -> int, or None")
        exts = (self.image_exts,) if isinstance(self.image_exts, str) else tuple(self.image_exts)
        exts = tuple(e for x in exts for e in x.split(";") if e)
        if not exts:
            raise ValueError("image_exts: name at least one entry, e.g. ('jpg', 'png')")
        object.__setattr__(self, "image_exts", exts)
        _int("read_workers", self.read_workers, 0)
        _int("prefetch_queue_depth", self.prefetch_queue_depth, 1)
        if self.drop_last is not None:
            object.__setattr__(self, "drop_last", bool(self.drop_last))


def image_device(device) -> torch.device:
    """``device`` checked as :func:`datapipe.device.prefetch.resolve_device` checks it: CUDA (present here) or CPU."""
    from datapipe.device.prefetch import resolve_device

    dev = resolve_device(device)
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}: ImageLoader runs on 'cuda', 'cuda:N' or 'cpu'")
    return dev


def dali_threads(asked: int | None, *, host_decode: bool, cuda: bool) -> int:
    """DALI's CPU threads: as asked, else the usable cores minus 2 for CPU decoding on CUDA, else up to 8."""
    if asked is not None:
        return int(asked)
    from datapipe.device.autotune import usable_cores

    if host_decode and cuda:
        return max(1, usable_cores() - 2)  # one core each for the training and producer threads
    return max(1, min(8, usable_cores()))
