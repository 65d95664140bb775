"""``ImageLoader``'s DALI reader: local shards read by DALI's own ``fn.readers.webdataset``.

DALI reads, shuffles and partitions (contiguous ``samples_per_rank`` slices); resume is a DALI
pipeline checkpoint (reader positions and random states) plus the batch count of the epoch. The
reader's part of the loader's state: ``{"stream": the ShardStream's own state (epoch, rank, shape),
"dali": {"checkpoint", "batch", "delivered", "samples", "shards"}}``.

Elastic resume: each batch also carries DALI's ``source_info`` of its samples, mapped (one dict
lookup each) through the index files to global sample numbers of the epoch plan
(``datapipe.order.plan``: shard order, then sample order); the samples handed out so far form a
per-epoch bitmap (``"delivered"``, ``np.packbits``). A global state taken on another
``world_size`` resumes the epoch's complement (the union of the ranks' bitmaps, inverted)
through ShardStream, planned over the new shape with the stream's rule (equal counts per rank,
at most ``world_size - 1`` repeats): the rest of that epoch is read by the stream reader (state
``{"stream", "dali": None, "elastic": True}``); the next epoch is DALI's again.
"""
from __future__ import annotations

import base64
import logging
import math
import re
import time
import weakref
from typing import Iterator

import numpy as np
import torch

from datapipe.errors import DataError
from datapipe.order.plan import samples_per_rank, shard_order
from datapipe.read.shards import fingerprint
from datapipe.tar.dali_index import first_incomplete
from datapipe.words import counted
from loaders.images.dali_pipeline import run_pipeline
from loaders.images.decoder_choice import age_replaced
from loaders.images.encoded import parse_ascii_ints, parse_label
from loaders.images.index_files import index_paths
from loaders.source import stream_start
from loaders.images.stream_reader import StreamReader

log = logging.getLogger("loaders.images")


SHUFFLE_WINDOW = 1024  # DALI's own initial_fill: the sample shuffle of a shuffled stream without a shuffle_buffer
_FAILED_SAMPLE = re.compile(r"Failed to decode sample #\d+ : (.+):\d+:([^:]+?)\s*$")
_GIF_COMPONENT = re.compile(r"(?:^|\s)gif \d+ \d+ (\S+)", re.MULTILINE)  # <ext> <offset> <size> <member name>
_MEMBER = re.compile(r"^((?:.*/|)[^./]+)[.][^/]*$")  # webdataset's key of a member name: up to the basename's first dot


def reader_error(error: RuntimeError, paths: list[str], batch: int, urls: list[str] | None = None, *,
                 index_files: list[str] | None = None, exts: list[str] | None = None) -> DataError:
    """DALI's reader failed (an image it cannot decode, a broken shard): a DataError with what DALI said.

    DALI names the sample when its decoder fails ("Failed to decode sample #3 :
    shard.tar:OFFSET:dir/key.jpg"): then the error carries that shard (as ``urls`` names it, the
    URLs parallel to the local ``paths``) and key. A sample without an entry the reader asks for is found in
    the ``index_files`` (with the reader's ``exts``) and named.
    """
    lines = [m.strip() for m in str(error).splitlines() if m.strip()]
    for line in lines:
        m = _FAILED_SAMPLE.search(line)
        if m:
            path, member = m.group(1), m.group(2)
            named = _MEMBER.match(member)
            url = urls[paths.index(path)] if urls is not None and path in paths else path
            return DataError(f"cannot decode image {member!r} (DALI's reader, batch {batch} of the epoch)",
                             url=url, key=named.group(1) if named else member)
    for line in lines:
        m = re.search(r"Underful sample detected at index file", line)
        if m:  # DALI's words for a sample that lacks one of the extensions the reader asks for
            found = first_incomplete(index_files, exts) if index_files and exts else None
            if found is not None:
                shard, key, missing = found
                url = urls[shard] if urls is not None else paths[shard]
                lacks = " and ".join("an image (ReadOptions.image_exts)" if m == exts[0] else
                                     f"a {m!r} label (ReadOptions.label_key)" for m in missing)
                return DataError(f"sample {key!r} lacks {lacks}, which DALI's reader needs in every sample; "
                                 "reader='stream' with on_error='skip' skips such samples", url=url, key=key)
            shards = paths[0] if len(paths) == 1 else f"{len(paths)} shards ({paths[0]} ...)"
            return DataError("DALI's reader failed: a sample has no image or no label file of the extensions it "
                             "asks for: do these shards hold images? `datapipe inspect` lists their extensions "
                             f"(reading {shards})")
    detail = next((m for m in lines if any(w in m for w in ("failure", "rror:", "Invalid", "detected"))),
                  lines[-1] if lines else "")
    shards = paths[0] if len(paths) == 1 else f"{len(paths)} shards ({paths[0]} ...)"
    return DataError(f"DALI's reader failed in batch {batch} of the epoch: {detail[:200]} (reading {shards}; "
                     "reader='stream' names the sample and on_error='skip' skips it)")


def gif_member(paths: list[str], index_dir: str | None) -> tuple[str, str] | None:
    """The first GIF entry (DALI cannot decode GIF) in the index files of local shards: ``(path, member)``, or None.

    Makes the index files DALI's reader would make (they are reused by it).
    """
    for path, index_file in zip(paths, index_paths(paths, index_dir)):
        with open(index_file, encoding="utf-8") as f:
            m = _GIF_COMPONENT.search(f.read())
        if m:
            return path, m.group(1)
    return None


class SampleNumbers:
    """DALI's ``source_info`` of a sample -> its number in the URL list's order (shards, then samples).

    Built from the index files DALI reads: one entry per file of each sample, keyed by the bytes
    ``"<path>:<data offset>:<member name>"`` DALI reports. ``order(urls_order)`` gives, per epoch,
    the array mapping those numbers to the epoch plan's global numbers.
    """

    def __init__(self, paths: list[str], index_files: list[str], counts: list[int], shard_of_path: list[int]):
        self.counts = list(counts)
        starts = np.concatenate(([0], np.cumsum(self.counts)[:-1])).astype(np.int64)
        self.table: dict[bytes, int] = {}
        for path, index_file, shard in zip(paths, index_files, shard_of_path):
            with open(index_file, encoding="utf-8") as f:
                lines = f.read().split("\n")
            samples = [line.split() for line in lines[1:] if line.strip()]
            if len(samples) != self.counts[shard]:
                raise ValueError(f"DALI index {index_file} lists {counted(len(samples), 'sample')}, the shard {path} "
                                 f"holds {self.counts[shard]}: remove the stale index")
            first = int(starts[shard])
            for j, fields in enumerate(samples):
                for k in range(0, len(fields) - 3, 4):  # <ext> <data_offset> <size> <member name>
                    self.table[f"{path}:{fields[k + 1]}:{fields[k + 3]}".encode()] = first + j

    def to_global(self, order: list[int]) -> np.ndarray:
        """URL-order number -> the epoch plan's global number, for the epoch's shard ``order``."""
        out = np.empty(sum(self.counts), dtype=np.int64)
        pos = 0
        starts = np.concatenate(([0], np.cumsum(self.counts)[:-1])).astype(np.int64)
        for shard in order:
            n = self.counts[shard]
            out[starts[shard]:starts[shard] + n] = np.arange(pos, pos + n)
            pos += n
        return out

    def lookup(self, info: np.ndarray, n: int) -> np.ndarray:
        """The URL-order numbers of the first ``n`` samples of a padded uint8 ``source_info`` batch."""
        rows = np.ascontiguousarray(info[:n])
        keys = rows.view(f"S{rows.shape[1]}").ravel().tolist()  # 'S' drops the zero padding
        try:
            return np.array(list(map(self.table.__getitem__, keys)), dtype=np.int64)
        except KeyError as e:
            raise DataError(f"DALI read a sample its index files do not list: {e.args[0][:200]!r}") from None


def _raw_checkpoint(pipe) -> bytes:
    """(Producer thread) the DALI pipeline's state after its last ``outputs()`` (~0.2 ms)."""
    checkpoint = pipe.checkpoint()
    return checkpoint.encode("latin-1") if isinstance(checkpoint, str) else checkpoint


def _checkpoint(pipe, batch: int) -> dict:
    """:func:`_raw_checkpoint` as text, with the epoch's batch count: a resume position."""
    return {"checkpoint": base64.b64encode(_raw_checkpoint(pipe)).decode("ascii"), "batch": batch}


class DaliReader:
    """DALI's webdataset reader behind one DALI pipeline kept for all epochs."""

    name = "dali"

    def __init__(self, loader):
        # a weak proxy: no ImageLoader <-> reader cycle (a DALI pipeline left to the cycle collector
        # could be collected in a forked reader worker, which crashes it)
        self.loader = weakref.proxy(loader)  # the ImageLoader: options, stream (urls, counts, epoch, shape), helpers
        self.stream = loader.stream
        self.handed_out: dict | None = None  # {"checkpoint", "batch"} after the last batch handed out
        self._resume: dict | None = None  # {"checkpoint", "batch"} to restore on the next iteration
        self._pipe = None
        self._replaced = []  # pipelines replaced by a decoder switch: kept two iterations (their batches' memory)
        self._batch = 0  # batches of this epoch made
        self._steps = None  # batches of an epoch on this rank (set by the first pass)
        self._numbers: SampleNumbers | None = None  # source_info -> sample numbers (built with the pipeline)
        self._delivered: np.ndarray | None = None  # this epoch's samples handed out (global numbers), this rank
        self._rest = StreamReader(loader)  # reads the rest of an epoch resumed on another shape
        self._rest_next = False  # the next iteration is such a rest (a global state was loaded)
        self._rest_now = False  # this iteration is one

    @property
    def delivered(self):
        """Something handed out since the last load (the loader then reports its own state, not the loaded one)."""
        return self._rest.delivered if self._rest_now else self.handed_out

    # ---- state ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._replaced = age_replaced(self._replaced)
        self._rest_now, self._rest_next = self._rest_next, False
        if self._rest_now:
            self._rest.start()
            return
        self._rest._pipe = None  # a rest's pipeline is not needed any more
        if self._resume is None:
            self._delivered = None  # a new epoch: nothing handed out

    def handed(self, position) -> None:
        if self._rest_now:
            self._rest.handed(position)
            return
        if position is None:
            return
        position = dict(position)
        numbers = position.pop("numbers")
        last = position.pop("last")
        if self._delivered is None:
            self._delivered = np.zeros(sum(self.stream.counts), dtype=bool)
        if last:
            self._delivered[:] = True  # the epoch is over on this rank (drop_last's rest included)
        else:
            self._delivered[numbers] = True
        self.handed_out = position

    def _identity(self) -> dict:
        return {"samples": sum(self.stream.counts), "shards": fingerprint(self.stream.urls, self.stream.counts)}

    def state(self) -> dict:
        from datapipe.order import elastic

        if self._rest_now or self._rest_next:
            return {"stream": self._rest.state()["stream"], "dali": None, "elastic": True}
        dali = None
        if self.handed_out is not None:
            dali = {**self.handed_out, **self._identity(),
                    "delivered": elastic.pack_bitmap(self._delivered) if self._delivered is not None else None}
        return {"stream": self.stream.state_dict(), "dali": dali}

    def next_state(self, epoch: int) -> dict:
        """The state of the start of ``epoch``, between passes: DALI's pipeline goes on from where the last epoch
        ended (its checkpoint, nothing delivered), or, after a pass stopped early, a new one starts (as here)."""
        from datapipe.order import elastic

        dali = None
        if self.handed_out is not None and self._pipe is not None and self._batch in (0, self._steps):
            dali = {"checkpoint": self.handed_out["checkpoint"], "batch": 0, **self._identity(),
                    "delivered": elastic.pack_bitmap(np.zeros(sum(self.stream.counts), dtype=bool))}
        return {"stream": stream_start(self.stream.state_dict(), epoch), "dali": dali}

    def _bitmap(self, dali: dict) -> np.ndarray:
        """The delivered bitmap of a rank's ``"dali"`` state, checked against these shards."""
        from datapipe.order import elastic

        mine = self._identity()
        if dali.get("delivered") is None or "samples" not in dali:
            raise ValueError("this DALI-reader state records no delivered samples (taken by an older version): "
                             "resume it on the same world_size")
        if dali["samples"] != mine["samples"] or dali.get("shards") != mine["shards"]:
            raise ValueError("this DALI-reader state was taken over other shards "
                             f"({counted(dali['samples'], 'sample')}, shards {dali.get('shards')}; these hold {mine['samples']}, shards {mine['shards']})")
        return elastic.unpack_bitmap(dali["delivered"], mine["samples"])

    def load(self, state: dict) -> None:
        if state.get("elastic"):  # taken while reading the rest of an elastically resumed epoch
            self._rest.load(state)
            self._rest_next, self._resume, self.handed_out, self._delivered = True, None, None, None
            return
        self._rest_next = False
        dali = state["dali"]
        self._delivered = self._bitmap(dali) if dali is not None and dali.get("delivered") is not None else None
        self._resume = self.handed_out = None if dali is None else {"checkpoint": dali["checkpoint"],
                                                                     "batch": dali["batch"]}
        self._pipe = None
        self.stream.load_state_dict(state["stream"])

    def load_merged(self, states: list[dict]) -> None:
        """The rank states of a global state taken on another world size: the epoch's rest through ShardStream."""
        from datapipe.order import elastic

        kinds = {bool(r.get("elastic")) for r in states}
        if kinds == {True}:  # taken during such a rest: ShardStream's own elastic resume
            self._rest.load_merged(states)
        elif kinds == {False}:
            epochs = {int(r["epoch"]) for r in states}
            if len(epochs) != 1:
                raise ValueError(f"rank states disagree on the epoch: {sorted(epochs)}")
            total = sum(self.stream.counts)
            done = np.zeros(total, dtype=bool)
            for r in states:
                if r.get("dali") is not None:
                    done |= self._bitmap(r["dali"])
            stream = self.stream
            g = elastic.planned_state(elastic.mask_ranges(~done), epoch=epochs.pop(), seed=stream.seed,
                                      world_size=len(states), total=total, shuffle_buffer=stream.shuffle_buffer)
            self._rest.load_merged([{"stream": s} for s in g["ranks"]])
        else:
            raise ValueError("this global state mixes DALI-reader rank states with elastic-rest ones")
        self._rest_next, self._resume, self.handed_out, self._delivered = True, None, None, None
        self._pipe = None

    # ---- batches ----------------------------------------------------------------------------------
    def _labels(self, labels_tl, n: int) -> list[int]:
        """The first ``n`` labels of a DALI reader batch (ASCII ints parsed in one numpy pass)."""
        lo = self.loader
        decoder = lo.label_decoder
        if decoder is parse_label:
            values = parse_ascii_ints(np.asarray(labels_tl.as_tensor())[:n])
            if values is not None:
                return values
        labels = []
        for i in range(n):
            data = np.asarray(labels_tl.at(i)).tobytes()
            if decoder is parse_label:
                data = data.rstrip(b"\0")  # the zero padding of pad_labels
            try:
                labels.append(int(decoder(data)))
            except Exception as e:
                raise DataError(f"cannot decode label {lo.read.label_key!r}: {e}", key=f"#{i}") from e
        return labels

    def produce(self) -> Iterator:
        """(Producer thread) DALI's webdataset reader -> ``((images, labels), position)``.

        ``position``: ``{"checkpoint", "batch"}`` plus the batch's global sample numbers and whether
        it ends the epoch (taken into the delivered bitmap when handed out). The rest of an epoch
        resumed on another shape comes from the stream reader instead.
        """
        from datapipe.storage.urls import local_path

        if self._rest_now:
            yield from self._rest.produce()
            return

        lo = self.loader
        read = lo.read
        batch_size = lo.batch_size
        paths = [local_path(u) for u in self.stream.urls]
        counts = self.stream.counts
        shards = [i for i, c in enumerate(counts) if c > 0]
        paths = [paths[i] for i in shards]
        urls = [self.stream.urls[i] for i in shards]  # as the user named them, for errors
        rank, world = lo._rank_world()
        per_rank = samples_per_rank(sum(counts), world)
        steps = per_rank // batch_size if read.drop_last else math.ceil(per_rank / batch_size)
        # pad_last_batch: every rank's DALI epoch is ceil(per_rank / batch) batches (the last one padded
        # by repeating a sample), so epochs stay aligned with ours and one pipeline serves them all
        dali_steps = math.ceil(per_rank / batch_size)
        self._steps = steps
        indexes = index_paths(paths, read.index_dir)
        reader = dict(
            paths=paths, index_paths=indexes,
            ext=[";".join(read.image_exts), read.label_key],
            missing_component_behavior="error", random_shuffle=self.stream.shuffle,
            initial_fill=self.stream.shuffle_buffer if self.stream.shuffle_buffer > 1 else SHUFFLE_WINDOW,
            shard_id=rank, num_shards=world, stick_to_shard=True,
            pad_last_batch=True, read_ahead=False,
        )
        first = 0
        checkpoint = None
        if self._resume is not None:
            first, checkpoint = self._resume["batch"], base64.b64decode(self._resume["checkpoint"])
            self._resume = None
            self._pipe = None
        elif self._pipe is not None and self._batch not in (0, steps):
            self._pipe = None  # the last epoch was left unfinished: its batches are still in flight
        if self._pipe is None:
            self._numbers = SampleNumbers(paths, indexes, counts, shards)
            pipe = lo._pipeline(reader=reader, checkpoint=checkpoint, source_info=True)
            try:
                pipe.build()
            except RuntimeError as e:  # e.g. a sample without an image (DALI checks the index)
                raise reader_error(e, paths, first, urls, index_files=indexes, exts=reader["ext"]) from e
            self._pipe = pipe
        pipe = self._pipe
        numbers = self._numbers
        to_global = numbers.to_global(shard_order(len(counts), shuffle=self.stream.shuffle, seed=self.stream.seed,
                                                  epoch=lo.epoch))
        stream = torch.cuda.current_stream(lo.device) if lo._dali_cuda else None
        seconds = lo._seconds
        self._batch = first
        left = per_rank - first * batch_size
        for _ in range(first, steps):
            if lo._decoder.due:
                pipe = self._switch_decoder(pipe, reader, paths)
            t0 = time.perf_counter()
            try:
                images_tl, labels_tl, info_tl = run_pipeline(pipe, stream)
            except RuntimeError as e:
                self._pipe = None  # a failed pipeline is not valid any more
                raise reader_error(e, paths, self._batch, urls, index_files=indexes, exts=reader["ext"]) from e
            t1 = time.perf_counter()
            n = min(batch_size, left)
            left -= n
            images = lo._to_torch(images_tl, stream, zero_copy=pipe.exec_dynamic)[:n]
            labels = self._labels(labels_tl, n)
            taken = to_global[numbers.lookup(np.asarray(info_tl.as_tensor()), n)]
            seconds["dali"] += t1 - t0
            seconds["copy"] += time.perf_counter() - t1
            self._batch += 1
            if self._batch == steps:  # drop_last: the partial batch DALI still holds
                for _ in range(dali_steps - steps):
                    run_pipeline(pipe, stream)
            position = {**_checkpoint(pipe, self._batch), "numbers": taken, "last": self._batch == steps}
            yield lo._prepare(images, labels), position

    def _switch_decoder(self, pipe, reader: dict, paths: list[str]):
        """(Producer thread) the decoder choice changed: a pipeline with the new one, from the old one's checkpoint.

        The checkpoint holds the reader's position and every random state after the last batch
        made, so the new pipeline makes exactly the batch the old one would have made next.
        """
        lo = self.loader
        t0 = time.perf_counter()
        checkpoint = _raw_checkpoint(pipe)
        lo._decoder.switching(in_flight=lo.read.prefetch_queue_depth)  # batches queued for the consumer
        new = lo._pipeline(reader=reader, checkpoint=checkpoint, source_info=True)
        try:
            new.build()
        except RuntimeError as e:
            raise reader_error(e, paths, self._batch) from e
        self._replaced.append([pipe, 2])
        self._pipe = new
        lo._decoder.switched(time.perf_counter() - t0)
        return new
