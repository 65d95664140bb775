"""``ImageLoader``'s options in three frozen groups (as Grain does): how to read, decode and augment.

``ImageLoader`` takes them as plain keyword arguments and builds these; each group checks its own
values (``ValueError`` naming the argument).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from datapipe.device.pacing import check_pace
from datapipe.device.side_stream import check_ready
from datapipe.errors import OnError, check_on_error

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.uint8: "uint8"}
READERS = ("auto", "stream", "dali")
# The producer starts its next batch 70% into the training step (while one is still queued), not
# the DevicePrefetcher's 50%: DALI's work is then launched after the step's own kernels.
# bench/results/ceiling_hw0_pace07.json and ceiling_retire_experiment.json: 0.975-0.978 of the
# ceiling vs 0.963-0.969 at 0.5; TokenLoader measured better at 0.5 (0.999 vs 0.985).
PACE = 0.7
# How the training thread gets a finished batch (datapipe.device.side_stream): "event", its stream
# waits on the batch's event. "host" (the producer thread waits and records the retire fences; next()
# makes no CUDA call) led in three interleaved H200 runs (+0.0016 +- 0.0011) but not over all six
# (bench/results/ceiling_hostready_pooled.json: +0.0006 +- 0.0018; 0.968 in two rows of one run).
READY = "event"


@dataclass(frozen=True)
class DecodeOptions:
    """What DALI makes of an encoded image: size, dtype, layout, normalisation, where it decodes."""

    image_size: int = 224
    resize_size: int | None = None
    dtype: torch.dtype = torch.float32
    layout: str = "NCHW"
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    decode_device: str = "gpu"  # resolved: "gpu" or "cpu"
    host_decode: bool = False  # decode_device="cpu" asked for: uint8 HWC on the host, normalised in torch
    num_threads: int = 1
    hw_decoder_load: float | str = 0.75  # a share in [0, 1], or "auto" (loaders.images.decoder_choice)
    antialias: bool = True  # DALI's resize low-pass filters when it shrinks (costs GPU time)

    def __post_init__(self):
        if self.image_size < 1 or (self.resize_size is not None and self.resize_size < self.image_size):
            raise ValueError("image_size must be >= 1 and resize_size (if given) >= image_size")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype}")
        if self.layout not in ("NCHW", "NHWC"):
            raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {self.layout!r}")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError("mean and std need 3 values (RGB, in 0..1 units), std > 0")
        if self.hw_decoder_load != "auto" and (isinstance(self.hw_decoder_load, str)
                                               or not 0.0 <= self.hw_decoder_load <= 1.0):
            raise ValueError(f"hw_decoder_load must be 'auto' or in [0, 1], got {self.hw_decoder_load!r}")

    @staticmethod
    def resolve(device: torch.device, decode_device: str | None, num_threads: int | None) -> dict:
        """``decode_device``, ``host_decode`` and ``num_threads`` as the loader uses them (defaults filled)."""
        if decode_device not in (None, "gpu", "cpu"):
            raise ValueError(f"decode_device must be None, 'gpu' or 'cpu', got {decode_device!r}")
        if decode_device == "gpu" and device.type != "cuda":
            raise ValueError("decode_device='gpu' needs device='cuda'")
        host_decode = decode_device == "cpu"
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if num_threads is None and host_decode and device.type == "cuda":
            from datapipe.device.autotune import usable_cores

            num_threads = max(1, usable_cores() - 2)  # one core each for the training and producer threads
        return {"decode_device": decode_device or ("gpu" if device.type == "cuda" else "cpu"),
                "host_decode": host_decode,
                "num_threads": int(num_threads or max(1, min(8, os.cpu_count() or 1)))}


@dataclass(frozen=True)
class AugmentOptions:
    """Training augmentation: random-resized-crop ranges (flip is always on with ``train``)."""

    train: bool = True
    random_area: tuple[float, ...] = (0.08, 1.0)
    random_aspect_ratio: tuple[float, ...] = (3 / 4, 4 / 3)


@dataclass(frozen=True)
class ReadOptions:
    """Where samples come from and how they are batched: reader, order, errors, labels, workers."""

    reader: str = "auto"  # as asked; ImageLoader.reader holds the one chosen
    seed: int = 0
    shuffle: bool = True
    shuffle_buffer: int = 2000  # 0 without shuffle
    on_error: OnError = "raise"
    label_key: str = "cls"
    label_decoder: Callable[[bytes], int] | None = None
    image_exts: tuple[str, ...] = ("jpg", "jpeg", "png")
    read_workers: int = 0
    prefetch_queue_depth: int = 2
    pace: float | None = PACE  # how far into the training step the producer starts the next batch
    ready: str = READY  # how the training thread gets a finished batch's GPU work
    drop_last: bool = True
    index_dir: str | None = None
    stream_options: dict = field(default_factory=dict)

    def __post_init__(self):
        check_on_error(self.on_error)
        if self.reader not in READERS:
            raise ValueError(f"reader must be 'auto', 'stream' or 'dali', got {self.reader!r}")
        if self.prefetch_queue_depth < 1:
            raise ValueError(f"prefetch_queue_depth must be >= 1, got {self.prefetch_queue_depth}")
        if self.read_workers < 0:
            raise ValueError(f"read_workers must be >= 0, got {self.read_workers}")
        object.__setattr__(self, "pace", check_pace(self.pace))  # 0 reads back as None (off), as elsewhere
        check_ready(self.ready)
