"""``ImageLoader``: WebDataset image shards -> DALI decode + augment -> ``(images, labels)`` on the device.

Samples come from :class:`datapipe.ShardStream` (any storage, rank/epoch shuffling, resume,
``on_error``), read and checked in a background thread, and enter DALI through
``fn.external_source`` as zero-copy uint8 arrays. ``device="cuda"`` decodes with nvImageCodec
(``mixed``, hardware JPEG decoder where present) and augments on the GPU; ``device="cpu"`` runs
the same graph with CPU operators. DALI's own ``fn.readers.webdataset`` reads local shards
instead when it can (``reader="auto"``: faster, fewer guarantees; see :class:`ImageLoader`). A producer
thread drives DALI ahead of the training loop (:mod:`datapipe.device.handoff`).

The reader modes are separate classes behind this one: :class:`loaders.images.stream_reader.StreamReader`
(a thread), :class:`~loaders.images.stream_reader.WorkerStreamReader` (``read_workers`` processes)
and :class:`loaders.images.dali_reader.DaliReader`; the options are grouped in
:mod:`loaders.images.options`, the output conversions in :mod:`loaders.images.outputs`. The state follows
:mod:`datapipe.state`.
"""
from __future__ import annotations

import math
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch

from datapipe.errors import LAST_ERRORS, ErrorPolicy
from datapipe.device.handoff import ProducerMeter, close_last
from datapipe.device.side_stream import on_side_stream
from datapipe.device.queues import widen_hardware_queues
from datapipe.order.seeds import derive_seed
from datapipe.state import check_state
from loaders.images.dali_reader import DaliReader
from loaders.images.decoder_choice import DecoderChoice
from loaders.images.encoded import parse_label
from loaders.images.options import (DTYPES, IMAGENET_MEAN, IMAGENET_STD, PACE, READY, AugmentOptions, DecodeOptions,
                                     ReadOptions)
from loaders.images.outputs import HostUpload, dali_to_torch
from loaders.images.stream_reader import StreamReader, WorkerStreamReader

widen_hardware_queues()  # before CUDA starts: DALI's streams get queues of their own (datapipe.device.queues)

KIND = "ImageLoader"


def _option(group: str, name: str, doc: str = "") -> property:
    return property(lambda self: getattr(getattr(self, group), name), doc=doc or f"``{group}.{name}``")


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

    ``antialias=False`` resizes without DALI's low-pass filter when shrinking (less GPU time per
    batch, slightly more aliasing; torchvision's PIL path filters, as the default here does).

    ``hw_decoder_load``: the share of JPEGs for the GPU's hardware decoder (the rest: nvJPEG's
    CUDA decoder, its Huffman stage on DALI's CPU threads). ``"auto"``: the CUDA decoder alone (on
    up to 12 threads unless ``num_threads`` is given) while the training loop does not wait for
    batches, then 0.75 for good, switched once by rebuilding the pipeline where it stopped
    (:mod:`loaders.images.decoder_choice`: nothing lost or repeated; 0.5 s on an H200). With 32
    hardware queues (below) both kept ResNet-50 on an H200 at ~0.98 of its data-free rate (auto
    0.980, 0.75 0.979 on average over 11 rows each), auto on ~8.5 cores against ~3; with the
    driver's 8 queues the CUDA decoder was ahead by ~0.5%. ``stats()["decoder"]`` says which
    decoder runs and when it switched; the two decoders' images differ in their low bits.
    ``pace`` (default 0.7; None turns it off): while a batch is still queued, the producer starts the
    next only that far into the training step (README, "Pacing"). ``ready``: how the training thread
    gets a finished batch, ``"event"`` (default), ``"host"`` or ``"checked"`` (:mod:`datapipe.device.side_stream`).
    Importing this module asks the CUDA driver for 32 hardware queues instead of 8 (unless
    ``CUDA_DEVICE_MAX_CONNECTIONS`` is set, or CUDA has already started): DALI's streams then
    seldom share a queue with the training stream (``datapipe.device.queues``).
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
        hw_decoder_load: float | str = 0.75,
        drop_last: bool | None = None,
        reader: str = "auto",
        random_area: Sequence[float] = (0.08, 1.0),
        random_aspect_ratio: Sequence[float] = (3 / 4, 4 / 3),
        resize_size: int | None = None,
        index_dir: str | None = None,
        stream_options: dict | None = None,
        decode_device: str | None = None,
        antialias: bool = True,
        pace: float | None = PACE,
        ready: str = READY,
    ):
        device = torch.device(device)
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = device
        self.batch_size = int(batch_size)
        train = bool(train)
        shuffle = train if shuffle is None else bool(shuffle)
        self.decode = DecodeOptions(
            image_size=int(image_size), resize_size=resize_size, dtype=dtype, layout=layout,
            mean=tuple(float(m) for m in mean), std=tuple(float(s) for s in std),
            hw_decoder_load=hw_decoder_load if isinstance(hw_decoder_load, str) else float(hw_decoder_load),
            antialias=bool(antialias),
            **DecodeOptions.resolve(device, decode_device, num_threads))
        self.augment = AugmentOptions(train=train, random_area=tuple(random_area),
                                      random_aspect_ratio=tuple(random_aspect_ratio))
        self.read = ReadOptions(
            reader=reader, seed=int(seed), shuffle=shuffle, shuffle_buffer=int(shuffle_buffer) if shuffle else 0,
            on_error=on_error, label_key=label_key, label_decoder=label_decoder,
            image_exts=tuple(e for e in image_key.split(";") if e), read_workers=int(read_workers),
            prefetch_queue_depth=int(prefetch_queue_depth), drop_last=train if drop_last is None else bool(drop_last),
            pace=pace, ready=ready,
            index_dir=index_dir, stream_options=dict(stream_options or {}))
        self.label_decoder = label_decoder or parse_label
        self._decoder = DecoderChoice(self.decode.hw_decoder_load, cuda=self._dali_cuda, threads=num_threads,
                                      hardware_threads=self.decode.num_threads)
        dec = self.decode
        self._upload = HostUpload(device, dtype=dec.dtype, layout=dec.layout, mean=dec.mean, std=dec.std,
                                  buffers=self.read.prefetch_queue_depth + 2)  # decode_device="cpu"'s batches
        self.epoch = 0
        self._errors = ErrorPolicy(on_error)  # the images DALI cannot decode (the stream reader finds them)
        self._stats = {"batches": 0, "samples": 0, "skipped": 0, "decode_errors": 0, "last_errors": []}
        self._seconds = {"wait": 0.0, "read": 0.0, "dali": 0.0, "copy": 0.0}
        self._global: dict | None = None  # a global state loaded, until a batch is handed out after it
        self._resumed = False
        self._side_stream = None  # the producer's CUDA stream, the same every epoch
        self._last_pass = None  # weakref to the latest pass's iterator
        self._producer = ProducerMeter()  # the producer thread's CPU time, all epochs

        from datapipe.stream import ShardStream

        self.stream = ShardStream(urls, shuffle=shuffle, seed=self.read.seed, shuffle_buffer=self.read.shuffle_buffer,
                                  rank=rank, world_size=world_size, on_error=on_error,
                                  **{"zero_copy": True, **self.read.stream_options})  # DALI reads the mapped bytes
        self.reader = self._choose_reader(reader)
        if self.reader == "dali":
            self._source = DaliReader(self)
        elif self.read.read_workers:
            self._source = WorkerStreamReader(self)
        else:
            self._source = StreamReader(self)

    # the keyword arguments, as attributes (read-only: the option groups are frozen)
    image_size = _option("decode", "image_size")
    resize_size = _option("decode", "resize_size")
    dtype = _option("decode", "dtype")
    layout = _option("decode", "layout")
    mean = _option("decode", "mean")
    std = _option("decode", "std")
    decode_device = _option("decode", "decode_device", "Where DALI decodes: 'gpu' or 'cpu'.")

    @property
    def num_threads(self) -> int:
        """DALI's CPU threads in the pipeline now (``"auto"`` decoding on CUDA cores: 12 unless given)."""
        return self._decoder.threads

    @property
    def hw_decoder_load(self) -> float:
        """The hardware decoder's share in use now (``"auto"``: 0.0 until it switches; ``decode.hw_decoder_load``
        holds the setting)."""
        return self._decoder.load

    train = _option("augment", "train")
    random_area = _option("augment", "random_area")
    random_aspect_ratio = _option("augment", "random_aspect_ratio")
    seed = _option("read", "seed")
    shuffle = _option("read", "shuffle")
    shuffle_buffer = _option("read", "shuffle_buffer")
    on_error = _option("read", "on_error")
    label_key = _option("read", "label_key")
    image_exts = _option("read", "image_exts")
    read_workers = _option("read", "read_workers")
    prefetch_queue_depth = _option("read", "prefetch_queue_depth")
    drop_last = _option("read", "drop_last")
    pace = _option("read", "pace")
    ready = _option("read", "ready")
    index_dir = _option("read", "index_dir")

    # ---- configuration ------------------------------------------------------------------------
    def _choose_reader(self, reader: str) -> str:
        from datapipe.storage.urls import is_local

        dali_ok = all(is_local(u) for u in self.stream.urls) and self._errors.raises
        if reader == "dali" and not dali_ok:
            raise ValueError("reader='dali' needs local shards and on_error='raise'; use reader='stream'")
        if reader == "auto":  # DALI's reader: faster and less GIL work than feeding DALI from Python (README)
            plain = not (self.read.label_key.startswith("__") or self.read.read_workers or self.read.stream_options)
            return "dali" if dali_ok and plain else "stream"
        return reader

    @property
    def _dali_cuda(self) -> bool:
        """The DALI pipeline runs on the GPU (decode_device 'gpu')."""
        return self.device.type == "cuda" and not self.decode.host_decode

    def _rank_world(self) -> tuple[int, int]:
        return self.stream._rank_world()

    def _pipeline(self, *, source=None, reader=None, batch_size=None, depth=None, seed=None, checkpoint=None,
                  source_info=False):
        from loaders.images.dali_pipeline import build_image_pipeline

        rank, _ = self._rank_world()
        dec, aug = self.decode, self.augment
        return build_image_pipeline(
            batch_size=batch_size or self.batch_size, image_size=dec.image_size, train=aug.train,
            device="cuda" if self._dali_cuda else "cpu", device_id=self.device.index or 0 if self._dali_cuda else None,
            dtype="uint8" if dec.host_decode else DTYPES[dec.dtype],
            layout="NHWC" if dec.host_decode else dec.layout,
            mean=[m * 255 for m in dec.mean], std=[s * 255 for s in dec.std],
            seed=derive_seed(self.read.seed, self.epoch, rank, "dali", bits=31) if seed is None else seed,
            num_threads=self._decoder.threads, prefetch_queue_depth=depth or self.read.prefetch_queue_depth,
            hw_decoder_load=self._decoder.load, random_area=aug.random_area,
            random_aspect_ratio=aug.random_aspect_ratio, resize_size=dec.resize_size,
            source=source, reader=reader, enable_checkpointing=reader is not None, checkpoint=checkpoint,
            pad_labels=self.label_decoder is parse_label, antialias=dec.antialias, source_info=source_info,
        )

    # ---- epochs, length, state ----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (shuffle order and augmentation seed) of the next iteration."""
        self.epoch = int(epoch)
        self.stream.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches per epoch on this rank (exact unless samples are skipped)."""
        n = len(self.stream)
        return n // self.batch_size if self.read.drop_last else math.ceil(n / self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Position after the last batch handed out (read-ahead is not counted), as :mod:`datapipe.state` says.

        ``{"kind": "ImageLoader", "epoch", "reader", "batches"}`` plus the reader's source state:
        ``"stream"`` (the ShardStream's own state; with ``reader="dali"`` also ``"dali"``: a DALI
        pipeline checkpoint and the batches of the epoch handed out) or, with ``read_workers``,
        ``"loader"`` (the reader workers' ``loaders.DataLoader`` state).
        """
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
            self.epoch = int(state["epoch"])
            self._global = state
            self._resumed = True
            return
        if ("loader" in ranks[0]) != bool(self.read.read_workers):
            raise ValueError("this state was saved with a different read_workers setting (0 vs > 0)")
        self._source.load_merged(ranks)
        self.epoch = int(state["epoch"])
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
        self.epoch = int(state["epoch"])
        self._resumed = True

    def stats(self) -> dict[str, Any]:
        """Batches and samples handed out, samples skipped (here and in the stream), decode errors."""
        stream = self.stream.stats()
        out = {k: v for k, v in self._stats.items() if k != "last_errors"}
        out["skipped"] = self._stats["skipped"] + self._errors.skipped + stream.get("skipped", 0)
        out["last_errors"] = (stream.get("last_errors", []) + self._stats["last_errors"]
                              + self._errors.last_errors)[-LAST_ERRORS:]
        out["stream"] = stream
        out["seconds"] = {k: round(v, 4) for k, v in self._seconds.items()}
        out["producer"] = self._producer.stats()
        out["decoder"] = self._decoder.stats()
        return out

    # ---- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass (an epoch, or its rest after a resume); one pass at a time: a new one stops the last."""
        close_last(self._last_pass)  # before this pass touches the source the last one's thread reads
        if not self._resumed:
            self.stream.set_epoch(self.epoch)
            self._global = None
        self._resumed = False
        self._source.start()
        handout = self._handout(self._source.produce())
        self._last_pass = weakref.ref(handout)
        return handout

    def _handout(self, produce) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches made ahead in a producer thread (DALI driven, on a side stream).

        The training thread's ``next()`` only takes a finished batch off a queue; counters and the
        resume position advance here, when a batch is handed out, not when it is made.
        """
        seconds = self._seconds
        decoder = self._decoder
        decoder.start()
        if self.device.type == "cuda" and self._side_stream is None:  # one for all epochs (see on_side_stream)
            self._side_stream = torch.cuda.Stream(self.device)
        items = on_side_stream(produce, device=self.device, depth=self.read.prefetch_queue_depth, pace=self.read.pace,
                               stream=self._side_stream, meter=self._producer, ready=self.read.ready)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    (images, labels), position = next(items)
                except StopIteration:
                    return
                finally:
                    t1 = time.perf_counter()
                    seconds["wait"] += t1 - t0
                decoder.took(t1 - t0, t1)
                self._stats["batches"] += 1
                self._stats["samples"] += len(labels)
                self._source.handed(position)
                yield images, labels
        finally:
            items.close()

    def _prepare(self, images: torch.Tensor, labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(Producer thread) labels to the device, bfloat16 cast: enqueued on the producer's stream."""
        out = torch.tensor(labels, dtype=torch.int64)
        if self.device.type == "cuda":
            out = out.pin_memory().to(self.device, non_blocking=True)
        if self.decode.host_decode:
            return self._upload(images), out
        if self.dtype == torch.bfloat16:
            images = images.to(torch.bfloat16)
        return images, out

    def _to_torch(self, tensor_list, stream, *, zero_copy: bool = True) -> torch.Tensor:
        """A DALI output of this loader's pipeline as a torch tensor (:func:`~loaders.images.outputs.dali_to_torch`)."""
        return dali_to_torch(tensor_list, stream, device=self.device, on_gpu=self._dali_cuda, zero_copy=zero_copy)
