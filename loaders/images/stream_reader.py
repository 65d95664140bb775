"""``ImageLoader``'s stream reader: ShardStream samples -> raw batches -> DALI through an external source.

:class:`StreamReader` reads in a thread; :class:`WorkerStreamReader` reads in ``read_workers``
processes (a ``loaders.DataLoader`` over :class:`loaders.images.encoded.EncodedBatches`). Both
keep one DALI pipeline for all epochs and recover a batch DALI cannot decode image by image.
Their part of the loader's state embeds the source's own state: ``{"stream": ShardStream state}``
or ``{"loader": loaders.DataLoader state}``.
"""
from __future__ import annotations

import itertools
import time
import weakref
from collections import deque
from typing import Iterator

import torch

from datapipe.errors import LAST_ERRORS, DataError
from datapipe.device.handoff import started, threaded
from datapipe.order.seeds import derive_seed
from loaders.images.dali_pipeline import failure_text, run_pipeline
from loaders.images.decoder_choice import age_replaced
from loaders.images.encoded import EncodedBatches, RawBatch, iter_raw_batches, keep
from loaders.source import stream_start


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


class StreamReader:
    """Raw batches read from the loader's ShardStream in a thread, fed to one DALI pipeline."""

    name = "stream"

    def __init__(self, loader):
        # a weak proxy: no ImageLoader <-> reader cycle (a DALI pipeline left to the cycle collector
        # could be collected in a forked reader worker, which crashes it)
        self.loader = weakref.proxy(loader)  # the ImageLoader: options, stream, stats, pipeline builder, output helpers
        self.stream = loader.stream
        self.delivered: dict | None = None  # the source state after the last batch handed out
        self._pipe = None  # the DALI pipeline, reused across epochs
        self._probe = None  # a batch-of-one pipeline that finds the images DALI cannot decode
        self._replaced = []  # pipelines replaced by a decoder switch: kept two iterations (their batches' memory)
        self._feed = _Feed(loader._seconds)

    # ---- state ------------------------------------------------------------------------------------
    def start(self) -> None:
        """A new iteration: nothing handed out yet."""
        self._replaced = age_replaced(self._replaced)
        self.delivered = None

    def handed(self, position) -> None:
        """(Consumer thread) a batch made at ``position`` (a source state) was handed out."""
        if position is not None:
            self.delivered = position

    def state(self) -> dict:
        return {"stream": self.delivered if self.delivered is not None else self.stream.state_dict()}

    def next_state(self, epoch: int) -> dict:
        """The state of the start of ``epoch``, between passes."""
        return {"stream": stream_start(self.stream.state_dict(), epoch)}

    def load(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        self.delivered = state["stream"]

    def load_merged(self, states: list[dict]) -> None:
        """The rank states of a global state, planned over this shape (``datapipe.order.elastic``)."""
        from datapipe.order import elastic

        self.stream.load_state_dict(elastic.merge_states([r["stream"] for r in states]))
        self.delivered = None

    # ---- batches ----------------------------------------------------------------------------------
    def raw_batches(self) -> Iterator[RawBatch]:
        lo = self.loader
        read = lo.read
        raw = iter_raw_batches(iter(self.stream), batch_size=lo.batch_size, drop_last=read.drop_last,
                               image_exts=read.image_exts, label_key=read.label_key,
                               label_decoder=lo.label_decoder, on_error=self.stream.on_error, stats=lo._stats,
                               state_fn=self.stream.state_dict)
        return threaded(raw, depth=read.prefetch_queue_depth + 1, name="ImageLoader-reader")

    def produce(self) -> Iterator:
        """Raw batches -> DALI -> ``((images, labels), source state)``, run in the producer thread.

        The reader starts here, in the thread that iterates the loader (reader workers fork from it).
        """
        return self._run(self.raw_batches())

    def _run(self, raw_batches) -> Iterator:
        """(Producer thread) the body of :meth:`produce`."""
        lo = self.loader
        feed = self._feed
        feed.start(raw_batches)
        # one DALI pipeline serves every epoch (building one costs seconds); an epoch left unfinished
        # leaves batches in flight in it, so the next epoch builds a fresh one
        if self._pipe is None:
            self._pipe = lo._pipeline(source=feed)
            self._pipe.build()
        else:
            self._pipe.reset()
        pipe = self._pipe
        finished = False
        stream = torch.cuda.current_stream(lo.device) if lo._dali_cuda else None
        seconds = lo._seconds
        try:
            while True:
                if lo._decoder.due and not feed.failure:
                    pipe = self._switch_decoder(feed)
                t0, read0 = time.perf_counter(), seconds["read"]
                try:
                    outputs = run_pipeline(pipe, stream)
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
                    images = lo._to_torch(outputs[0], stream, zero_copy=pipe.exec_dynamic)
                    seconds["copy"] += time.perf_counter() - t1
                yield lo._prepare(images, raw.labels), raw.state
            finished = True
            if feed.failure:
                raise feed.failure[0]
        finally:
            raw_batches.close()
            if (not finished or feed.failure) and self._pipe is pipe:
                self._pipe = None

    def _switch_decoder(self, feed: _Feed):
        """(Producer thread) the decoder choice changed: a pipeline with the new one, fed where the old one was.

        The raw batches the old pipeline had taken in but not given out go into the new one first,
        so nothing is lost or repeated; its random stream is its own (a seed for the switch).
        """
        lo = self.loader
        t0 = time.perf_counter()
        pending = list(feed.fifo)
        feed.start(itertools.chain(pending, feed.raw))
        lo._decoder.switching(in_flight=lo.read.prefetch_queue_depth)  # batches queued for the consumer
        rank, _ = lo._rank_world()
        seed = derive_seed(self.stream.seed, lo.epoch, rank, "dali-switch", lo._decoder.switches, bits=31)
        new = lo._pipeline(source=feed, seed=seed)  # a random stream of its own per switch
        new.build()
        self._replaced.append([self._pipe, 2])
        self._pipe = new
        lo._decoder.switched(time.perf_counter() - t0)
        return new

    def _recover(self, raw: RawBatch, error: BaseException):
        """A batch DALI could not decode: decode its images one by one, find the bad ones, apply on_error."""
        lo = self.loader
        if self._probe is None:
            rank, _ = lo._rank_world()
            self._probe = lo._pipeline(batch_size=1, depth=1,
                                       seed=derive_seed(self.stream.seed, lo.epoch, rank, "dali-probe", bits=31))
            self._probe.build()
        stream = torch.cuda.current_stream(lo.device) if lo._dali_cuda else None
        good, kept = [], RawBatch(state=raw.state)
        for arr, label, key, url in zip(raw.arrays, raw.labels, raw.keys, raw.urls):
            try:
                (out,) = run_pipeline(self._probe, stream, jpegs=[arr])
            except RuntimeError as e:
                lo._stats["decode_errors"] += 1
                lo._errors(DataError(f"cannot decode image (DALI: {failure_text(e)})", url=url, key=key))
                continue
            good.append(lo._to_torch(out, stream, zero_copy=self._probe.exec_dynamic))
            kept.arrays.append(arr)
            kept.labels.append(label)
            kept.keys.append(key)
            kept.urls.append(url)
        if len(good) == len(raw.arrays):
            raise error  # not a per-image problem
        if raw.state is not None:
            self.delivered = raw.state
        if not good:
            return None, kept
        return torch.cat(good), kept


class WorkerStreamReader(StreamReader):
    """The stream reader with ``read_workers`` processes reading and batching (no GIL shared with training).

    Each worker reads its part of the shards and sends a batch as one uint8 tensor of the encoded
    images plus offsets (shared memory, no pickled bytes); the arrays DALI gets are views into it.
    The workers' partial last batches are held and joined into full batches at the end of the pass
    (:func:`join_tails`): as many batches, and the same dropped remainder, as one reader would give.
    Its source is the workers' ``loaders.DataLoader``, whose state it embeds under ``"loader"``.
    """

    def __init__(self, loader):
        super().__init__(loader)
        self._loader = None  # the worker processes' loaders.DataLoader
        self._resume: dict | None = None  # a DataLoader state to load before the next iteration

    def state(self) -> dict:
        if self.delivered is None:  # a pass under way, nothing handed out: its start, naming this rank and shape
            from loaders.dataloader.resume import epoch_start, fresh_state

            epoch = self.loader.epoch
            return {"loader": {**fresh_state(epoch, self.loader.read.read_workers),
                               "dataset": epoch_start(self.stream, epoch)}}
        return {"loader": self.delivered}

    def next_state(self, epoch: int) -> dict:
        from loaders.dataloader.resume import fresh_state

        return {"loader": fresh_state(epoch, self.loader.read.read_workers)}  # the workers' loader at its start

    def load(self, state: dict) -> None:
        self._resume = state["loader"]
        self.delivered = state["loader"]

    def load_merged(self, states: list[dict]) -> None:
        from datapipe.order import elastic

        loaders = [r["loader"] for r in states]
        if any(s is None for s in loaders):
            raise ValueError("some ranks of this global state had handed out no batch: take it after a step "
                             "every rank has reached")
        self._resume = elastic.merge_states(loaders)
        self.delivered = None

    def raw_batches(self) -> Iterator[RawBatch]:
        return started(self._worker_batches())  # the workers fork now, from this thread

    def _worker_batches(self) -> Iterator[RawBatch]:
        """Raw batches from the worker processes. Runs in the thread that iterates, so the workers fork from it."""
        from loaders.dataloader import DataLoader

        lo = self.loader
        read = lo.read
        if self._loader is None:
            dataset = EncodedBatches(self.stream, batch_size=lo.batch_size, drop_last=read.drop_last,
                                     image_exts=read.image_exts, label_key=read.label_key,
                                     label_decoder=lo.label_decoder, on_error=self.stream.on_error)
            self._loader = DataLoader(dataset, batch_size=None, num_workers=read.read_workers,
                                      collate_fn=keep, prefetch_factor=max(2, read.prefetch_queue_depth))
        loader = self._loader
        if self._resume is not None:
            loader.load_state_dict(self._resume)
            self._resume = None
        else:
            loader.set_epoch(lo.epoch)
        it = iter(loader)  # the workers fork here (datapipe.device.forks keeps them from collecting our garbage)
        stats = lo._stats
        tails, last = [], None
        try:
            for packed in it:
                stats["skipped"] += packed["skipped"]
                if packed["errors"]:
                    stats["last_errors"] = (stats["last_errors"] + packed["errors"])[-LAST_ERRORS:]
                data = packed["data"].numpy()
                bounds = packed["offsets"].tolist()
                raw = RawBatch(arrays=[data[a:b] for a, b in zip(bounds[:-1], bounds[1:])],
                               labels=packed["labels"].tolist(), keys=packed["keys"], urls=packed["urls"],
                               state=loader.state_dict())
                raw.owner = packed["data"]
                last = raw.state
                if packed["tail"] is not None:
                    tails.append((packed["tail"], raw))  # its worker's state is the one before it
                else:
                    yield raw
            yield from join_tails(tails, last, batch_size=lo.batch_size, drop_last=read.drop_last)
        finally:
            it.close()


def join_tails(tails: list, state: dict | None, *, batch_size: int, drop_last: bool) -> Iterator[RawBatch]:
    """The read workers' partial last batches (``(tail entry, RawBatch)``, see ``EncodedBatches``) as full
    batches, in logical worker order, then the rest unless ``drop_last``.

    ``state``: the workers' loader state after its last batch (each tail's worker before its tail); a
    batch's state moves each worker past the samples delivered so far, so a resume yields the rest.
    """
    batch, moved = RawBatch(owner=[]), {}
    for entry, raw in sorted(tails, key=lambda t: t[0]["worker"]):
        for i in range(len(raw.arrays)):
            if not batch.arrays or batch.owner[-1] is not raw.owner:
                batch.owner.append(raw.owner)
            batch.arrays.append(raw.arrays[i])
            batch.labels.append(raw.labels[i])
            batch.keys.append(raw.keys[i])
            batch.urls.append(raw.urls[i])
            if entry["after"] is not None:
                moved[entry["worker"]] = entry["after"][i]
            if len(batch.arrays) == batch_size:
                batch.state = _moved(state, moved)
                yield batch
                batch = RawBatch(owner=[])
    if batch.arrays and not drop_last:
        batch.state = _moved(state, moved)
        yield batch


def _moved(state: dict | None, positions: dict) -> dict | None:
    """``state`` (a loaders.DataLoader state) with these workers' stream positions."""
    if state is None or not positions:
        return state
    ds = state["dataset"]
    return {**state, "dataset": {**ds, "workers": {**ds["workers"], **positions}}}
