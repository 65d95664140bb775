"""``ImageLoader``'s DALI reader: local shards read by DALI's own ``fn.readers.webdataset``.

DALI reads, shuffles and partitions (contiguous ``samples_per_rank`` slices); resume is a DALI
pipeline checkpoint (reader positions and random states) plus the batch count of the epoch. The
reader's part of the loader's state: ``{"stream": the ShardStream's own state (epoch, rank, shape),
"dali": {"checkpoint", "batch"}}``.
"""
from __future__ import annotations

import base64
import hashlib
import math
import os
import re
import tempfile
import time
import weakref
from typing import Iterator

import numpy as np
import torch

from datapipe.errors import DataError
from datapipe.order.plan import samples_per_rank
from loaders.images.encoded import parse_ascii_ints, parse_label


def reader_error(error: RuntimeError, paths: list[str], batch: int) -> DataError:
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


def index_paths(paths: list[str], index_dir: str | None) -> list[str]:
    """DALI index files of local shards: beside the shard when fresh, else made in ``index_dir``."""
    from datapipe.tar.dali_index import default_index_path, write_dali_index

    out = []
    for path in paths:
        beside = default_index_path(path)
        if os.path.exists(beside) and os.path.getmtime(beside) >= os.path.getmtime(path):
            out.append(beside)
            continue
        directory = index_dir or os.path.join(tempfile.gettempdir(), "datapipe-dali-index")
        st = os.stat(path)
        tag = hashlib.sha1(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
        target = os.path.join(directory, f"{os.path.basename(path)}.{tag}.idx")
        if not os.path.exists(target):
            os.makedirs(directory, exist_ok=True)
            write_dali_index(path, target)
        out.append(target)
    return out


def _checkpoint(pipe, batch: int) -> dict:
    """(Producer thread) the DALI pipeline's state after its last ``outputs()`` (~0.2 ms)."""
    checkpoint = pipe.checkpoint()
    if isinstance(checkpoint, str):
        checkpoint = checkpoint.encode("latin-1")
    return {"checkpoint": base64.b64encode(checkpoint).decode("ascii"), "batch": batch}


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
        self._batch = 0  # batches of this epoch made

    # ---- state ------------------------------------------------------------------------------------
    def start(self) -> None:
        pass

    def handed(self, position) -> None:
        if position is not None:
            self.handed_out = position

    def state(self) -> dict:
        return {"stream": self.stream.state_dict(), "dali": self.handed_out}

    def load(self, state: dict) -> None:
        self._resume = self.handed_out = state["dali"]
        self._pipe = None
        self.stream.load_state_dict(state["stream"])

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
        """(Producer thread) DALI's webdataset reader -> ``((images, labels), {"checkpoint", "batch"})``."""
        from datapipe.storage.urls import local_path

        lo = self.loader
        read = lo.read
        batch_size = lo.batch_size
        paths = [local_path(u) for u in self.stream.urls]
        counts = self.stream.counts
        paths = [paths[i] for i, c in enumerate(counts) if c > 0]
        rank, world = lo._rank_world()
        per_rank = samples_per_rank(sum(counts), world)
        steps = per_rank // batch_size if read.drop_last else math.ceil(per_rank / batch_size)
        # pad_last_batch: every rank's DALI epoch is ceil(per_rank / batch) batches (the last one padded
        # by repeating a sample), so epochs stay aligned with ours and one pipeline serves them all
        dali_steps = math.ceil(per_rank / batch_size)
        reader = dict(
            paths=paths, index_paths=index_paths(paths, read.index_dir),
            ext=[";".join(read.image_exts), read.label_key],
            missing_component_behavior="error", random_shuffle=read.shuffle,
            initial_fill=max(1, read.shuffle_buffer), shard_id=rank, num_shards=world, stick_to_shard=True,
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
            pipe = lo._pipeline(reader=reader, checkpoint=checkpoint)
            try:
                pipe.build()
            except RuntimeError as e:  # e.g. a sample without an image (DALI checks the index)
                raise reader_error(e, paths, first) from e
            self._pipe = pipe
        pipe = self._pipe
        stream = torch.cuda.current_stream(lo.device) if lo._dali_cuda else None
        seconds = lo._seconds
        self._batch = first
        left = per_rank - first * batch_size
        for _ in range(first, steps):
            t0 = time.perf_counter()
            try:
                images_tl, labels_tl = pipe.run(stream)
            except RuntimeError as e:
                self._pipe = None  # a failed pipeline is not valid any more
                raise reader_error(e, paths, self._batch) from e
            t1 = time.perf_counter()
            n = min(batch_size, left)
            left -= n
            images = lo._to_torch(images_tl, stream, zero_copy=pipe.exec_dynamic)[:n]
            labels = self._labels(labels_tl, n)
            seconds["dali"] += t1 - t0
            seconds["copy"] += time.perf_counter() - t1
            self._batch += 1
            if self._batch == steps:  # drop_last: the partial batch DALI still holds
                for _ in range(dali_steps - steps):
                    pipe.run(stream)
            yield lo._prepare(images, labels), _checkpoint(pipe, self._batch)
