"""Encoded images in batches, before DALI: signature check, labels, batching, pinning, worker packing.

The stream reader of :class:`loaders.ImageLoader` turns ShardStream samples into :class:`RawBatch`
es here (in a thread, or in worker processes through :class:`EncodedBatches`); DALI decodes them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from datapipe.errors import DataError, ErrorPolicy, OnError, remember
from datapipe.image_bytes import GIF_STARTS, header_problem, image_format, truncation

log = logging.getLogger("loaders.images")


def image_problem(data) -> str | None:
    """What is wrong with an image entry that a cheap look can tell, before DALI sees it; None if nothing.

    Empty entries, a missing or unknown file signature (text, garbage), truncation
    (:func:`datapipe.image_bytes.truncation`: a JPEG without its end-of-image marker, a PNG without
    its IEND chunk, a WebP shorter than its header says) and a damaged header
    (:func:`datapipe.image_bytes.header_problem`: DALI's CPU decoder crashes the process on some).
    """
    if len(data) == 0:
        return "empty file"
    fmt = image_format(data)
    if fmt is None:
        return "not an image (unknown or missing file signature)"
    return truncation(data) or header_problem(data, fmt=fmt)


def dali_readable(data):
    """``data`` as DALI can decode it: as it is, except a GIF (which DALI cannot decode), re-encoded as PNG.

    The first frame, in RGB (PIL); a GIF PIL cannot read raises ``ValueError`` saying why.
    """
    if bytes(data[:6]) not in GIF_STARTS:
        return data
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(bytes(data))) as im:
            rgb = im.convert("RGB")
    except Exception as e:  # PIL raises many types for damaged files
        raise ValueError(f"cannot read the GIF: {type(e).__name__}: {e}") from e
    out = io.BytesIO()
    rgb.save(out, format="PNG", compress_level=1)
    return out.getvalue()


def parse_label(data: bytes) -> int:
    """webdataset's ``cls`` convention: an ASCII integer."""
    return int(data.decode("ascii").strip())


def parse_ascii_ints(rows: np.ndarray) -> list[int] | None:
    """Rows of zero-padded ASCII digits (``b"123\\0\\0"``) as ints; None when a row is anything else."""
    if rows.ndim != 2 or rows.shape[1] == 0 or rows.shape[1] > 18:
        return None
    digits = (rows >= 48) & (rows <= 57)
    lengths = digits.sum(axis=1)
    # every row: one or more digits first, then only padding (no sign, spaces or newline: the slow path)
    if not (lengths > 0).all() or not (digits == (np.arange(rows.shape[1]) < lengths[:, None])).all():
        return None
    if (rows[~digits] != 0).any():
        return None
    power = lengths[:, None] - 1 - np.arange(rows.shape[1])
    values = np.where(digits, (rows.astype(np.int64) - 48) * 10 ** np.clip(power, 0, None), 0).sum(axis=1)
    return values.tolist()


@dataclass
class RawBatch:
    """Encoded images of one batch plus what the loader needs to finish it."""

    arrays: list[np.ndarray] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    state: dict | None = None  # ShardStream state after this batch's last sample
    owner: Any = None  # what the arrays are views of (read_workers > 0), kept alive with them
    marks: list = field(default_factory=list)  # the source's mark after each sample (``mark_fn``)


def iter_raw_batches(
    samples: Iterator[dict],
    *,
    batch_size: int,
    drop_last: bool,
    image_exts: Sequence[str],
    label_key: str,
    label_decoder: Callable[[bytes], int],
    on_error: OnError | ErrorPolicy,
    stats: dict | None = None,
    state_fn: Callable[[], dict] | None = None,
    mark_fn: Callable[[], Any] | None = None,
) -> Iterator[RawBatch]:
    """Group samples into batches of encoded images + int labels; bad samples go to ``on_error``
    (see ``handle_bad``: an ``ErrorPolicy`` counts them, else ``stats`` does).

    ``state_fn``: the source's state, kept after each batch's last sample (``RawBatch.state``).
    ``mark_fn``: the source's cheap marker (``ShardStream.mark``), kept after each sample (``RawBatch.marks``).
    """
    batch = RawBatch()
    for sample in samples:
        key, url = sample.get("__key__"), sample.get("__url__")
        try:
            data = next((sample[e] for e in image_exts if e in sample), None)
            if data is None:
                raise DataError(f"sample has no image entry ({'/'.join(image_exts)}); it has {sorted(sample)}",
                                url=url, key=key)
            problem = image_problem(data)
            if problem is not None:
                raise DataError(f"image entry: {problem}", url=url, key=key)
            try:
                data = dali_readable(data)
            except ValueError as e:
                raise DataError(f"image entry: {e}", url=url, key=key) from e
            if label_key not in sample:
                raise DataError(f"sample has no {label_key!r} entry", url=url, key=key)
            try:
                value = sample[label_key]
                label = int(label_decoder(bytes(value) if isinstance(value, memoryview) else value))
            except Exception as e:
                raise DataError(f"cannot decode label {label_key!r}: {e}", url=url, key=key) from e
        except DataError as e:
            handle_bad(e, on_error, stats)
            continue
        batch.arrays.append(np.frombuffer(data, dtype=np.uint8))
        batch.labels.append(label)
        batch.keys.append(key)
        batch.urls.append(url)
        if mark_fn is not None:
            batch.marks.append(mark_fn())
        if len(batch.arrays) == batch_size:
            batch.state = state_fn() if state_fn else None
            yield batch
            batch = RawBatch()
    if batch.arrays and not drop_last:
        batch.state = state_fn() if state_fn else None
        yield batch


def handle_bad(err: DataError, on_error: OnError | ErrorPolicy, stats: dict | None = None) -> None:
    """A bad sample: ``on_error`` raises (stop) or lets it through, counted as one skipped.

    ``on_error``: an :class:`~datapipe.errors.ErrorPolicy`, which counts it; or a handler name / callable,
    with ``stats`` (a dict with ``"skipped"`` and ``"last_errors"``) counting it.
    """
    if isinstance(on_error, ErrorPolicy):
        on_error(err)
        return
    if stats is None:
        raise TypeError("handle_bad: give an ErrorPolicy as on_error, or a stats dict to count in")
    ErrorPolicy(on_error, log=log).handler(err)
    stats["skipped"] += 1
    stats["last_errors"] = remember(stats["last_errors"], err)


def keep(item):
    """collate_fn of the reader workers' loader: batches are made in the workers."""
    return item


class EncodedBatches(torch.utils.data.IterableDataset):
    """ShardStream samples grouped into raw batches packed as tensors, for reader worker processes.

    Follows ShardStream's worker-state protocol (loaders.DataLoader resumes it exactly). A worker's
    partial last batch (its tail) always comes, whatever ``drop_last``, with ``"tail"``: the worker's
    logical id and its stream positions before the tail and after each of its samples; the state
    sent with it is the one before the tail, so that the main process, which joins the workers'
    tails into full batches (:func:`loaders.images.stream_reader.join_tails`), owns it until then.
    Other batches have ``"tail": None``.
    """

    def __init__(self, stream, **batching):
        self.stream = stream
        self.batching = batching
        self._held: dict | None = None  # the state sent with a tail: the stream's before the tail

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def state_dict(self) -> dict:
        return self._held if self._held is not None else self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)

    def forget_resume(self) -> None:
        """Drop a loaded resume the worker processes took (``ShardStream.forget_resume``): the next pass is whole."""
        self.stream.forget_resume()

    def __iter__(self):
        self._held = None
        policy = ErrorPolicy(self.batching.get("on_error", "raise"), log=log)
        size = self.batching["batch_size"]
        mark_fn = getattr(self.stream, "mark", None)  # a state only for the samples that end in the tail
        reported = 0
        for raw in iter_raw_batches(iter(self.stream), **{**self.batching, "on_error": policy, "drop_last": False,
                                                           "mark_fn": mark_fn}):
            skipped = policy.skipped  # bad images (what the stream loses reaches the main process by its ledger)
            sizes = [len(a) for a in raw.arrays]
            offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
            np.cumsum(sizes, out=offsets[1:])
            data = torch.empty(int(offsets[-1]), dtype=torch.uint8)
            view = data.numpy()
            for a, start, end in zip(raw.arrays, offsets[:-1], offsets[1:]):
                view[start:end] = a
            errors = policy.last_errors[-(skipped - reported):] if skipped > reported else []
            tail = self._tail(raw) if len(raw.arrays) < size else None
            yield {"data": data, "offsets": torch.from_numpy(offsets), "labels": torch.tensor(raw.labels),
                   "keys": raw.keys, "urls": raw.urls, "skipped": skipped - reported, "errors": errors, "tail": tail}
            reported = skipped
        self._held = None

    def _tail(self, raw: RawBatch) -> dict:
        """A tail's ``"tail"`` entry; the state before it becomes the one :meth:`state_dict` sends.

        Built from the marks of its samples, at the worker's end (its stream's pass is over).
        """
        if not raw.marks:  # a source without marks (tests)
            return {"worker": 0, "after": None}
        stream = self.stream
        self._held = stream.state_before(raw.marks[0])  # the tail's first sample is drawn next
        ((worker, end),) = stream.state_dict()["workers"].items()
        after = [stream.state_after(m)["workers"][worker] for m in raw.marks[:-1]] + [end]  # the last: the end
        return {"worker": worker, "after": after}
