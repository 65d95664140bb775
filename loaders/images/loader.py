"""``ImageLoader``: WebDataset image shards -> DALI decode + augment -> ``(images, labels)`` on the device.

Samples come from :class:`datapipe.ShardStream` (any storage, rank/epoch shuffling, resume,
``on_error``), read and checked in a background thread, and enter DALI through
``fn.external_source`` as zero-copy uint8 arrays. ``device="cuda"`` decodes with nvImageCodec
(``mixed``, hardware JPEG decoder where present) and augments on the GPU; ``device="cpu"`` runs
the same graph with CPU operators. DALI's own ``fn.readers.webdataset`` reads local shards
instead when it can (``reader="auto"``: faster, fewer guarantees; see :class:`ImageLoader`). A producer
thread drives DALI ahead of the training loop (:mod:`datapipe.device.handoff`).
"""
from __future__ import annotations

import base64
import hashlib
import logging
import math
import os
import re
import tempfile
import time
from collections import deque
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from datapipe.errors import DataError
from datapipe.device.handoff import on_side_stream, started, threaded
from loaders.images.encoded import EncodedBatches, RawBatch, handle_bad, iter_raw_batches, keep, parse_label, \
    parse_ascii_ints

log = logging.getLogger("loaders.images.loader")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.uint8: "uint8"}
_ON_ERROR = ("raise", "skip", "warn")


def _reader_error(error: RuntimeError, paths: list[str], batch: int) -> DataError:
    """DALI's reader failed (an image it cannot decode, a broken shard): a DataError with what DALI said.

    DALI names the sample when its decoder fails ("Failed to decode sample #3 : shard.tar:OFFSET:KEY.jpg"):
    then the error carries that shard and key.
    """
    lines = [m.strip() for m in str(error).splitlines() if m.strip()]
    for line in lines:
        m = re.search(r"Failed to decode sample #\d+ : (.+):\d+:([^/:]+)$", line)
        if m:
            key = m.group(2).split(".", 1)[0]
            return DataError(f"cannot decode image (DALI's reader, batch {batch} of the epoch): {line[:200]}",
                             url=m.group(1), key=key)
    for line in lines:
        m = re.search(r"Underful sample detected at index file", line)
        if m:  # DALI's words for a sample that lacks one of the extensions the reader asks for
            shards = paths[0] if len(paths) == 1 else f"{len(paths)} shards ({paths[0]} ...)"
            return DataError("DALI's reader failed: a sample has no image or no label file of the extensions it "
                             "asks for: do these shards hold images? `datapipe inspect` lists their extensions "
                             f"(reading {shards})")
    detail = next((m for m in lines if any(w in m for w in ("failure", "rror:", "Invalid", "detected"))),
                  lines[-1] if lines else "")
    shards = paths[0] if len(paths) == 1 else f"{len(paths)} shards ({paths[0]} ...)"
    return DataError(f"DALI's reader failed in batch {batch} of the epoch: {detail[:200]} (reading {shards}; "
                     "reader='stream' names the sample and on_error='skip' skips it)")


class _Feed:
    """The external source of the stream reader's pipeline: the current epoch's raw batches.

    A DataError raised while reading is kept and re-raised once the batches already inside DALI
    are out; DALI itself just sees the end of the epoch.
    """

    def __init__(self, seconds: dict):
        self.seconds = seconds  # "read": time spent waiting for the reader
        self.start(iter(()))

    def start(self, raw_batches) -> None:
        self.raw = raw_batches
        self.fifo: deque[RawBatch] = deque()
        self.failure: list[BaseException] = []

    def __call__(self):
        t0 = time.perf_counter()
        try:
            raw = next(self.raw)
        except StopIteration:
            raise
        except BaseException as e:
            self.failure.append(e)
            raise StopIteration from None
        finally:
            self.seconds["read"] += time.perf_counter() - t0
        self.fifo.append(raw)
        return raw.arrays


def _dali_seed(seed: int, epoch: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, epoch, rank, 0xDA11]).generate_state(1)[0] % (2**31 - 1))


class ImageLoader:
    """Batches ``(images, labels)`` of decoded, augmented images from WebDataset shards, on ``device``.

    ``train=True``: random-resized-crop (``random_area``, ``random_aspect_ratio``) fused into
    decoding, resize to ``image_size``, random horizontal flip, normalise. ``train=False``: resize
    the shorter side to ``resize_size`` (default ``image_size``), center crop ``image_size``,
    normalise, shard order. Images are ``dtype`` (float32, float16, bfloat16 or uint8 = raw
    pixels, not normalised) in ``layout`` ``"NCHW"`` or ``"NHWC"``; labels int64 from
    ``label_key`` (ASCII int, or ``label_decoder(bytes)``).

    Errors: samples without an image, with a wrong signature or an undecodable label, and images
    DALI fails to decode are raised as :class:`DataError` (``on_error="raise"``) or dropped and
    counted in ``stats()`` (``"skip"``; ``"warn"`` also logs). A batch that lost images to a decode
    error comes out smaller.

    ``reader="stream"`` reads with ShardStream: every guarantee of it holds (any storage,
    ``on_error="skip"``, key labels). ``reader="dali"`` reads local shards with DALI's
    ``fn.readers.webdataset`` and index files (``index_dir``, made there when missing): no
    ``on_error="skip"``, DALI's buffer shuffle, contiguous per-rank partitions
    (``ceil(N / world_size)`` samples each; the last batch of a short rank repeats a sample);
    decode failures become DataErrors naming the shard and key. ``"auto"`` (default) takes DALI's
    reader where it can (local shards, ``on_error="raise"``, a member label, no ``read_workers``):
    it measured faster and with far less Python work per batch (README). Both resume exactly
    (``state_dict``; for DALI's reader a pipeline checkpoint of reader positions and random states).
    Both readers keep one DALI pipeline for all epochs (building one takes seconds), driven by a
    producer thread ``prefetch_queue_depth`` finished batches ahead: on CUDA it shares DALI's
    outputs with torch (DLPack) on a side stream and hands them over with an event, so the
    training thread's ``next()`` only takes a batch off a queue. ``stats()["seconds"]``: ``wait``
    (the consumer's time in ``next()``) and the producer's ``read`` (waiting for the stream
    reader), ``dali`` (waiting for DALI's outputs), ``copy`` (outputs to torch tensors, labels).

    ``read_workers > 0`` (stream reader) reads and batches the shards in that many processes and
    hands DALI views of shared-memory batches; with ``drop_last`` each worker drops its own
    partial last batch.

    ``decode_device="cpu"`` with ``device="cuda"`` keeps the loader's work off the GPU's SMs:
    DALI decodes (random-crop ROI decoding), resizes and flips on the CPU with ``num_threads``
    (default: the usable cores minus 2) into uint8 HWC; the batch goes through reused pinned
    buffers to the GPU on the producer's side stream, and one kernel there does the permute, the
    cast and the normalisation (none with ``dtype=torch.uint8``). It needs the CPU cores to keep
    up (README). Default ``None``: decode where ``device`` is (``"gpu"`` on CUDA, nvImageCodec);
    ``"cpu"`` with ``device="cpu"`` gives the same images through the same uint8 path.
    """

    def __init__(
        self,
        urls: str | list[str],
        *,
        batch_size: int,
        image_size: int = 224,
        train: bool = True,
        device: str | torch.device = "cuda",
        dtype: torch.dtype = torch.float32,
        layout: str = "NCHW",
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        seed: int = 0,
        shuffle: bool | None = None,
        shuffle_buffer: int = 2000,
        rank: int | None = None,
        world_size: int | None = None,
        on_error: str = "raise",
        label_key: str = "cls",
        label_decoder: Callable[[bytes], int] | None = None,
        image_key: str = "jpg;jpeg;png",
        num_threads: int | None = None,
        read_workers: int = 0,
        prefetch_queue_depth: int = 2,
        hw_decoder_load: float = 0.75,
        drop_last: bool | None = None,
        reader: str = "auto",
        random_area: Sequence[float] = (0.08, 1.0),
        random_aspect_ratio: Sequence[float] = (3 / 4, 4 / 3),
        resize_size: int | None = None,
        index_dir: str | None = None,
        stream_options: dict | None = None,
        decode_device: str | None = None,
    ):
        device = torch.device(device)
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if image_size < 1 or (resize_size is not None and resize_size < image_size):
            raise ValueError("image_size must be >= 1 and resize_size (if given) >= image_size")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
        if layout not in ("NCHW", "NHWC"):
            raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise ValueError("mean and std need 3 values (RGB, in 0..1 units), std > 0")
        if on_error not in _ON_ERROR:
            raise ValueError(f"on_error must be one of {_ON_ERROR}, got {on_error!r}")
        if reader not in ("auto", "stream", "dali"):
            raise ValueError(f"reader must be 'auto', 'stream' or 'dali', got {reader!r}")
        if not 0.0 <= hw_decoder_load <= 1.0:
            raise ValueError(f"hw_decoder_load must be in [0, 1], got {hw_decoder_load}")
        if prefetch_queue_depth < 1:
            raise ValueError(f"prefetch_queue_depth must be >= 1, got {prefetch_queue_depth}")
        if decode_device not in (None, "gpu", "cpu"):
            raise ValueError(f"decode_device must be None, 'gpu' or 'cpu', got {decode_device!r}")
        if decode_device == "gpu" and device.type != "cuda":
            raise ValueError("decode_device='gpu' needs device='cuda'")
        self.decode_device = decode_device or ("gpu" if device.type == "cuda" else "cpu")
        # decode on the host into uint8 HWC, deliver (pinned copy) and normalise in torch
        self._host_decode = decode_device == "cpu"
        self._pinned = None  # the pinned staging buffers of that path (datapipe.device.prefetch's pool)
        self._affine: tuple | None = None  # its (shift, scale) per channel, on the device
        self.batch_size = int(batch_size)
        self.image_size = int(image_size)
        self.train = bool(train)
        self.device = device
        self.dtype = dtype
        self.layout = layout
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.seed = int(seed)
        self.shuffle = self.train if shuffle is None else bool(shuffle)
        self.shuffle_buffer = int(shuffle_buffer) if self.shuffle else 0
        self.on_error = on_error
        self.label_key = label_key
        self.label_decoder = label_decoder or parse_label
        self.image_exts = tuple(e for e in image_key.split(";") if e)
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if num_threads is None and self._host_decode and device.type == "cuda":
            from datapipe.device.autotune import usable_cores

            num_threads = max(1, usable_cores() - 2)  # one core each for the training and producer threads
        self.num_threads = int(num_threads or max(1, min(8, os.cpu_count() or 1)))
        if read_workers < 0:
            raise ValueError(f"read_workers must be >= 0, got {read_workers}")
        self.read_workers = int(read_workers)
        self._reader_loader = None  # the worker processes' loader (read_workers > 0)
        self._reader_resume: dict | None = None
        self.prefetch_queue_depth = int(prefetch_queue_depth)
        self.hw_decoder_load = float(hw_decoder_load)
        self.drop_last = self.train if drop_last is None else bool(drop_last)
        self.random_area = tuple(random_area)
        self.random_aspect_ratio = tuple(random_aspect_ratio)
        self.resize_size = resize_size
        self.index_dir = index_dir
        self.epoch = 0
        self._stats = {"batches": 0, "samples": 0, "skipped": 0, "decode_errors": 0, "last_errors": []}
        self._seconds = {"wait": 0.0, "read": 0.0, "dali": 0.0, "copy": 0.0}
        self._delivered: dict | None = None
        self._global: dict | None = None  # a global state loaded, until a batch is handed out after it
        self._resumed = False
        self._probe = None
        self._dali_pipe = None  # the DALI pipeline of reader="dali", reused across epochs
        self._dali_batch = 0  # batches of this epoch made by the DALI reader
        self._dali_handed: dict | None = None  # DALI reader state after the last batch handed out
        self._dali_resume: dict | None = None  # {"checkpoint", "batch"} to restore on the next iteration
        self._stream_pipe = None  # the DALI pipeline of reader="stream", reused across epochs
        self._feed = _Feed(self._seconds)
        self._side_stream = None  # the producer's CUDA stream, the same every epoch

        self._stream_options = dict(stream_options or {})
        from datapipe.stream import ShardStream

        self.stream = ShardStream(urls, shuffle=self.shuffle, seed=self.seed, shuffle_buffer=self.shuffle_buffer,
                                  rank=rank, world_size=world_size, on_error=on_error,
                                  **{"zero_copy": True, **(stream_options or {})})  # DALI reads the mapped bytes
        self.reader = self._choose_reader(reader)

    # ---- configuration ------------------------------------------------------------------------
    def _choose_reader(self, reader: str) -> str:
        from datapipe.storage.urls import is_local

        dali_ok = all(is_local(u) for u in self.stream.urls) and self.on_error == "raise"
        if reader == "dali" and not dali_ok:
            raise ValueError("reader='dali' needs local shards and on_error='raise'; use reader='stream'")
        if reader == "auto":  # DALI's reader: faster and less GIL work than feeding DALI from Python (README)
            plain = not (self.label_key.startswith("__") or self.read_workers or self._stream_options)
            return "dali" if dali_ok and plain else "stream"
        return reader

    @property
    def _dali_cuda(self) -> bool:
        """The DALI pipeline runs on the GPU (decode_device 'gpu')."""
        return self.device.type == "cuda" and not self._host_decode

    def _rank_world(self) -> tuple[int, int]:
        return self.stream._rank_world()

    def _pipeline(self, *, source=None, reader=None, batch_size=None, depth=None, seed=None, checkpoint=None):
        from loaders.images.dali_pipeline import build_image_pipeline

        rank, _ = self._rank_world()
        return build_image_pipeline(
            batch_size=batch_size or self.batch_size, image_size=self.image_size, train=self.train,
            device="cuda" if self._dali_cuda else "cpu", device_id=self.device.index or 0 if self._dali_cuda else None,
            dtype="uint8" if self._host_decode else _DTYPES[self.dtype],
            layout="NHWC" if self._host_decode else self.layout,
            mean=[m * 255 for m in self.mean], std=[s * 255 for s in self.std],
            seed=_dali_seed(self.seed, self.epoch, rank) if seed is None else seed,
            num_threads=self.num_threads, prefetch_queue_depth=depth or self.prefetch_queue_depth,
            hw_decoder_load=self.hw_decoder_load, random_area=self.random_area,
            random_aspect_ratio=self.random_aspect_ratio, resize_size=self.resize_size,
            source=source, reader=reader, enable_checkpointing=reader is not None, checkpoint=checkpoint,
            pad_labels=self.label_decoder is parse_label,
        )

    # ---- epochs, length, state ----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (shuffle order and augmentation seed) of the next iteration."""
        self.epoch = int(epoch)
        self.stream.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches per epoch on this rank (exact unless samples are skipped)."""
        n = len(self.stream)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Position after the last batch handed out (read-ahead is not counted)."""
        if self._global is not None and self._delivered is None:
            return self._global  # loaded, nothing handed out since
        if self.read_workers and self.reader == "stream":
            loader = self._delivered if self._delivered is not None else None
            return {"epoch": self.epoch, "reader": self.reader, "stream": None, "loader": loader,
                    "batches": self._stats["batches"]}
        stream = self._delivered if self._delivered is not None else self.stream.state_dict()
        state = {"epoch": self.epoch, "reader": self.reader, "stream": stream, "batches": self._stats["batches"]}
        if self.reader == "dali":
            state["dali"] = self._dali_handed  # a pipeline checkpoint + batches of this epoch handed out
        return state

    def global_state_dict(self) -> dict[str, Any]:
        """The state of the whole job: every rank's ``state_dict()``, gathered (``datapipe.order.elastic``).

        A collective under torch.distributed (every rank calls it at the same step); without it this
        process must be the whole job. ``load_state_dict`` resumes it on any ``world_size`` (and
        ``read_workers``) with ``reader="stream"``; a DALI-reader state resumes on the same
        ``world_size`` only.
        """
        from datapipe.order import elastic

        return elastic.gather_state(self.state_dict())

    def _load_global(self, state: dict[str, Any]) -> None:
        from datapipe.order import elastic

        ranks = state["ranks"]
        readers = {r.get("reader") for r in ranks}
        if readers != {self.reader}:
            raise ValueError(f"this state was saved with reader={sorted(map(str, readers))}, this loader has "
                             f"reader={self.reader!r}")
        rank, world = self._rank_world()
        if self.reader == "dali":
            if world != state["world_size"]:
                raise ValueError(
                    f"a DALI-reader state (reader='dali', or 'auto' on local shards) taken on world_size="
                    f"{state['world_size']} cannot resume on world_size={world}: DALI's reader shuffles inside "
                    "DALI, so its checkpoint does not say which samples were delivered. Resume on the same "
                    "world_size, or use reader='stream' for elastic jobs (it resumes on any shape).")
            self.load_state_dict(ranks[rank])
            return
        if "loader" in ranks[0]:
            if ("loader" in ranks[0]) != bool(self.read_workers):
                raise ValueError("this state was saved with a different read_workers setting (0 vs > 0)")
            loaders = [r["loader"] for r in ranks]
            if any(s is None for s in loaders):
                raise ValueError("some ranks of this global state had handed out no batch: take it after a step "
                                 "every rank has reached")
            self._reader_resume = elastic.merge_states(loaders)
            self._delivered = None
        else:
            if self.read_workers:
                raise ValueError("this state was saved with a different read_workers setting (0 vs > 0)")
            self.stream.load_state_dict(elastic.merge_states([r["stream"] for r in ranks]))
            self._delivered = None
        self.epoch = int(state["epoch"])
        self._global = state
        self._resumed = True

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Resume: the next iteration yields exactly the batches the saved run had not yet handed out.

        ``state``: this rank's ``state_dict()``, or a global state (``global_state_dict()``, or the
        list of every rank's ``state_dict()``): on the same shape each rank takes its own state
        back (exact); with ``reader="stream"`` another ``world_size`` / ``read_workers`` plans the
        epoch's undelivered samples over the new shape (``datapipe.order.elastic``).
        """
        from datapipe.order import elastic

        self._global = None
        if isinstance(state, (list, tuple)):
            state = elastic.merge_states(list(state))
        if elastic.is_global(state):
            self._load_global(state)
            return
        if "stream" not in state or "epoch" not in state:
            raise ValueError("not an ImageLoader state: needs 'epoch' and 'stream' entries")
        if ("loader" in state) != bool(self.read_workers and self.reader == "stream"):
            raise ValueError("this state was saved with a different read_workers setting (0 vs > 0)")
        if "loader" in state:
            self.epoch = int(state["epoch"])
            self._reader_resume = state["loader"]
            self._delivered = state["loader"]
            self._resumed = True
            return
        if (state.get("reader") == "dali") != (self.reader == "dali"):
            raise ValueError(f"this state was saved with reader={state.get('reader')!r}, this loader has "
                             f"reader={self.reader!r}")
        if self.reader == "dali":
            self._dali_resume = self._dali_handed = state["dali"]
            self._dali_pipe = None
        self.stream.load_state_dict(state["stream"])
        self.epoch = int(state["epoch"])
        self._delivered = state["stream"]
        self._resumed = True

    def stats(self) -> dict[str, Any]:
        """Batches and samples handed out, samples skipped (here and in the stream), decode errors."""
        stream = self.stream.stats()
        out = {k: v for k, v in self._stats.items() if k != "last_errors"}
        out["skipped"] = self._stats["skipped"] + stream.get("skipped", 0)
        out["last_errors"] = (stream.get("last_errors", []) + self._stats["last_errors"])[-10:]
        out["stream"] = stream
        out["seconds"] = {k: round(v, 4) for k, v in self._seconds.items()}
        return out

    # ---- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not self._resumed:
            self.stream.set_epoch(self.epoch)
            self._global = None
        self._resumed = False
        self._delivered = None
        produce = self._iter_dali_reader() if self.reader == "dali" else self._iter_stream(self._raw_batches())
        return self._handout(produce)

    def _handout(self, produce) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches made ahead in a producer thread (DALI driven, on a side stream).

        The training thread's ``next()`` only takes a finished batch off a queue; counters and the
        resume position advance here, when a batch is handed out, not when it is made.
        """
        seconds = self._seconds
        if self.device.type == "cuda" and self._side_stream is None:  # one for all epochs (see on_side_stream)
            self._side_stream = torch.cuda.Stream(self.device)
        items = on_side_stream(produce, device=self.device, depth=self.prefetch_queue_depth, stream=self._side_stream)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    (images, labels), state = next(items)
                except StopIteration:
                    return
                finally:
                    seconds["wait"] += time.perf_counter() - t0
                self._stats["batches"] += 1
                self._stats["samples"] += len(labels)
                if state.get("stream") is not None:
                    self._delivered = state["stream"]
                if state.get("dali") is not None:
                    self._dali_handed = state["dali"]
                yield images, labels
        finally:
            items.close()

    def _raw_batches(self) -> Iterator[RawBatch]:
        if self.read_workers:
            return started(self._worker_raw_batches())  # the workers fork now, from this thread
        raw = iter_raw_batches(iter(self.stream), batch_size=self.batch_size, drop_last=self.drop_last,
                               image_exts=self.image_exts, label_key=self.label_key,
                               label_decoder=self.label_decoder, on_error=self.on_error, stats=self._stats,
                               state_fn=self.stream.state_dict)
        return threaded(raw, depth=self.prefetch_queue_depth + 1, name="ImageLoader-reader")

    def _iter_stream(self, raw_batches) -> Iterator:
        """(Producer thread) raw batches -> DALI -> ``((images, labels), {"stream": state})``."""
        feed = self._feed
        feed.start(raw_batches)
        # one DALI pipeline serves every epoch (building one costs seconds); an epoch left unfinished
        # leaves batches in flight in it, so the next epoch builds a fresh one
        if self._stream_pipe is None:
            self._stream_pipe = self._pipeline(source=feed)
            self._stream_pipe.build()
        else:
            self._stream_pipe.reset()
        pipe = self._stream_pipe
        finished = False
        stream = torch.cuda.current_stream(self.device) if self._dali_cuda else None
        seconds = self._seconds
        try:
            while True:
                t0, read0 = time.perf_counter(), seconds["read"]
                try:
                    outputs = pipe.run(stream)
                except StopIteration:
                    break
                except RuntimeError as e:
                    if feed.failure or not feed.fifo:
                        raise
                    raw = feed.fifo.popleft()
                    images, raw = self._recover(raw, e)
                    if images is None:
                        continue
                else:
                    t1 = time.perf_counter()
                    seconds["dali"] += t1 - t0 - (seconds["read"] - read0)  # the feed's wait is "read"
                    raw = feed.fifo.popleft()
                    images = self._to_torch(outputs[0], stream, zero_copy=pipe.exec_dynamic)
                    seconds["copy"] += time.perf_counter() - t1
                yield self._prepare(images, raw.labels), {"stream": raw.state}
            finished = True
            if feed.failure:
                raise feed.failure[0]
        finally:
            raw_batches.close()
            if (not finished or feed.failure) and self._stream_pipe is pipe:
                self._stream_pipe = None

    def _worker_raw_batches(self) -> Iterator[RawBatch]:
        """Raw batches read in ``read_workers`` processes (no GIL shared with the training loop).

        Each worker reads its part of the shards and sends a batch as one uint8 tensor of the
        encoded images plus offsets (shared memory, no pickled bytes); the arrays DALI gets are
        views into it. Runs in the thread that iterates, so the workers fork from it.
        """
        from loaders.dataloader import DataLoader

        if self._reader_loader is None:
            dataset = EncodedBatches(self.stream, batch_size=self.batch_size, drop_last=self.drop_last,
                                      image_exts=self.image_exts, label_key=self.label_key,
                                      label_decoder=self.label_decoder, on_error=self.on_error)
            self._reader_loader = DataLoader(dataset, batch_size=None, num_workers=self.read_workers,
                                             collate_fn=keep, prefetch_factor=max(2, self.prefetch_queue_depth))
        loader = self._reader_loader
        if self._reader_resume is not None:
            loader.load_state_dict(self._reader_resume)
            self._reader_resume = None
        else:
            loader.set_epoch(self.epoch)
        it = iter(loader)
        try:
            for packed in it:
                self._stats["skipped"] += packed["skipped"]
                if packed["errors"]:
                    self._stats["last_errors"] = (self._stats["last_errors"] + packed["errors"])[-10:]
                data = packed["data"].numpy()
                bounds = packed["offsets"].tolist()
                raw = RawBatch(arrays=[data[a:b] for a, b in zip(bounds[:-1], bounds[1:])],
                               labels=packed["labels"].tolist(), keys=packed["keys"], urls=packed["urls"],
                               state=loader.state_dict())
                raw.owner = packed["data"]
                yield raw
        finally:
            it.close()

    def _prepare(self, images: torch.Tensor, labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(Producer thread) labels to the device, bfloat16 cast: enqueued on the producer's stream."""
        out = torch.tensor(labels, dtype=torch.int64)
        if self.device.type == "cuda":
            out = out.pin_memory().to(self.device, non_blocking=True)
        if self._host_decode:
            return self._from_host(images), out
        if self.dtype == torch.bfloat16:
            images = images.to(torch.bfloat16)
        return images, out

    def _from_host(self, images: torch.Tensor) -> torch.Tensor:
        """(Producer thread) decode_device='cpu': uint8 NHWC on the host -> ``dtype``/``layout`` on the device.

        The copy goes through datapipe.device.prefetch's pool of pinned buffers on the producer's side
        stream; then one kernel (``addcmul``: uint8 in, ``dtype`` out) permutes, casts and normalises.
        """
        if self.device.type == "cuda":
            from datapipe.device.prefetch import _CudaTransfer, _PinnedPool

            if self._pinned is None:
                self._pinned = _PinnedPool(per_key=self.prefetch_queue_depth + 2, max_bytes=None)
            transfer = _CudaTransfer(self.device, torch.cuda.current_stream(self.device), self._pinned)
            images, _ = transfer(images)
        if self.layout == "NCHW":
            images = images.permute(0, 3, 1, 2)  # a view; the kernel below writes contiguous NCHW
        if self.dtype == torch.uint8:
            return images.contiguous()
        if self._affine is None or self._affine[0].device != images.device:
            shape = (1, 3, 1, 1) if self.layout == "NCHW" else (3,)
            scale = torch.tensor([1 / (255 * s) for s in self.std], dtype=torch.float32).view(shape)
            shift = torch.tensor([-m / s for m, s in zip(self.mean, self.std)], dtype=torch.float32).view(shape)
            self._affine = (shift.to(images.device), scale.to(images.device))
        shift, scale = self._affine
        out = torch.empty(images.shape, dtype=self.dtype, device=images.device)
        return torch.addcmul(shift, images, scale, out=out)  # (x / 255 - mean) / std

    def _to_torch(self, tensor_list, stream, *, zero_copy: bool = True) -> torch.Tensor:
        """A DALI output as a torch tensor: shared through DLPack (no copy), or copied.

        DALI's default (dynamic) executor allocates every output anew and keeps it alive while
        referenced, so the tensor can share its memory (DALI's own PyTorch iterator does the
        same); the legacy executors recycle output buffers, which must be copied out.
        """
        from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

        t = tensor_list.as_tensor()
        if zero_copy:
            if self._dali_cuda:
                with torch.cuda.device(self.device):
                    return torch.from_dlpack(t)  # ordered after DALI's work on the current stream
            return torch.from_dlpack(t)
        out = torch.empty(t.shape(), dtype=to_torch_type[t.dtype], device=self.device if self._dali_cuda else "cpu")
        feed_ndarray(t, out, cuda_stream=stream)
        return out

    def _recover(self, raw: RawBatch, error: BaseException):
        """A batch DALI could not decode: decode its images one by one, find the bad ones, apply on_error."""
        if self._probe is None:
            self._probe = self._pipeline(batch_size=1, depth=1, seed=_dali_seed(self.seed, self.epoch, 7))
            self._probe.build()
        stream = torch.cuda.current_stream(self.device) if self._dali_cuda else None
        good, keep = [], RawBatch(state=raw.state)
        for arr, label, key, url in zip(raw.arrays, raw.labels, raw.keys, raw.urls):
            try:
                (out,) = self._probe.run(stream, jpegs=[arr])
            except RuntimeError as e:
                self._stats["decode_errors"] += 1
                msg = str(e).strip().splitlines()
                detail = next((m for m in msg if "rror" in m and "pipeline" not in m), msg[-1] if msg else "")
                handle_bad(DataError(f"cannot decode image: {detail.strip()[:200]}", url=url, key=key),
                            self.on_error, self._stats)
                continue
            good.append(self._to_torch(out, stream, zero_copy=self._probe.exec_dynamic))
            keep.arrays.append(arr)
            keep.labels.append(label)
            keep.keys.append(key)
            keep.urls.append(url)
        if len(good) == len(raw.arrays):
            raise error  # not a per-image problem
        if raw.state is not None:
            self._delivered = raw.state
        if not good:
            return None, keep
        return torch.cat(good), keep

    # ---- DALI's own reader --------------------------------------------------------------------
    def _index_paths(self, paths: list[str]) -> list[str]:
        from datapipe.tar.dali_index import default_index_path, write_dali_index

        out = []
        for path in paths:
            beside = default_index_path(path)
            if os.path.exists(beside) and os.path.getmtime(beside) >= os.path.getmtime(path):
                out.append(beside)
                continue
            directory = self.index_dir or os.path.join(tempfile.gettempdir(), "datapipe-dali-index")
            st = os.stat(path)
            tag = hashlib.sha1(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
            target = os.path.join(directory, f"{os.path.basename(path)}.{tag}.idx")
            if not os.path.exists(target):
                os.makedirs(directory, exist_ok=True)
                write_dali_index(path, target)
            out.append(target)
        return out

    def _reader_labels(self, labels_tl, n: int) -> list[int]:
        """The first ``n`` labels of a DALI reader batch (ASCII ints parsed in one numpy pass)."""
        if self.label_decoder is parse_label:
            values = parse_ascii_ints(np.asarray(labels_tl.as_tensor())[:n])
            if values is not None:
                return values
        labels = []
        for i in range(n):
            data = np.asarray(labels_tl.at(i)).tobytes()
            if self.label_decoder is parse_label:
                data = data.rstrip(b"\0")  # the zero padding of pad_labels
            try:
                labels.append(int(self.label_decoder(data)))
            except Exception as e:
                raise DataError(f"cannot decode label {self.label_key!r}: {e}", key=f"#{i}") from e
        return labels

    @staticmethod
    def _checkpoint(pipe, batch: int) -> dict:
        """(Producer thread) the DALI pipeline's state after its last ``outputs()`` (~0.2 ms)."""
        checkpoint = pipe.checkpoint()
        if isinstance(checkpoint, str):
            checkpoint = checkpoint.encode("latin-1")
        return {"checkpoint": base64.b64encode(checkpoint).decode("ascii"), "batch": batch}

    def _iter_dali_reader(self) -> Iterator:
        """(Producer thread) DALI's webdataset reader -> ``((images, labels), {"dali": checkpoint, ...})``."""
        from datapipe.storage.urls import local_path

        paths = [local_path(u) for u in self.stream.urls]
        counts = self.stream.counts
        nonempty = [i for i, c in enumerate(counts) if c > 0]
        paths = [paths[i] for i in nonempty]
        rank, world = self._rank_world()
        per_rank = -(-sum(counts) // world)
        steps = per_rank // self.batch_size if self.drop_last else math.ceil(per_rank / self.batch_size)
        # pad_last_batch: every rank's DALI epoch is ceil(per_rank / batch) batches (the last one padded
        # by repeating a sample), so epochs stay aligned with ours and one pipeline serves them all
        dali_steps = math.ceil(per_rank / self.batch_size)
        reader = dict(
            paths=paths, index_paths=self._index_paths(paths),
            ext=[";".join(self.image_exts), self.label_key],
            missing_component_behavior="error", random_shuffle=self.shuffle,
            initial_fill=max(1, self.shuffle_buffer), shard_id=rank, num_shards=world, stick_to_shard=True,
            pad_last_batch=True, read_ahead=False,
        )
        first = 0
        checkpoint = None
        if self._dali_resume is not None:
            first, checkpoint = self._dali_resume["batch"], base64.b64decode(self._dali_resume["checkpoint"])
            self._dali_resume = None
            self._dali_pipe = None
        elif self._dali_pipe is not None and self._dali_batch not in (0, steps):
            self._dali_pipe = None  # the last epoch was left unfinished: its batches are still in flight
        if self._dali_pipe is None:
            pipe = self._pipeline(reader=reader, checkpoint=checkpoint)
            try:
                pipe.build()
            except RuntimeError as e:  # e.g. a sample without an image (DALI checks the index)
                raise _reader_error(e, paths, first) from e
            self._dali_pipe = pipe
        pipe = self._dali_pipe
        stream = torch.cuda.current_stream(self.device) if self._dali_cuda else None
        seconds = self._seconds
        self._dali_batch = first
        left = per_rank - first * self.batch_size
        for _ in range(first, steps):
            t0 = time.perf_counter()
            try:
                images_tl, labels_tl = pipe.run(stream)
            except RuntimeError as e:
                self._dali_pipe = None  # a failed pipeline is not valid any more
                raise _reader_error(e, paths, self._dali_batch) from e
            t1 = time.perf_counter()
            n = min(self.batch_size, left)
            left -= n
            images = self._to_torch(images_tl, stream, zero_copy=pipe.exec_dynamic)[:n]
            labels = self._reader_labels(labels_tl, n)
            seconds["dali"] += t1 - t0
            seconds["copy"] += time.perf_counter() - t1
            self._dali_batch += 1
            state = {}
            if self._dali_batch == steps:  # drop_last: the partial batch DALI still holds
                for _ in range(dali_steps - steps):
                    pipe.run(stream)
                state["stream"] = {**self.stream.state_dict(), "workers": {0: {"draws": per_rank, "done": True}}}
            state["dali"] = self._checkpoint(pipe, self._dali_batch)
            yield self._prepare(images, labels), state
