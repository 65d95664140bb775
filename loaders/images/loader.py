"""``ImageLoader``: WebDataset image shards -> DALI decode + augment -> ``(images, labels)`` on the device.

Samples come from a :class:`datapipe.ShardStream` (any storage, rank/epoch shuffling, resume,
``on_error``), read and checked in a background thread, and enter DALI through
``fn.external_source`` as zero-copy uint8 arrays; or DALI's own ``fn.readers.webdataset`` reads
local shards (``reader="auto"``, with the stream's settings). A producer thread drives DALI ahead of
the training loop (:mod:`datapipe.device.handoff`).

The reader modes are separate classes behind this one: :class:`loaders.images.stream_reader.StreamReader`
(a thread), :class:`~loaders.images.stream_reader.WorkerStreamReader` (``read_workers`` processes)
and :class:`loaders.images.dali_reader.DaliReader` (chosen in :mod:`loaders.images.reader_choice`); the options
are grouped in :mod:`loaders.images.options`, the output conversions in :mod:`loaders.images.outputs`. The
state follows :mod:`datapipe.state`.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
import weakref
from typing import Any, Iterator

import torch

from datapipe.errors import LAST_ERRORS, ErrorPolicy
from datapipe.device.handoff import CurrentStream, ProducerMeter, close_last
from datapipe.device.idle_watch import IdleWatch
from datapipe.device.pacing import IMAGE_PACE
from datapipe.device.queues import WIDE_QUEUES, StepHold, hardware_queues, watch_cuda_start
from datapipe.device.side_stream import on_side_stream
from datapipe.order.ranks import rank_world
from datapipe.order.seeds import derive_seed
from datapipe.state import check_state
from loaders.images.dali_reader import DaliReader
from loaders.images.decoder_choice import DecoderChoice
from loaders.images.encoded import parse_label
from loaders.images.epochs import EpochClock
from loaders.images.options import (DTYPES, IMAGENET_MEAN, IMAGENET_STD, AugmentOptions, DecodeOptions,  # noqa: F401
                                     ReadOptions, dali_threads, image_device)
from loaders.images.outputs import HostUpload, dali_to_torch
from loaders.images.reader_choice import choose_reader
from loaders.images.stream_reader import StreamReader, WorkerStreamReader
from loaders.source import as_stream, check_positive_int, option_group, stream_steps

KIND = "ImageLoader"
SHUFFLE_BUFFER = 2000  # the sample shuffle buffer of a stream the loader builds from URLs (train=True)


log = logging.getLogger("loaders.images")
watch_cuda_start()  # the hardware queues CUDA starts with, whatever the variable says later


@functools.lru_cache(maxsize=2)
def advise_hardware_queues(hardware_decoder: bool = True) -> bool:
    """Say once per process what CUDA's hardware queues mean for decoding when there are fewer than 32.

    With the driver's default 8, the hardware JPEG decoder's streams stall behind one another beside a
    training loop that runs ahead of the GPU. ImageLoader's default decodes on CUDA cores there instead
    (an info line); a hardware decoder share the user chose makes ``next()`` wait for the GPU's last
    step (:class:`datapipe.device.queues.StepHold`): a warning. The library never sets the variable
    itself: it only takes effect before CUDA starts. Returns whether it warned.
    """
    if hardware_queues() >= WIDE_QUEUES:
        return False
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "") or "unset (8 queues)"
    if not hardware_decoder:
        log.info("CUDA_DEVICE_MAX_CONNECTIONS is %s: ImageLoader decodes JPEGs on CUDA cores (the hardware "
                 "decoder stalls beside training with few queues; it moves to it, holding next() for the GPU's "
                 "last step, only if the CUDA decoder starves the loop). CUDA_DEVICE_MAX_CONNECTIONS=%d, set before "
                 "CUDA starts, lets it use the hardware decoder: fewer CPU threads, ~1%% faster eager, ~6%% under "
                 "CUDA graphs, ~10%% with a model as fast as ResNet-18 (see docs/performance.md)", value, WIDE_QUEUES)
        return False
    log.warning("CUDA_DEVICE_MAX_CONNECTIONS is %s: with few hardware queues the hardware JPEG decoder falls behind "
                "a loop that runs ahead of the GPU, so while ImageLoader uses it, next() first waits for the GPU's "
                "last step. Start the program with CUDA_DEVICE_MAX_CONNECTIONS=%d for the full rate (the variable "
                "must be set before CUDA starts; see docs/performance.md)", value, WIDE_QUEUES)
    return True


class ImageLoader:
    """Batches ``(images, labels)`` of decoded, augmented images from WebDataset shards, on ``device``.

    ``train=True``: random-resized-crop (``augment``) fused into decoding, resize to ``image_size``,
    random horizontal flip, normalise; the last partial batch is dropped. ``train=False``: resize the
    shorter side (to ``decode.resize_size``, default ``image_size``), center crop ``image_size``,
    normalise; every sample, the last batch possibly smaller. Labels are int64 from ``read.label_key``.

    Errors follow the stream's ``on_error``: samples without an image, with a wrong signature or an
    undecodable label, and images DALI fails to decode raise :class:`datapipe.DataError` naming the
    shard and key (``"raise"``), or are dropped and counted in ``stats()`` (``"skip"``; ``"warn"``
    also logs). A batch that lost images to a decode error comes out smaller.

    Both readers resume exactly (``state_dict`` / ``load_state_dict``, also on another world size)
    and keep one DALI pipeline for all epochs, driven by a producer thread
    ``read.prefetch_queue_depth`` finished batches ahead; on CUDA it hands batches over on a side
    stream with an event, so the training thread's ``next()`` only takes a batch off a queue.

    Args:
        source: a URL pattern (``"shards/shard-{000000..000099}.tar"``), a list of URLs, a folder, or a
            :class:`datapipe.ShardStream`, whose shuffle, seed, rank, ``on_error``, storage and cache
            settings are used as they are. From URLs the loader builds
            ``ShardStream(source, shuffle=train, shuffle_buffer=2000 if train else 0, seed=0)``.
        batch_size: images per batch.
        image_size: the output's height and width.
        train: augment and shuffle (see above); ``False``: evaluation transforms, shard order.
        device: ``"cuda"`` (DALI decodes on the GPU) or ``"cpu"`` (DALI's CPU operators, no GPU needed).
        dtype: ``torch.float32`` (default), ``float16``, ``bfloat16``, or ``uint8`` (raw pixels, not normalised).
        decode: :class:`~loaders.images.options.DecodeOptions` (layout, mean/std, resize_size,
            decode_device, num_threads, hw_decoder_load, antialias).
        augment: :class:`~loaders.images.options.AugmentOptions` (random-resized-crop ranges).
        read: :class:`~loaders.images.options.ReadOptions` (reader, labels, image entries, read
            workers, read-ahead, drop_last, DALI index folder).
    """

    def __init__(
        self,
        source,
        *,
        batch_size: int,
        image_size: int = 224,
        train: bool = True,
        device: str | torch.device = "cuda",
        dtype: torch.dtype = torch.float32,
        decode: DecodeOptions | None = None,
        augment: AugmentOptions | None = None,
        read: ReadOptions | None = None,
    ):
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.image_size = check_positive_int("image_size", image_size)
        self.train = bool(train)
        self.device = image_device(device)
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: use one of {list(DTYPES)}")
        self.dtype = dtype
        self.decode = option_group(decode, DecodeOptions, "decode")
        self.augment = option_group(augment, AugmentOptions, "augment")
        read = option_group(read, ReadOptions, "read")
        self.read = read if read.drop_last is not None else dataclasses.replace(read, drop_last=self.train)
        dec = self.decode
        if dec.resize_size is not None and dec.resize_size < self.image_size:
            raise ValueError(f"decode.resize_size={dec.resize_size} is below image_size={self.image_size}: "
                             "pass resize_size >= image_size (or None)")
        if dec.decode_device == "gpu" and self.device.type != "cuda":
            raise ValueError("decode_device='gpu' needs device='cuda'")
        self._host_decode = dec.decode_device == "cpu"
        self._threads = dali_threads(dec.num_threads, host_decode=self._host_decode, cuda=self.device.type == "cuda")
        self.label_decoder = self.read.label_decoder or parse_label
        self._decoder = DecoderChoice(dec.hw_decoder_load, cuda=self._dali_cuda, threads=dec.num_threads,
                                      hardware_threads=self._threads)
        if self._dali_cuda:
            advise_hardware_queues(self._decoder.load > 0 or self._decoder.auto)  # the loader's own choice: info
        self._upload = HostUpload(self.device, dtype=dtype, layout=dec.layout, mean=dec.mean, std=dec.std,
                                  buffers=self.read.prefetch_queue_depth + 2)  # decode_device="cpu"'s batches
        self._stats = {"batches": 0, "samples": 0, "skipped": 0, "decode_errors": 0, "last_errors": []}
        self._seconds = {"wait": 0.0, "read": 0.0, "dali": 0.0, "copy": 0.0}
        self._global: dict | None = None  # a global state loaded, until a batch is handed out after it
        self._resumed = False
        self._side_stream = None  # the producer's CUDA stream, the same every epoch
        self._hold = StepHold(self.device, decodes_on_gpu=self._dali_cuda)  # few queues + hardware decoder
        self._last_pass = None  # weakref to the latest pass's iterator
        self._consumer = None  # CUDA: the consumer's current stream (CurrentStream), made when first asked
        self._idle = None  # CUDA: the IdleWatch timing the starved part of next()'s waits, while it is judged
        self._producer = ProducerMeter()  # the producer thread's CPU time, all epochs

        stream = as_stream(source, shuffle=self.train, shuffle_buffer=SHUFFLE_BUFFER)
        if stream_steps(stream):
            raise ValueError("ImageLoader decodes the images itself (with DALI): pass a ShardStream without "
                             ".decode()/.map() steps, or use loaders.DataLoader for decoded samples")
        self.stream = stream.replace(zero_copy=True)  # DALI reads the mapped bytes
        self.stream.set_epoch(stream.epoch)
        self._clock = EpochClock(self.stream)  # each pass that runs to its end: the next epoch (loaders.images.epochs)
        self._errors = ErrorPolicy(self.stream.on_error)  # the images DALI cannot decode (the stream reader finds them)
        self.reader = choose_reader(self, self.read.reader)  # loaders.images.reader_choice
        if self.reader == "dali":
            self._source = DaliReader(self)
        elif self.read.read_workers:
            self._source = WorkerStreamReader(self)
        else:
            self._source = StreamReader(self)

    @property
    def decode_device(self) -> str:
        """Where DALI decodes: ``"gpu"`` or ``"cpu"``."""
        return "gpu" if self._dali_cuda else "cpu"

    @property
    def num_threads(self) -> int:
        """DALI's CPU threads in the pipeline now (on the CUDA decoder alone: 12, at most cores - 4, unless given)."""
        return self._decoder.threads

    @property
    def hw_decoder_load(self) -> float:
        """The hardware decoder's share in use now (``"auto"``: 0.0 until it switches)."""
        return self._decoder.load

    @property
    def drop_last(self) -> bool:
        """Whether the last partial batch of an epoch is dropped (``read.drop_last``, default ``train``)."""
        return self.read.drop_last

    # ---- configuration ------------------------------------------------------------------------
    @property
    def _dali_cuda(self) -> bool:
        """The DALI pipeline runs on the GPU (decode_device 'gpu')."""
        return self.device.type == "cuda" and not self._host_decode

    def _rank_world(self) -> tuple[int, int]:
        return rank_world(self.stream)

    def _pipeline(self, *, source=None, reader=None, batch_size=None, depth=None, seed=None, checkpoint=None,
                  source_info=False):
        from loaders.images.dali_pipeline import build_image_pipeline

        rank, _ = self._rank_world()
        dec, aug = self.decode, self.augment
        return build_image_pipeline(
            batch_size=batch_size or self.batch_size, image_size=self.image_size, train=self.train,
            device="cuda" if self._dali_cuda else "cpu", device_id=self.device.index or 0 if self._dali_cuda else None,
            dtype="uint8" if self._host_decode else DTYPES[self.dtype],
            layout="NHWC" if self._host_decode else dec.layout,
            mean=[m * 255 for m in dec.mean], std=[s * 255 for s in dec.std],
            seed=derive_seed(self.stream.seed, self.epoch, rank, "dali", bits=31) if seed is None else seed,
            num_threads=self._decoder.threads, prefetch_queue_depth=depth or self.read.prefetch_queue_depth,
            hw_decoder_load=self._decoder.load, random_area=aug.random_area,
            random_aspect_ratio=aug.random_aspect_ratio, resize_size=dec.resize_size,
            source=source, reader=reader, enable_checkpointing=reader is not None, checkpoint=checkpoint,
            pad_labels=self.label_decoder is parse_label, antialias=dec.antialias, source_info=source_info,
        )

    # ---- epochs, length, state ----------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the next pass (or of the one under way): each pass that runs to its end moves it on."""
        return self._clock.epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (shuffle order and augmentation seed) of the next pass; the passes after it count on
        from it. Without it each pass that runs to its end makes the next one the next epoch (reshuffled)."""
        self._clock.set(int(epoch), keep=self._resumed)

    def __len__(self) -> int:
        """Batches per epoch on this rank (exact unless samples are skipped)."""
        n = len(self.stream)
        return n // self.batch_size if self.read.drop_last else math.ceil(n / self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Position after the last batch handed out (read-ahead is not counted), as :mod:`datapipe.state` says.

        ``{"kind": "ImageLoader", "epoch", "reader", "batches"}`` plus the reader's source state:
        ``"stream"`` (the ShardStream's own state; with ``reader="dali"`` also ``"dali"``: a DALI
        pipeline checkpoint and the batches of the epoch handed out) or, with ``read_workers``,
        ``"loader"`` (the reader workers' ``loaders.DataLoader`` state). Between passes (the last one ran to
        its end, or ``set_epoch`` was called since): the start of the next epoch, ``"batches"`` 0.
        """
        if self._clock.between:  # no pass under way: the start of the next epoch
            return {"kind": KIND, "epoch": self.epoch, "reader": self.reader, "batches": 0,
                    **self._source.next_state(self.epoch)}
        if self._global is not None and getattr(self._source, "delivered", None) is None:
            return self._global  # loaded, nothing handed out since
        return {"kind": KIND, "epoch": self.epoch, "reader": self.reader, "batches": self._stats["batches"],
                **self._source.state()}

    def global_state_dict(self) -> dict[str, Any]:
        """The state of the whole job: every rank's ``state_dict()``, gathered (``datapipe.order.elastic``).

        A collective under torch.distributed (every rank calls it at the same step); without it this
        process must be the whole job. ``load_state_dict`` resumes it on any ``world_size`` (and
        ``read_workers``); with ``reader="dali"`` another ``world_size`` reads the rest of that epoch
        through ShardStream (the samples no rank's delivered bitmap holds), then DALI again.
        """
        from datapipe.order import elastic

        return elastic.gather_state(self.state_dict())

    def _load_global(self, state: dict[str, Any]) -> None:
        ranks = state["ranks"]
        for r in ranks:
            check_state(r, KIND)
        readers = {r.get("reader") for r in ranks}
        if readers != {self.reader}:
            raise ValueError(f"this state was saved with reader={sorted(map(str, readers))}, this loader has "
                             f"reader={self.reader!r}")
        rank, world = self._rank_world()
        if self.reader == "dali" and world == state["world_size"]:
            self.load_state_dict(ranks[rank])  # each rank its own DALI checkpoint: bit-exact
            return
        if self.reader == "dali":
            self._source.load_merged(ranks)  # the epoch's undelivered samples, planned over this shape
            self._clock.load(state["epoch"])
            self._global = state
            self._resumed = True
            return
        if ("loader" in ranks[0]) != bool(self.read.read_workers):
            raise ValueError("this state was saved with a different read_workers setting (0 vs > 0)")
        self._source.load_merged(ranks)
        self._clock.load(state["epoch"])
        self._global = state
        self._resumed = True

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Resume: the next iteration yields exactly the batches the saved run had not yet handed out.

        ``state``: this rank's ``state_dict()``, or a global state (``global_state_dict()``, or the
        list of every rank's ``state_dict()``): on the same shape each rank takes its own state
        back (exact); another ``world_size`` (or, with ``reader="stream"``, ``read_workers``) plans the
        epoch's undelivered samples over the new shape (``datapipe.order.elastic``).
        """
        from datapipe.order import elastic

        self._global = None
        if isinstance(state, (list, tuple)):
            state = elastic.merge_states(list(state))
        if (self.reader == "dali" and self._rank_world()[1] != 1 and isinstance(state, dict)
                and not elastic.is_global(state)
                and isinstance(state.get("stream"), dict) and state["stream"].get("world_size") == 1):
            state = elastic.merge_states([state])  # one rank was the whole job: its state is the global one
        if elastic.is_global(state):
            self._load_global(state)
            return
        check_state(state, KIND)
        if "epoch" not in state or ("stream" not in state and "loader" not in state):
            raise ValueError("not an ImageLoader state: needs 'epoch' and 'stream' (or, with read_workers, "
                             "'loader') entries")
        if ("loader" in state) != isinstance(self._source, WorkerStreamReader):
            raise ValueError("this state was saved with a different read_workers setting (0 vs > 0)")
        if "loader" not in state and (state.get("reader") == "dali") != (self.reader == "dali"):
            raise ValueError(f"this state was saved with reader={state.get('reader')!r}, this loader has "
                             f"reader={self.reader!r}")
        self._source.load(state)
        self._clock.load(state["epoch"])
        self._resumed = True

    def stats(self) -> dict[str, Any]:
        """Batches and samples handed out, samples skipped (here and in the stream), ``decode_errors`` (images
        DALI failed on; those the check before DALI catches count as skipped only); ``reader``; ``stream``: the
        ShardStream's counters, None while DALI's own reader reads the shards; ``step_hold``:
        whether ``next()`` waits for the GPU's last step (few hardware queues and the hardware decoder in use)
        and the seconds it waited."""
        stream = self.stream.stats()
        out = {k: v for k, v in self._stats.items() if k != "last_errors"}
        out["skipped"] = self._stats["skipped"] + self._errors.skipped + stream.get("skipped", 0)
        out["last_errors"] = (stream.get("last_errors", []) + self._stats["last_errors"]
                              + self._errors.last_errors)[-LAST_ERRORS:]
        out["reader"] = self.reader
        out["stream"] = stream if self.reader == "stream" or stream.get("shards_opened") else None
        out["seconds"] = {k: round(v, 4) for k, v in self._seconds.items()}
        out["producer"] = self._producer.stats()
        out["decoder"] = self._decoder.stats()
        out["step_hold"] = {"active": self._holds(), "seconds": round(self._hold.seconds, 4)}
        return out

    # ---- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass (an epoch, or its rest after a resume); one pass at a time: a new one stops the last."""
        close_last(self._last_pass)  # before this pass touches the source the last one's thread reads
        epoch = self._clock.begin(resumed=self._resumed)  # loaders.DataLoader's rule for the stream's epoch
        if not self._resumed:
            self._global = None
        self._resumed = False
        self._source.start()
        handout = self._handout(self._source.produce(), epoch)
        self._last_pass = weakref.ref(handout)
        return handout

    def _handout(self, produce, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches made ahead in a producer thread (DALI driven, on a side stream).

        The training thread's ``next()`` only takes a finished batch off a queue; counters and the
        resume position advance here, when a batch is handed out, not when it is made.
        """
        seconds = self._seconds
        decoder = self._decoder
        decoder.start()
        if self.device.type == "cuda" and self._side_stream is None:  # one for all epochs (see on_side_stream)
            self._side_stream = torch.cuda.Stream(self.device)
        items = on_side_stream(produce, device=self.device, depth=self.read.prefetch_queue_depth, pace=IMAGE_PACE,
                               stream=self._side_stream, meter=self._producer)
        try:
            while True:
                t0 = time.perf_counter()
                if self._holds():
                    self._hold()
                watch = self._idle_watch()
                if watch is not None:
                    watch.begin()
                try:
                    (images, labels), position = next(items)
                except StopIteration:
                    self._clock.end(epoch)  # ran to its end: the next pass is the next epoch
                    return
                finally:
                    t1 = time.perf_counter()
                    seconds["wait"] += t1 - t0
                    starved = watch.end() if watch is not None else t1 - t0
                decoder.took(starved, t1)
                self._stats["batches"] += 1
                self._stats["samples"] += len(labels)
                self._source.handed(position)
                yield images, labels
        finally:
            items.close()
            if self._idle is not None:
                self._idle.close()
                self._idle = None

    def _idle_watch(self) -> IdleWatch | None:
        """What times the starved part of each wait in ``next()`` for the decoder choice: on CUDA, while it watches
        for starvation, the time the consumer's stream had nothing left to run (:class:`IdleWatch`; a host that
        waits while its GPU still runs queued steps, as under CUDA graphs, starves nothing). None otherwise: the
        wait counts whole (a CPU device) or is not judged."""
        if self.device.type != "cuda" or not self._decoder.watching_starvation:
            return None
        if self._idle is None:
            if self._consumer is None:
                self._consumer = CurrentStream(self.device)
            self._idle = IdleWatch(self._consumer)
        return self._idle

    def _holds(self) -> bool:
        """Whether ``next()`` waits for the GPU's last step: few hardware queues and the hardware decoder in use."""
        return self._hold.active and self._decoder.load > 0

    def _prepare(self, images: torch.Tensor, labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(Producer thread) labels to the device, bfloat16 cast: enqueued on the producer's stream."""
        out = torch.tensor(labels, dtype=torch.int64)
        if self.device.type == "cuda":
            out = out.pin_memory().to(self.device, non_blocking=True)
        if self._host_decode:
            return self._upload(images), out
        if self.dtype == torch.bfloat16:
            images = images.to(torch.bfloat16)
        return images, out

    def _to_torch(self, tensor_list, stream, *, zero_copy: bool = True) -> torch.Tensor:
        """A DALI output of this loader's pipeline as a torch tensor (:func:`~loaders.images.outputs.dali_to_torch`)."""
        return dali_to_torch(tensor_list, stream, device=self.device, on_gpu=self._dali_cuda, zero_copy=zero_copy)

